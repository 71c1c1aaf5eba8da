"""Offline throughput for fixed input/output lengths, beside HF transformers `generate` on the
same model and GPU, and beside the workload's roofline.

Roofline: prefill at peak bf16 FLOP/s (2 * params * tokens, plus attention), decode at peak HBM
bandwidth (every step at full batch reads the weights once plus each sequence's KV).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from bench_common import (BF16_DENSE_FLOPS, HBM_BYTES_PER_S, PRESETS, git_commit, hardware,
                          kv_bytes_per_token, model_and_config, param_count, preset_dir,
                          step_table, write_results)

from engine import LLM, SamplingParams


def roofline_s(cfg: dict, n: int, inp: int, out: int, batch: int, elem: int) -> float:
    p = param_count(cfg)
    layers, hq = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // hq
    attn_flops_per_token_ctx = 4 * layers * hq * d          # QK^T and PV, per key
    prefill_flops = n * (2 * p * inp + attn_flops_per_token_ctx * inp * inp / 2)
    decode_flops = n * (2 * p * out + attn_flops_per_token_ctx * out * (inp + out / 2))
    steps = -(-n // batch) * out
    kv = kv_bytes_per_token(cfg, elem)
    decode_bytes = steps * p * elem + n * out * kv * (inp + out / 2)
    decode_s = max(decode_bytes / HBM_BYTES_PER_S, decode_flops / BF16_DENSE_FLOPS)
    return prefill_flops / BF16_DENSE_FLOPS + decode_s


def run_engine(llm, prompts, out_len) -> float:
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return elapsed


def run_hf(preset: str, prompts, out_len: int, batch: int, dtype) -> float:
    """Static batches through transformers generate (SDPA attention), random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(preset_dir(preset))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="sdpa").eval()
    elapsed = 0.0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i:i + batch], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=out_len, min_new_tokens=out_len)
            torch.cuda.synchronize()
            elapsed += time.perf_counter() - t0
            assert out.shape[1] == ids.shape[1] + out_len
    del model
    torch.cuda.empty_cache()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--model", default=None,
                    help="a local model folder instead of the preset (e.g. the tiny model, to try "
                         "the script on CPU with --dtype float32)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workloads", nargs="+", default=["1000x1000", "128x128", "2048x128"],
                    help="INPUTxOUTPUT lengths")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[256],
                    help="one engine per value (e.g. 128 256 512 1024: does a bigger batch pay?)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--hf-prompts", type=int, default=256,
                    help="prompts through HF generate (a subset: it is slow)")
    ap.add_argument("--hf-batch", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/throughput")
    args = ap.parse_args()

    import torch
    model_dir, cfg = model_and_config(args.preset, args.model)
    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    rng = random.Random(0)
    workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads]
    max_len = max(i + o for i, o in workloads)
    prompts_of = {(inp, out): [[rng.randrange(cfg["vocab_size"]) for _ in range(inp)]
                               for _ in range(args.num_prompts)] for inp, out in workloads}
    rows = []
    for max_num_seqs in args.max_num_seqs:
        llm = LLM(model_dir, load_format="dummy", dtype=args.dtype,
                  skip_tokenizer_init=True, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
                  enable_prefix_caching=False)
        llm.core.times.gpu_events = True     # where each step's time goes, the GPU's included
        for inp, out in workloads:
            prompts = prompts_of[(inp, out)]
            run_engine(llm, prompts[:8], min(8, out))             # warm-up
            before = llm.core.times.copy()
            t = run_engine(llm, prompts, out)
            roof = roofline_s(cfg, args.num_prompts, inp, out, max_num_seqs, elem)
            rows.append({"input_len": inp, "output_len": out, "num_prompts": args.num_prompts,
                         "max_num_seqs": max_num_seqs,
                         "engine_s": t, "engine_output_tok_s": args.num_prompts * out / t,
                         "engine_total_tok_s": args.num_prompts * (inp + out) / t,
                         "roofline_s": roof, "fraction_of_roofline": roof / t,
                         "step_ms": llm.core.times.since(before).per_step_ms()})
            print("engine:", rows[-1], flush=True)
        # HF (and the next engine) need the memory this KV cache holds: release it first.
        llm.core.shutdown()
        del llm
    for inp, out in workloads:
        if not args.hf_prompts:
            break
        n = min(args.hf_prompts, args.num_prompts)
        th = run_hf(args.preset, prompts_of[(inp, out)][:n], out, args.hf_batch, dtype)
        for row in rows:
            if (row["input_len"], row["output_len"]) == (inp, out):
                row.update({"hf_prompts": n, "hf_batch": args.hf_batch, "hf_s": th,
                            "hf_output_tok_s": n * out / th,
                            "speedup_vs_hf": row["engine_output_tok_s"] / (n * out / th)})
        print("hf:", inp, out, n * out / th, flush=True)
    meta = {"title": f"Offline throughput, {args.preset} ({args.dtype}, dummy weights)",
            "hardware": hardware(), "commit": git_commit(),
            "command": " ".join(["python"] + sys.argv),
            "targets": "1000x1000: >= 75% of roofline and >= 10x HF generate"}
    table = ["| in/out | prompts | max_num_seqs | engine out tok/s | total tok/s | roofline s | "
             "engine s | % of roofline | HF out tok/s (prompts, batch) | vs HF |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        hf = (f"{r['hf_output_tok_s']:.0f} ({r['hf_prompts']}, {r['hf_batch']})"
              if "hf_s" in r else "-")
        vs = f"{r['speedup_vs_hf']:.1f}x" if "hf_s" in r else "-"
        table.append(f"| {r['input_len']}/{r['output_len']} | {r['num_prompts']} | "
                     f"{r['max_num_seqs']} | {r['engine_output_tok_s']:.0f} | {r['engine_total_tok_s']:.0f} | "
                     f"{r['roofline_s']:.1f} | {r['engine_s']:.1f} | "
                     f"{100 * r['fraction_of_roofline']:.1f}% | {hf} | {vs} |")
    for r in rows:
        r["workload"] = f"{r['input_len']}/{r['output_len']}"
    table += ["", "Where a step's time goes (ms per step, mean over the run):", ""]
    table += step_table(rows, ["workload", "max_num_seqs"])
    write_results(args.out, meta, rows, table)


if __name__ == "__main__":
    main()
