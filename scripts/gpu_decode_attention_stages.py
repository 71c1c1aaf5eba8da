"""Decode attention at the engine's decode-graph sizes (issues 12 and 13), on a GPU: the kernel
with its splits merged inside (what decode graphs of up to 32 rows run) in tile configs of 64 or
128 keys a step on 2 or 3 pipeline stages (4 warps, or 8 at 64 keys), and the separate-merge kernel (`unfused`: 128 keys a
step, `choose_num_kv_splits`, a second launch), us per call replayed from a CUDA graph.
Llama-3.1-8B heads (Hq 32, Hkv 8, D 128), bf16, 16-key pages scattered at random; every row has
`ctx` keys, and the split count is the graph's for the context bucket holding ctx.

    PYTHONPATH=. python3 scripts/gpu_decode_attention_stages.py --out $OUT/decode_attention_stages.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.paged_attention as pa  # noqa: E402
from engine.cuda_graphs import KV_SPLIT_CONTEXTS, decode_kv_splits  # noqa: E402
from scripts.bench_common import git_commit  # noqa: E402
from scripts.gpu_check_cascade import bench_graph  # noqa: E402

HQ, HKV, D, BLOCK = 32, 8, 128, 16
# name: (keys a step, stages, warps); the split count is the graph's rule at 64 keys, at 128 keys
# the same rule with 128-key splits (None: the separate-merge kernel).
VARIANTS = {"n64_st3": (64, 3, 4), "n64_st2": (64, 2, 4), "n128_st3": (128, 3, 4), "n128_st2": (128, 2, 4),
            "n64_st2_w8": (64, 2, 8), "n64_st3_w8": (64, 3, 8), "unfused": None}


def time_case(rows: int, ctx: int, names: list[str]) -> dict:
    gen = torch.Generator().manual_seed(rows * 7 + ctx)
    per_row = triton.cdiv(ctx, BLOCK)
    num_blocks = rows * per_row + 8
    table = torch.randperm(num_blocks, generator=gen)[:rows * per_row].view(rows, per_row)
    table = table.to(torch.int32).cuda()
    k = torch.randn(num_blocks, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(rows, HQ, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((rows,), ctx, dtype=torch.int32, device="cuda")
    bucket = min(c for c in KV_SPLIT_CONTEXTS if c >= ctx)
    r = {"rows": rows, "ctx": ctx, "splits_64": decode_kv_splits(rows, HKV, bucket, True),
         "splits_128": pa.choose_fused_kv_splits(rows, HKV, bucket, min_keys_per_split=128),
         "splits_unfused": pa.choose_num_kv_splits(rows, HKV, ctx)}
    outs = {}
    for name in names:
        variant = VARIANTS[name]
        out = torch.empty_like(q)
        if variant is None:
            s, cfg, fused = r["splits_unfused"], pa._TileConfig(16, 128, 4, 3), False
        else:
            s = r["splits_64"] if variant[0] == 64 else r["splits_128"]
            cfg, fused = pa._TileConfig(16, variant[0], variant[2], variant[1]), True
        call = lambda: pa._launch(q, k, v, table, cu, lens, out, D ** -0.5, None, 1, s, cfg,  # noqa: E731
                                  fused and s > 1)
        r[name] = bench_graph(call, 10, 40) * 1e3
        outs[name] = out.float()
    first = next(iter(outs.values()))
    r["max_abs_diff"] = max((o - first).abs().max().item() for o in outs.values())
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[500, 1000, 2000, 4000, 8000, 16000])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    results = []
    for rows in args.rows:
        for ctx in args.contexts:
            r = time_case(rows, ctx, args.variants)
            best = min(args.variants, key=r.get)
            print(f"{rows:3d} rows, {ctx:6d} keys (splits {r['splits_64']}/{r['splits_128']}/"
                  f"{r['splits_unfused']}): " + " | ".join(f"{n} {r[n]:7.1f}" for n in args.variants)
                  + f" us; best {best}, max |diff| {r['max_abs_diff']:.1e}", flush=True)
            results.append(r)
            torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
