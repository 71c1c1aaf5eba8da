"""Where a small decode GEMM's time goes beyond its weight bytes (issue 13), on a GPU.

A batch-1 decode step's small projections (qkv 50 MB, o_proj 34 MB, down 117 MB at Llama-3.1-8B)
run at 65-80% of the device's copy bandwidth where gate_up (235 MB) runs at ~90%: about 4-5 us
per call more than their bytes need. This times, per projection shape, one row, us per call in
a CUDA graph over 32 layers' weights (each call streams its weights from HBM):

  skinny        kernels/skinny_gemm.py at the given config (split-K merged by the last program)
  no_merge      the same programs, each storing its own partial as the output (wrong numbers:
                what the split-K merge costs is skinny - no_merge)
  stream        a kernel with the same grid and tiles that only loads the weights and sums them
                (no x, no MMA: what this access pattern costs)
  copy          torch copy of a buffer of the weights' size (read + write: twice the bytes)
  cublas        F.linear
and with --pdl the skinny and stream kernels again as a chain of PDL launches.

    PYTHONPATH=. python3 scripts/gpu_skinny_anatomy.py --out $OUT/skinny_anatomy.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.skinny_gemm as sg  # noqa: E402
from kernels.pdl import launch_options  # noqa: E402
from engine.gemm_tuning import replay_ms  # noqa: E402

LAYERS = 32
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "down_proj": (4096, 14336), "gate_up_proj": (28672, 4096)}


@triton.jit
def _stream_kernel(w_ptr, out_ptr, N, K, k_per_split, stride_wn,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        acc += tl.load(w_rows + (k0 + tl.arange(0, BLOCK_K))[None, :]).to(tl.float32)
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, tl.sum(tl.sum(acc, 1), 0))


def _us(body) -> float:
    """us per call of body(), which makes LAYERS calls, replayed in a CUDA graph."""
    return replay_ms(body, torch.device("cuda"), 9) * 1e3 / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pdl", action="store_true")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"), "shapes": []}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt) for _ in range(LAYERS)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        y = torch.empty(1, n, device=dev, dtype=dt)
        src, dst = torch.empty(n * k, device=dev, dtype=dt), torch.empty(n * k, device=dev, dtype=dt)
        row = {"proj": name, "n": n, "k": k, "weight_mb": n * k * 2 / 1e6,
               "cublas": _us(lambda: [F.linear(x, w) for w in ws]),
               "copy": _us(lambda: [dst.copy_(src) for _ in ws]), "configs": {}}
        for cfg in sg.candidate_configs(n, k, num_sms):
            k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
            splits = triton.cdiv(k, k_per_split)
            tiles = triton.cdiv(n, cfg.block_n)
            sink = torch.empty(splits * tiles, device=dev)

            def no_merge(w, pdl=False):
                sg._skinny_gemm_kernel[(tiles, splits)](
                    x, w, w, y, y, y, 1, n, k, k_per_split, splits, x.stride(0), w.stride(0), y.stride(0),
                    HAS_BIAS=False, SILU_MUL=False, HAS_SPLITS=False, EVEN_K=k % cfg.block_k == 0,
                    BLOCK_M=sg.MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="tf32",
                    USE_PDL=pdl, SPLIT_OUT=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                    **launch_options(pdl))

            def stream(w, pdl=False):
                _stream_kernel[(tiles, splits)](w, sink, n, k, k_per_split, w.stride(0), BLOCK_N=cfg.block_n,
                                                BLOCK_K=cfg.block_k, USE_PDL=pdl, num_warps=cfg.num_warps,
                                                num_stages=cfg.num_stages, **launch_options(pdl))
            r = {"programs": tiles * splits,
                 "skinny": _us(lambda: [sg.skinny_gemm(x, w, config=cfg) for w in ws]),
                 "no_merge": _us(lambda: [no_merge(w) for w in ws]),
                 "stream": _us(lambda: [stream(w) for w in ws])}
            if args.pdl:
                r["skinny_pdl"] = _us(lambda: [sg.skinny_gemm(x, w, config=cfg, pdl=True) for w in ws])
                r["stream_pdl"] = _us(lambda: [stream(w, True) for w in ws])
            row["configs"][str(cfg)] = r
        best = min(row["configs"], key=lambda c: row["configs"][c]["skinny"])
        row["best"] = best
        out["shapes"].append(row)
        print(f"{name} {row['weight_mb']:.1f} MB: cuBLAS {row['cublas']:.2f} us, copy (2x bytes) {row['copy']:.2f} us",
              flush=True)
        for c, r in row["configs"].items():
            print(f"   {c:22s} {r['programs']:5d} programs: " + " ".join(
                f"{key} {v:.2f}" for key, v in r.items() if key != "programs"), flush=True)
        del ws, src, dst
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
