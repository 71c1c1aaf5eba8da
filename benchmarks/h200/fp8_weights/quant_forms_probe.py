"""Candidate forms of the FP8 path's input quantization (fp8_weights.md, GEMM rates: quantizing
down_proj's input of 14,336 columns costs 71.5 us a layer at 2,048 rows and 200 us at 8,192,
~2.5x its bytes at the copy's rate, and it reads what silu_and_mul has just written).

Forms, each over 32 layers' worth of separate buffers in a CUDA graph (HBM, not L2):
- `two_kernels`: kernels.activation.silu_and_mul, then kernels.fp8_quant.quantize_rows (today);
- `fused`: SiLU-and-mul and the quantization in one kernel, one program a row (the product
  rounded to the input's dtype first, so the bits are today's). Timed at dde5c3d as this
  probe's own copy (16 warps); since c071a41 the engine's kernels.fp8_quant.silu_mul_quantize_rows,
  the same code (16 warps at 14,336 columns);
- `quant_only_w{4,8,16}`: quantize_rows's kernel alone at 4, 8 and 16 warps (today: 16 at
  14,336 columns);
- `quant_only_loop`: the quantization in two passes over blocks of 2,048 columns (the second
  reads the row again, from L2), 4 warps.
Every form is checked against today's bits first.

    PYTHONPATH=. python3 benchmarks/h200/fp8_weights/quant_forms_probe.py --out $OUT/quant_forms.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/h200/fp8_weights/quant_forms_probe.py --cpu-check
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul
from kernels.fp8_quant import _quantize_rows_kernel, quantize_rows, silu_mul_quantize_rows
from kernels.kv_cache import to_cache


@triton.jit
def _quant_loop_kernel(x_ptr, stride_x, q_ptr, scale_ptr, num_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * (1.0 / 448.0)
    for start in range(0, num_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < num_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * num_cols + cols, to_cache(tl.math.div_rn(x, scale), q_ptr), mask=mask)
    tl.store(scale_ptr + row, scale)


def outputs(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(m, 1, dtype=torch.float32, device=device))


def fused(gate_up: torch.Tensor):
    return silu_mul_quantize_rows(gate_up)


def quant_warps(x: torch.Tensor, warps: int):
    q, s = outputs(*x.shape, x.device)
    _quantize_rows_kernel[(x.shape[0],)](x, x.stride(0), q, s, x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]),
                                         USE_PDL=False, num_warps=warps)
    return q, s


def quant_loop(x: torch.Tensor):
    q, s = outputs(*x.shape, x.device)
    _quant_loop_kernel[(x.shape[0],)](x, x.stride(0), q, s, x.shape[1], BLOCK=2048, num_warps=4)
    return q, s


def same_bits(a, b) -> bool:
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def check(gate_up: torch.Tensor) -> dict[str, bool]:
    x = silu_and_mul(gate_up)
    today = quantize_rows(x)
    got = {"fused": same_bits(fused(gate_up), today), "quant_only_loop": same_bits(quant_loop(x), today)}
    for w in (4, 8, 16):
        got[f"quant_only_w{w}"] = same_bits(quant_warps(x, w), today)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 2048, 8192])
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cpu-check", action="store_true", help="bits only, under TRITON_INTERPRET=1")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.cpu_check:
        gen = torch.Generator().manual_seed(0)
        for m, k in [(3, 64), (5, 1000), (2, 5000)]:
            print(m, k, check(torch.randn(m, 2 * k, generator=gen) * 3))
        return
    from engine.gemm_tuning import replay_ms
    from scripts.bench_common import git_commit, hardware
    dev = torch.device("cuda")
    rows = []
    for m in args.rows:
        inputs = [torch.randn(m, 2 * args.inter, device=dev, dtype=torch.bfloat16) * 3 for _ in range(args.layers)]
        mids = [silu_and_mul(g) for g in inputs]
        ok = check(inputs[0])
        if not all(ok.values()):
            raise SystemExit(f"{m} rows: bits differ {ok}")
        forms = {"two_kernels": lambda: [quantize_rows(silu_and_mul(g)) for g in inputs],
                 "fused": lambda: [fused(g) for g in inputs],
                 "quant_only_loop": lambda: [quant_loop(x) for x in mids]}
        for w in (4, 8, 16):
            forms[f"quant_only_w{w}"] = lambda w=w: [quant_warps(x, w) for x in mids]
        for name, fn in forms.items():
            us = replay_ms(fn, dev) * 1e3 / args.layers
            rows.append({"rows": m, "inter": args.inter, "form": name, "us": us})
            print(f"M={m:5d} {name:>16}: {us:8.1f} us a layer", flush=True)
        del inputs, mids
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": {"hardware": hardware(), "commit": os.environ.get("BENCH_COMMIT") or git_commit(),
                                "command": "python3 benchmarks/h200/fp8_weights/quant_forms_probe.py"},
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
