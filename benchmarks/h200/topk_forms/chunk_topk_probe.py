"""Probe (issue 13, the sampler's top-k): the k-th largest value of each row by chunks.

torch.topk over [B, 128,256] is most of top-k's cost in the sampler (benchmarks/h200/race_sample.md
sections 1, 8). Here each program takes one chunk of a row and keeps its K largest values
(`tl.topk`, a bitonic top-K, K a power of two >= k); torch.topk then reads only the [B, chunks * K]
survivors. Exact: a chunk holds at most k of the row's k largest, all among its own K largest.

    PYTHONPATH=. python3 benchmarks/h200/topk_forms/chunk_topk_probe.py --out $OUT/chunk_topk.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/h200/topk_forms/chunk_topk_probe.py --cpu-check

Each timing is triton's do_bench median in us (L2 flushed); `exact` counts the rows whose k-th
value equals torch.topk's on the whole row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


@triton.jit
def _chunk_topk_kernel(x_ptr, out_ptr, V, stride_x, stride_o, CHUNK: tl.constexpr, K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    top = tl.topk(x, K)
    tl.store(out_ptr + row * stride_o + chunk * K + tl.arange(0, K), top)


def chunk_kth(x: torch.Tensor, k: int, chunk: int, big_k: int, num_warps: int) -> torch.Tensor:
    rows, vocab = x.shape
    n = triton.cdiv(vocab, chunk)
    cand = torch.empty(rows, n * big_k, dtype=torch.float32, device=x.device)
    _chunk_topk_kernel[(rows, n)](x, cand, vocab, x.stride(0), cand.stride(0), CHUNK=chunk, K=big_k,
                                  num_warps=num_warps)
    return cand.topk(k, dim=-1).values[:, k - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 512])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--k", type=int, nargs="+", default=[50, 100])
    ap.add_argument("--configs", nargs="+", default=["2048,64,4", "4096,64,4", "4096,64,8", "8192,64,8",
                                                      "4096,128,8", "8192,128,8", "16384,64,16"],
                    metavar="CHUNK,K,WARPS")
    ap.add_argument("--cpu-check", action="store_true", help="small shapes under TRITON_INTERPRET, no timing")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.cpu_check:
        gen = torch.Generator().manual_seed(0)
        worst = 0
        for rows, vocab, k, cfg in ((3, 1000, 5, (128, 8, 4)), (2, 777, 8, (64, 8, 4)), (4, 5000, 30, (512, 32, 4))):
            x = (torch.randn(rows, vocab, generator=gen) * 2).bfloat16()
            x[0, :40] = x[0, 0]                                    # ties
            got = chunk_kth(x, k, *cfg)
            want = x.float().topk(k, dim=-1).values[:, k - 1]
            worst = max(worst, int((got != want).sum()))
        print("rows differing:", worst)
        sys.exit(1 if worst else 0)

    from triton.testing import do_bench
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for rows in args.rows:
        x = (torch.randn(rows, args.vocab, device="cuda", generator=gen) * 2.5).bfloat16()
        for k in args.k:
            want = x.topk(k, dim=-1).values[:, k - 1].float()
            t_full = do_bench(lambda: x.topk(k, dim=-1).values[:, k - 1])
            results.append({"rows": rows, "k": k, "form": "torch.topk, bf16 row", "us": 1e3 * t_full, "exact": rows})
            xf = x.float()
            t_f32 = do_bench(lambda: xf.topk(k, dim=-1).values[:, k - 1])
            results.append({"rows": rows, "k": k, "form": "torch.topk, fp32 row", "us": 1e3 * t_f32, "exact": rows})
            for cfg in args.configs:
                chunk, big_k, warps = (int(v) for v in cfg.split(","))
                if big_k < k:
                    continue
                try:
                    got = chunk_kth(x, k, chunk, big_k, warps)
                    t = do_bench(lambda: chunk_kth(x, k, chunk, big_k, warps))
                    exact = int((got == want).sum())
                except Exception as e:                               # noqa: BLE001 - a probe reports and goes on
                    t, exact = float("nan"), f"{type(e).__name__}: {str(e)[:200]}"
                results.append({"rows": rows, "k": k, "form": f"chunks {chunk}, K {big_k}, {warps} warps",
                                "us": 1e3 * t, "exact": exact})
                print(results[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"commit": os.environ.get("BENCH_COMMIT", "?"), "gpu": torch.cuda.get_device_name(),
                   "results": results}, f, indent=1)
    for r in results:
        print(f"{r['rows']:4d} k={r['k']:3d} {r['form']:32s} {r['us']:9.1f} us  exact {r['exact']}")


if __name__ == "__main__":
    main()
