"""Residual add + RMSNorm writing FP8 (with its per-row scale) for the next projection, against
today's two kernels (kernels.rmsnorm.rms_norm, then kernels.fp8_quant.quantize_rows): the inputs
of qkv_proj and gate_up_proj on the FP8 path. Each quantization costs a read and a write of the
normed rows and a launch (fp8_decode.md: ~3-4% of an FP8 decode step, by kernel estimates).

Forms, each over 32 layers' worth of separate buffers in a CUDA graph, hidden size 4,096:
- `two_kernels`: rms_norm (residual in and out), then quantize_rows (today);
- `fused`: one kernel, one program a row: the residual add and its store, the norm and the
  weight as rms_norm computes them, rounded to the model's dtype, then quantized through
  kernels.fp8_quant._store_quantized_row (so the bits are today's).
The fused form is checked against today's bits first (residual out, q, scale).

    PYTHONPATH=. python3 benchmarks/h200/fp8_weights/norm_quant_probe.py --out $OUT/norm_quant.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/h200/fp8_weights/norm_quant_probe.py --cpu-check
"""
import argparse
import json
import os

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import _store_quantized_row, quantize_rows
from kernels.rmsnorm import rms_norm


@triton.jit
def _add_norm_quant_kernel(x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    r = tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(res_ptr + row * hidden + cols, x, mask=mask)       # the new residual, in place
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype).to(tl.float32)
    _store_quantized_row(out, q_ptr, scale_ptr, row, cols, mask, hidden)


def two_kernels(x, res, w, eps=1e-5):
    out, new_res = rms_norm(x, w, eps, res, out=torch.empty_like(x), residual_out=res)
    return quantize_rows(out), new_res


def fused(x, res, w, eps=1e-5):
    m, h = x.shape
    q = torch.empty(m, h, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _add_norm_quant_kernel[(m,)](x, res, w, q, s, h, eps, BLOCK=triton.next_power_of_2(h),
                                 num_warps=min(max(triton.next_power_of_2(h) // 512, 1), 16))   # rms_norm's
    return (q, s), res


def same(a, b) -> bool:
    (qa, sa), ra = a
    (qb, sb), rb = b
    return torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(sa, sb) and torch.equal(ra, rb)


def check(m, h, dtype, device, gen) -> bool:
    x = torch.randn(m, h, generator=gen).to(dtype).to(device)
    res = torch.randn(m, h, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype).to(device)
    return same(two_kernels(x, res.clone(), w), fused(x, res.clone(), w))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 512, 2048, 8192])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cpu-check", action="store_true", help="bits only, under TRITON_INTERPRET=1")
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    if args.cpu_check:
        for m, h, dtype in [(3, 64, torch.float32), (5, 1000, torch.float16), (2, 4096, torch.float16)]:
            ok = check(m, h, dtype, "cpu", gen)
            print(m, h, dtype, "same bits" if ok else "BITS DIFFER")
            assert ok
        return
    from engine.gemm_tuning import replay_ms
    from scripts.bench_common import git_commit, hardware
    dev = torch.device("cuda")
    rows = []
    for m in args.rows:
        if not check(m, args.hidden, torch.bfloat16, dev, gen):
            raise SystemExit(f"{m} rows: bits differ")
        bufs = [(torch.randn(m, args.hidden, device=dev, dtype=torch.bfloat16),
                 torch.randn(m, args.hidden, device=dev, dtype=torch.bfloat16),
                 torch.ones(args.hidden, device=dev, dtype=torch.bfloat16)) for _ in range(args.layers)]
        for name, fn in (("two_kernels", two_kernels), ("fused", fused)):
            us = replay_ms(lambda fn=fn: [fn(*b) for b in bufs], dev) * 1e3 / args.layers
            rows.append({"rows": m, "hidden": args.hidden, "form": name, "us": us})
            print(f"M={m:5d} {name:>12}: {us:8.2f} us a call", flush=True)
        del bufs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": {"hardware": hardware(), "commit": os.environ.get("BENCH_COMMIT") or git_commit(),
                                "command": "python3 benchmarks/h200/fp8_weights/norm_quant_probe.py"},
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
