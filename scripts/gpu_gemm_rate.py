"""What the weight GEMMs of a Llama-3.1-8B layer reach on this GPU (bf16, cuBLAS through F.linear),
at the row counts our steps give them: TFLOP/s per projection and for a whole layer, and the
time the GEMMs of a job of N tokens take at that rate (issue 12's shared-prefix floor and issue
13's 1000 x 1000 roofline count FLOPs at the bf16 peak; this is what cuBLAS gives).

Each projection runs in a CUDA graph over 32 layers' own weights (HBM, not L2), as
engine/gemm_tuning.py times them; the median of a few replays. --blas cublas cublaslt times
each row count under both of torch's BLAS back ends (torch.backends.cuda.preferred_blas_library:
cuBLASLt's heuristics may pick other kernels for these shapes).

--fp8 also times the FP8 weights path (EngineConfig.quantization = "fp8"): torch._scaled_mm with
row-wise scales on inputs already quantized ("fp8_gemm"), and with each input's quantization
(kernels/fp8_quant.py) in the graph too ("fp8_quant_gemm"); TFLOP/s are counted the same way, so
the rows compare directly with bf16's. Each FP8 result is checked against
kernels.fp8_quant.fp8_matmul_ref first.

    python3 scripts/gpu_gemm_rate.py --out $OUT/gemm_rate.json [--blas cublas cublaslt] [--fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.gemm_tuning import replay_ms  # noqa: E402
from scripts.bench_common import BF16_DENSE_FLOPS, PRESETS, git_commit, hardware  # noqa: E402


def layer_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each projection of one decoder layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * i, h), "down_proj": (h, i)}


def fp8_rows(x: torch.Tensor, weights: list[torch.Tensor], rows: int, name: str,
             flops: int, dev: torch.device) -> list[dict]:
    """The FP8 weights path for one projection: weights quantized per output channel, x per row."""
    from engine.models.fp8_linear import quantize_weight
    from kernels.fp8_quant import fp8_matmul_ref, quantize_rows, quantize_rows_ref
    qw = [quantize_weight(w) for w in weights]
    for w in weights:
        w.data = torch.empty(0, device=dev)     # the bf16 copies' memory back
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_ref(x)
    quant_equal = torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    w8, ws = qw[0]
    got = torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=ws.t(), out_dtype=torch.bfloat16).float()
    want = fp8_matmul_ref(q, s, w8, ws)
    max_err = ((got - want).abs().max() / want.abs().max()).item()     # as tests/test_fp8_quant.py
    if not quant_equal or not max_err < 1e-2:
        raise SystemExit(f"{name} M={rows}: FP8 path wrong (quantize equal {quant_equal}, rel err {max_err})")

    def quant_gemm(w8: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x)
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=sw.t(), out_dtype=torch.bfloat16)

    out = []
    for form, fn in (("fp8_gemm", lambda: [torch._scaled_mm(q, w.t(), scale_a=s, scale_b=sw.t(),
                                                             out_dtype=torch.bfloat16) for w, sw in qw]),
                     ("fp8_quant_gemm", lambda: [quant_gemm(w, sw) for w, sw in qw])):
        us = replay_ms(fn, dev) * 1e3 / len(qw)
        out.append({"blas": form, "rows": rows, "proj": name, "n": w8.shape[0], "k": w8.shape[1], "us": us,
                    "tflops": flops / us / 1e6, "max_rel_err": max_err})
        print(f"{form:8} M={rows:5d} {name:>12}: {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 2048, 8192])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blas", nargs="+", default=["cublas"], choices=["cublas", "cublaslt"])
    ap.add_argument("--fp8", action="store_true", help="also time FP8 weights (module docstring)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = PRESETS["llama-3.1-8b"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results = []
    for blas in args.blas:
        torch.backends.cuda.preferred_blas_library(blas)
        for rows in args.rows:
            layer_us, layer_flops = 0.0, 0
            for name, (n, k) in layer_shapes(cfg).items():
                weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
                           for _ in range(args.layers)]
                x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
                us = replay_ms(lambda: [F.linear(x, w) for w in weights], dev) * 1e3 / args.layers
                flops = 2 * rows * n * k
                layer_us, layer_flops = layer_us + us, layer_flops + flops
                results.append({"blas": blas, "rows": rows, "proj": name, "n": n, "k": k, "us": us,
                                "tflops": flops / us / 1e6})
                print(f"{blas:8} M={rows:5d} {name:>12} N={n:5d} K={k:5d}: {us:8.1f} us  "
                      f"{flops / us / 1e6:6.1f} TFLOP/s", flush=True)
                if args.fp8:
                    results += fp8_rows(x, weights, rows, name, flops, dev)
                del weights
                torch.cuda.empty_cache()
            results.append({"blas": blas, "rows": rows, "proj": "layer", "us": layer_us,
                            "tflops": layer_flops / layer_us / 1e6,
                            "fraction_of_peak": layer_flops / layer_us / 1e-6 / BF16_DENSE_FLOPS})
            print(f"{blas:8} M={rows:5d} {'layer':>12}: {layer_us:8.1f} us  "
                  f"{layer_flops / layer_us / 1e6:6.1f} TFLOP/s "
                  f"({layer_flops / layer_us / 1e-6 / BF16_DENSE_FLOPS:.1%} of the bf16 peak)", flush=True)
    for form in ("fp8_gemm", "fp8_quant_gemm") if args.fp8 else ():
        for rows in args.rows:
            parts = [r for r in results if r["blas"] == form and r["rows"] == rows]
            us = sum(r["us"] for r in parts)
            flops = sum(r["tflops"] * r["us"] * 1e6 for r in parts)
            results.append({"blas": form, "rows": rows, "proj": "layer", "us": us, "tflops": flops / us / 1e6})
            print(f"{form:8} M={rows:5d} {'layer':>12}: {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
    out = {"meta": {"hardware": hardware(), "commit": git_commit(),
                    "command": "python3 scripts/gpu_gemm_rate.py " + " ".join(sys.argv[1:]),
                    "peak_flops": BF16_DENSE_FLOPS},
           "results": results}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
