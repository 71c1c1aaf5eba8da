"""Offline throughput for fixed input/output lengths, beside HF transformers `generate` on the
same model and GPU, and beside the workload's roofline.

Roofline: prefill at peak bf16 FLOP/s (2 * params * tokens, plus attention), decode at peak HBM
bandwidth (every step at full batch reads the weights once plus each sequence's KV).

Each --max-num-seqs value runs its engine in a fresh child process (this script again, with
--one-engine), so each engine sizes its KV cache from a GPU no earlier engine touched. A child
that fails (out of memory, a crash) becomes rows marked failed, with its exit code and the end
of its stderr, and the sweep goes on. The results are rewritten after every
row, so a run cut off by a time limit keeps what finished.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import threading
import time

from bench_common import (BF16_DENSE_FLOPS, HBM_BYTES_PER_S, StepTrace, add_model_args, add_scheduling_arg,
                          kv_elem_bytes, kv_note, git_commit, hardware, kv_bytes_per_token, model_and_config,
                          sampling_fields, step_table, weight_cost, write_results)

from engine.config import CAPACITY_POLICIES  # noqa: E402 - bench_common puts the root on the path

# A child reports on stdout in lines of this prefix, a kind ("row", "hardware"), ": " and JSON.
MESSAGE_PREFIX = "bench_throughput "
STDERR_TAIL_LINES = 20


def roofline_s(cfg: dict, n: int, inp: int, out: int, batch: int, elem: int, kv_elem: int | None = None,
               quantization: str | None = None) -> float:
    """The job's roofline: prefill FLOPs at peak, then decode at the larger of its bytes (weights
    once a step, of `elem` bytes a parameter, or one for FP8 projections; each token's KV,
    `kv_elem` bytes a value, default elem) over HBM and its FLOPs at peak (FP8 projections at
    the FP8 peak: bench_common.weight_cost). The two phases are added: steps that mix prompt
    chunks with decode rows can hide prefill FLOPs under decode's bytes, so a schedule of such
    steps may beat it (benchmarks/roofline_correction.md)."""
    w = weight_cost(cfg, elem, quantization)
    layers, hq = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    attn_flops_per_token_ctx = 4 * layers * hq * d          # QK^T and PV, per key
    # The first output token comes from the prompt's step (its logits): out - 1 decode steps.
    decode = max(out - 1, 0)
    prefill_s = n * (w.s_per_prompt_token * inp + (w.s_per_sequence if out else 0)
                     + attn_flops_per_token_ctx * inp * inp / 2 / BF16_DENSE_FLOPS)
    decode_flops_s = n * (w.s_per_token * decode
                          + attn_flops_per_token_ctx * decode * (inp + out / 2) / BF16_DENSE_FLOPS)
    steps = -(-n // batch) * decode
    kv = kv_bytes_per_token(cfg, elem if kv_elem is None else kv_elem)
    decode_bytes = steps * w.bytes + n * decode * kv * (inp + out / 2)
    return prefill_s + max(decode_bytes / HBM_BYTES_PER_S, decode_flops_s)


def workload_lengths(text: str) -> tuple[int, int]:
    """An argparse type: 'INPUTxOUTPUT' -> (input, output) lengths, each at least 1."""
    inp, sep, out = text.partition("x")
    if not (sep and inp.isdigit() and out.isdigit() and int(inp) >= 1 and int(out) >= 1):
        raise argparse.ArgumentTypeError(f"a workload is INPUTxOUTPUT lengths, each at least 1 "
                                         f"(e.g. 1000x1000), got {text!r}")
    return int(inp), int(out)


def workload_prompts(cfg: dict, workloads: list[tuple[int, int]], num_prompts: int) -> dict:
    """Random token ids per (input, output) workload; seeded, so every process draws the same."""
    rng = random.Random(0)
    return {(inp, out): [[rng.randrange(cfg["vocab_size"]) for _ in range(inp)]
                         for _ in range(num_prompts)] for inp, out in workloads}


def run_engine(llm, prompts, out_len, sampling: dict | None = None) -> float:
    """Seconds for the prompts, greedy unless `sampling` (SamplingParams fields) says else."""
    from engine import SamplingParams
    params = SamplingParams(**({"temperature": 0.0} | (sampling or {}) | {"max_tokens": out_len, "ignore_eos": True}))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return elapsed


def one_engine(args, model_dir: str, cfg: dict, workloads, max_num_seqs: int) -> None:
    """The child's work: one engine through every workload, each row printed as it finishes."""
    import torch
    from engine import LLM
    # The parent asks no CUDA for it: a CUDA context there would shrink the children's KV cache.
    print(MESSAGE_PREFIX + "hardware: " + json.dumps(hardware()), flush=True)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    prompts_of = workload_prompts(cfg, workloads, args.num_prompts)
    llm = LLM(model_dir, load_format="dummy", dtype=args.dtype,
              skip_tokenizer_init=True, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max(i + o for i, o in workloads), enable_prefix_caching=False,
              async_scheduling=not args.sync_scheduling,
              capacity_scheduler_policy=args.capacity_policy, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization)
    llm.core.times.gpu_events = True     # where each step's time goes, the GPU's included
    for inp, out in workloads:
        prompts = prompts_of[(inp, out)]
        run_engine(llm, prompts[:8], min(8, out), args.sampling)             # warm-up
        before, stats0 = llm.core.times.copy(), llm.get_stats()
        trace = StepTrace(llm.core) if args.step_trace else None
        t = run_engine(llm, prompts, out, args.sampling)
        stats1 = llm.get_stats()
        roof = roofline_s(cfg, args.num_prompts, inp, out, max_num_seqs, elem, kv_elem_bytes(args), args.quantization)
        row = {"input_len": inp, "output_len": out, "num_prompts": args.num_prompts,
               "max_num_seqs": max_num_seqs, "failed": False, "sampling": args.sampling,
               "engine_s": t, "engine_output_tok_s": args.num_prompts * out / t,
               "engine_total_tok_s": args.num_prompts * (inp + out) / t,
               "roofline_s": roof, "fraction_of_roofline": roof / t,
               "step_ms": llm.core.times.since(before).per_step_ms(),
               # More sequences than the KV cache holds at full length: preempted, recomputed.
               "preemptions": stats1.num_preemptions - stats0.num_preemptions,
               "kv_blocks": stats1.num_kv_blocks}
        if trace is not None:
            trace.close()
            row["step_trace"] = trace.summary()
            trace.write(f"{args.out}_trace_{inp}x{out}_seqs{max_num_seqs}.json")
        print(MESSAGE_PREFIX + "row: " + json.dumps(row), flush=True)


def run_child(argv: list[str], max_num_seqs: int, handlers: dict) -> tuple[int, list[str]]:
    """This script with `--one-engine max_num_seqs` in a fresh process. Its output is passed
    through as it comes and `handlers[kind]` gets each of its messages; returns the exit code
    and the last lines of its stderr."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--one-engine", str(max_num_seqs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)

    def tee_stderr() -> None:            # a thread, so neither pipe fills while we read the other
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line.rstrip("\n"))

    tee = threading.Thread(target=tee_stderr, daemon=True)
    tee.start()
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        kind, _, payload = line[len(MESSAGE_PREFIX):].partition(": ")
        if line.startswith(MESSAGE_PREFIX) and kind in handlers:
            handlers[kind](json.loads(payload))
    returncode = proc.wait()
    tee.join()
    return returncode, list(tail)


def run_hf(model_dir: str, prompts, out_len: int, batch: int, dtype) -> float:
    """Static batches through transformers generate (SDPA attention), random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    config = AutoConfig.from_pretrained(model_dir)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    elapsed = 0.0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch], device=device)
            sync()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=out_len, min_new_tokens=out_len)
            sync()
            elapsed += time.perf_counter() - t0
            assert out.shape[1] == ids.shape[1] + out_len
    return elapsed


def best_max_num_seqs(rows: list[dict]) -> dict[str, int]:
    """Per workload, the max_num_seqs with the highest output tok/s among the runs that worked."""
    best: dict[str, dict] = {}
    for r in rows:
        if not r["failed"] and (r["workload"] not in best or r["engine_output_tok_s"]
                                > best[r["workload"]]["engine_output_tok_s"]):
            best[r["workload"]] = r
    return {w: r["max_num_seqs"] for w, r in best.items()}


def tables(rows: list[dict], workloads: list[str], sweep: list[int]) -> list[str]:
    """Markdown: output tok/s by max_num_seqs per workload (does a bigger batch pay?), the
    details of each run, the failures, and where a step's time goes."""
    best = best_max_num_seqs(rows)
    by_key = {(r["workload"], r["max_num_seqs"]): r for r in rows}
    out = ["Engine output tok/s by max_num_seqs (the best per workload in bold):", "",
           "| in/out | " + " | ".join(str(n) for n in sweep) + " | best max_num_seqs |",
           "| --- | " + " | ".join("---:" for _ in sweep) + " | ---: |"]
    for w in workloads:
        cells = []
        for n in sweep:
            r = by_key.get((w, n))
            cell = ("-" if r is None else f"failed (exit {r['returncode']})" if r["failed"]
                    else f"{r['engine_output_tok_s']:.0f}")
            cells.append(f"**{cell}**" if best.get(w) == n else cell)
        out.append(f"| {w} | " + " | ".join(cells) + f" | {best.get(w, '-')} |")
    ok = sorted((r for r in rows if not r["failed"]),
                key=lambda r: (workloads.index(r["workload"]), sweep.index(r["max_num_seqs"])))
    out += ["", "| in/out | prompts | max_num_seqs | engine out tok/s | total tok/s | "
            "roofline s | engine s | % of roofline | preemptions | HF out tok/s (prompts, best batch) "
            "| vs HF |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in ok:
        hf = (f"{r['hf_output_tok_s']:.0f} ({r['hf_prompts']}, {r['hf_batch']})"
              if "hf_s" in r else "-")
        vs = f"{r['speedup_vs_hf']:.1f}x" if "hf_s" in r else "-"
        mark = " (best)" if best.get(r["workload"]) == r["max_num_seqs"] else ""
        out.append(f"| {r['workload']} | {r['num_prompts']} | {r['max_num_seqs']}{mark} | "
                   f"{r['engine_output_tok_s']:.0f} | {r['engine_total_tok_s']:.0f} | "
                   f"{r['roofline_s']:.1f} | {r['engine_s']:.1f} | "
                   f"{100 * r['fraction_of_roofline']:.1f}% | {r.get('preemptions', '-')} | "
                   f"{hf} | {vs} |")
    failed = {r["max_num_seqs"]: r for r in rows if r["failed"]}
    if failed:
        out += ["", "Failed engines (the end of stderr is in the JSON):", ""]
        for n, r in failed.items():
            last = next((line for line in reversed(r["stderr_tail"]) if line.strip()), "")
            out.append(f"- max_num_seqs {n}: exit code {r['returncode']}: `{last.strip()}`")
    hf_tried = {r["workload"]: r["hf_by_batch"] for r in rows if len(r.get("hf_by_batch", {})) > 1}
    out += [f"- HF generate on {w} by batch: " + ", ".join(
        f"{b}: {v:.0f} tok/s" if not isinstance(v, str) else f"{b}: failed" for b, v in t.items())
        for w, t in hf_tried.items()]
    hf_errors = {r["workload"]: r["hf_error"] for r in rows if "hf_error" in r}
    out += [f"- HF generate on {w} failed: `{e}`" for w, e in hf_errors.items()]
    out += ["", "Where a step's time goes (ms per step, mean over the run):", ""]
    return out + step_table(ok, ["workload", "max_num_seqs"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__)
    add_model_args(ap)
    ap.add_argument("--workloads", nargs="+", type=workload_lengths,
                    default=[(1000, 1000), (128, 128), (2048, 128)],
                    help="INPUTxOUTPUT lengths (default 1000x1000 128x128 2048x128)")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[256],
                    help="one engine per value, each in its own process (e.g. 128 256 512 1024: "
                         "does a bigger batch pay?)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--capacity-policy", default="max_utilization", choices=CAPACITY_POLICIES,
                    help="the engine's capacity_scheduler_policy: guaranteed_no_evict admits a "
                         "request only with room for all to reach max_tokens (no preemption "
                         "when max_num_seqs is more than the KV cache holds at full length)")
    ap.add_argument("--hf-prompts", type=int, default=256,
                    help="prompts through HF generate (a subset: it is slow), after the engines")
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[128],
                    help="HF generate's static batch sizes: each is run, the best is the baseline")
    ap.add_argument("--sampling", type=sampling_fields, default={}, metavar="JSON",
                    help='SamplingParams fields for the engine\'s requests, e.g. \'{"repetition_penalty": 1.1}\' '
                         "or '{\"temperature\": 0.8, \"top_p\": 0.95, \"seed\": 1}' (default: greedy)")
    ap.add_argument("--out", default="benchmarks/throughput")
    ap.add_argument("--step-trace", action="store_true",
                    help="record every step of each run (host phases, GPU time, rows, finishes) "
                         "to <out>_trace_<in>x<out>_seqs<max_num_seqs>.json and summarise where "
                         "the GPU idled in the results")
    add_scheduling_arg(ap)
    ap.add_argument("--one-engine", type=int, default=None, metavar="MAX_NUM_SEQS",
                    help=argparse.SUPPRESS)       # the child: one engine, rows to stdout
    args = ap.parse_args(argv)

    model_dir, cfg = model_and_config(args.preset, args.model)
    workloads = args.workloads
    if args.one_engine is not None:
        one_engine(args, model_dir, cfg, workloads, args.one_engine)
        return

    sweep = list(dict.fromkeys(args.max_num_seqs))
    names = [f"{inp}/{out}" for inp, out in workloads]
    meta = {"title": f"Offline throughput, {args.preset if not args.model else args.model} "
                     f"({args.dtype}{kv_note(args)}, dummy weights)",
            "hardware": None, "commit": git_commit(),       # hardware: the children say
            "command": " ".join(["python"] + sys.argv),
            "capacity_scheduler_policy": args.capacity_policy, "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": args.quantization,
            "sampling": args.sampling,
            "targets": "1000x1000: >= 75% of roofline and >= 10x HF generate"}
    rows: list[dict] = []

    def save(echo: bool = False) -> None:
        write_results(args.out, meta, rows, tables(rows, names, sweep), echo=echo)

    def on_hardware(info: dict) -> None:
        meta["hardware"] = info

    def on_row(row: dict) -> None:
        row["workload"] = f"{row['input_len']}/{row['output_len']}"
        rows.append(row)
        save()

    for max_num_seqs in sweep:
        returncode, stderr_tail = run_child(argv, max_num_seqs,
                                            {"row": on_row, "hardware": on_hardware})
        done = {r["workload"] for r in rows if r["max_num_seqs"] == max_num_seqs}
        for (inp, out), name in zip(workloads, names):
            if name not in done:
                rows.append({"input_len": inp, "output_len": out, "workload": name,
                             "num_prompts": args.num_prompts, "max_num_seqs": max_num_seqs,
                             "failed": True, "returncode": returncode,
                             "stderr_tail": stderr_tail})
        if len(done) < len(workloads):
            print(f"engine max_num_seqs={max_num_seqs} failed (exit code {returncode}); "
                  f"going on", flush=True)
        save()
    if meta["hardware"] is None:                      # no child got that far
        meta["hardware"] = hardware()

    if args.hf_prompts:
        import torch
        dtype = getattr(torch, args.dtype)
        prompts_of = workload_prompts(cfg, workloads, args.num_prompts)
        n = min(args.hf_prompts, args.num_prompts)
        for (inp, out), name in zip(workloads, names):
            same = [r for r in rows if r["workload"] == name]
            by_batch: dict[int, float | str] = {}        # output tok/s, or the error
            for batch in dict.fromkeys(args.hf_batch):
                try:
                    th = run_hf(model_dir, prompts_of[(inp, out)][:n], out, batch, dtype)
                    by_batch[batch] = n * out / th
                except RuntimeError as e:                 # out of memory, among others
                    by_batch[batch] = str(e).splitlines()[0][:300] if str(e) else repr(e)
                finally:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                print(f"hf: {name} batch {batch}: {by_batch[batch]}", flush=True)
            ran = {b: v for b, v in by_batch.items() if not isinstance(v, str)}
            for row in same:
                row["hf_by_batch"] = {str(b): v for b, v in by_batch.items()}
                if not ran:
                    row["hf_error"] = "; ".join(f"batch {b}: {v}" for b, v in by_batch.items())
                    continue
                best = max(ran, key=ran.get)
                row.update({"hf_prompts": n, "hf_batch": best, "hf_s": n * out / ran[best],
                            "hf_output_tok_s": ran[best]})
                if not row["failed"]:
                    row["speedup_vs_hf"] = row["engine_output_tok_s"] / ran[best]
            save()
    save(echo=True)


if __name__ == "__main__":
    main()
