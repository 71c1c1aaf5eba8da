"""Single-stream decode: ms per token and tokens/s, beside the HBM roofline (weight bytes /
peak bandwidth: every decode step reads all weights once), and the time to the first token of a
fresh prompt (each run's prompt is new: no prefix-cache hit shortens it). Greedy unless
--sampling names other settings (NAME=JSON SamplingParams fields), each measured in turn on one
engine: a row each."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench_common import (HBM_BYTES_PER_S, add_model_args, add_pdl_arg, add_scheduling_arg,
                          git_commit, hardware, kv_bytes_per_token, kv_elem_bytes, kv_note, model_and_config,
                          parse_setting, pdl_setting, step_table, weight_cost, write_results)

from engine import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="the engine's max_model_len (capped at the model's positions)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--sampling", type=parse_setting, nargs="+", metavar="NAME=JSON",
                    default=[("greedy", {"temperature": 0.0})], help="sampling settings, each measured in turn")
    add_scheduling_arg(ap)
    add_pdl_arg(ap)
    ap.add_argument("--out", default="benchmarks/latency")
    args = ap.parse_args()

    import torch
    model_dir, cfg = model_and_config(args.preset, args.model)
    llm = LLM(model_dir, load_format="dummy", dtype=args.dtype,
              skip_tokenizer_init=True, max_num_seqs=8,
              max_model_len=min(args.max_model_len, cfg.get("max_position_embeddings", args.max_model_len)),
              enforce_eager=args.enforce_eager, async_scheduling=not args.sync_scheduling,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, **pdl_setting(args))
    core = llm.core
    core.times.gpu_events = True        # where each step's time goes, the GPU's part included

    def prompt(it: int) -> list[int]:       # a new one each run: its first token already differs
        return [(i * 7919 + it * 104729 + 1) % cfg["vocab_size"] for i in range(args.input_len)]

    def measure(params: SamplingParams, runs: range) -> tuple[list[float], list[float], list[int], object]:
        """Per-token step ms, TTFTs and prefix-cache hits of the runs after the first (a warm-up),
        and the step times from there."""
        step_ms, ttft_ms, cached = [], [], []
        for it in runs:
            if it == runs[1]:
                before = core.times.copy()
            start = time.perf_counter()
            request = core.make_request(f"lat{it}", prompt(it), params)
            core.add_request(request)
            first, times = None, []
            while core.has_unfinished_requests():
                t0 = time.perf_counter()
                outs = core.step()          # async scheduling: the token of the step launched before
                t1 = time.perf_counter()
                if outs and first is None:
                    first = 1e3 * (t1 - start)
                elif outs:
                    times.append(1e3 * (t1 - t0))
            if it != runs[0]:
                ttft_ms.append(first)
                step_ms.extend(times)
                cached.append(request.num_cached_tokens)
        return step_ms, ttft_ms, cached, before

    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    weight_bytes = weight_cost(cfg, elem, args.quantization).bytes
    # Per token the step also reads the sequence's KV (small at this length): count it.
    kv_bytes = kv_bytes_per_token(cfg, kv_elem_bytes(args)) * (args.input_len + args.output_len // 2)
    roofline_ms = 1e3 * (weight_bytes + kv_bytes) / HBM_BYTES_PER_S
    rows = []
    for n, (name, fields) in enumerate(args.sampling):
        params = SamplingParams(**({"temperature": 0.0} | fields | {"max_tokens": args.output_len, "ignore_eos": True}))
        step_ms, ttft_ms, cached, before = measure(params, range(n * (args.iters + 1), (n + 1) * (args.iters + 1)))
        ms = statistics.median(step_ms)
        rows.append({
            "setting": name, "sampling": fields,
            "preset": args.preset, "dtype": args.dtype, "kv_cache_dtype": llm.config.kv_cache_dtype,
            "quantization": llm.config.quantization,
            "input_len": args.input_len,
            "output_len": args.output_len, "enforce_eager": args.enforce_eager,
            "async_scheduling": not args.sync_scheduling, "decode_pdl": llm.config.decode_pdl,
            "decode_late_merge": llm.config.decode_late_merge,
            # the skinny GEMM config each projection runs in a one-row decode graph (PDL chain)
            "chain_configs_1_row": {r["proj"]: r.get("chain") for r in getattr(core.runner, "gemm_report", [])
                                    if r["rows"] == 1 and not r["silu_mul"]},
            "ms_per_token_median": ms, "ms_per_token_p90": statistics.quantiles(step_ms, n=10)[8],
            "tokens_per_s": 1e3 / ms, "ttft_ms_median": statistics.median(ttft_ms),
            "ttft_cached_tokens": cached,        # prefix-cache hits of the measured runs: 0 each
            "weight_bytes": weight_bytes, "roofline_ms_per_token": roofline_ms,
            "fraction_of_roofline": roofline_ms / ms,
            "achieved_hbm_tb_per_s": (weight_bytes + kv_bytes) / (ms * 1e-3) / 1e12,
            # mean per step over the measured runs (their first, prefill, steps included)
            "step_ms": core.times.since(before).per_step_ms(), "batch": 1})
    meta = {"title": f"Single-stream decode, {args.model or args.preset} ({args.dtype}{kv_note(args)}, dummy weights)",
            "hardware": hardware(), "commit": git_commit(),
            "command": " ".join(["python"] + sys.argv),
            "roofline": "weights + KV bytes / 4.8 TB/s (H200 spec); target >= 80%"}
    table = ["| setting | ms/token (median) | p90 | tokens/s | roofline ms/token | % of roofline | "
             "achieved TB/s | TTFT ms |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    table += [f"| {r['setting']} | {r['ms_per_token_median']:.2f} | {r['ms_per_token_p90']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {roofline_ms:.2f} | {100 * r['fraction_of_roofline']:.1f}% | "
              f"{r['achieved_hbm_tb_per_s']:.2f} | {r['ttft_ms_median']:.1f} |" for r in rows]
    table += ["", "Where a step's time goes (ms per step, mean over the measured runs):", ""]
    table += step_table(rows, ["setting"])
    write_results(args.out, meta, rows, table)


if __name__ == "__main__":
    main()
