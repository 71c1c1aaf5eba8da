"""Check and time the layer kernels on a GPU at Llama-3.1-8B shapes, in bf16.

For rms_norm (with and without the residual add), rotary_embedding, silu_and_mul and write_kv at
H=4096, I=14336, Hq=32, Hkv=8, D=128 and T in 1, 64, 512, 4096 tokens: the largest error against
the eager reference, the median time of the Triton kernel and of the eager reference (CUDA
events, after warm-up, L2 flushed before each timed call), and the bytes each must move divided
by those times. Rotary and SiLU also report both their and HF's order's error against fp64.

    python scripts/gpu_check_layers.py --out gpu_layers.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from engine.models.llama import compute_inv_freq  # noqa: E402
from kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from kernels.attention_ref import write_kv_ref  # noqa: E402
from kernels.kv_cache import write_kv  # noqa: E402
from kernels.rmsnorm import rms_norm, rms_norm_ref  # noqa: E402
from kernels.rotary import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref  # noqa: E402

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
ROPE_THETA, MAX_POSITIONS, BLOCK_SIZE, EPS = 500000.0, 131072, 16, 1e-5
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)
DTYPE = torch.bfloat16
DEVICE = "cuda"


def time_ms(fn: Callable[[], object], warmup: int, reps: int, flush: torch.Tensor) -> float:
    """Median of `reps` CUDA-event timings of fn(), each after overwriting an L2-sized buffer."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def case_rms_norm(num_tokens: int, with_residual: bool, gen: torch.Generator) -> dict:
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, generator=gen).to(DTYPE)
    weight = (1 + 0.2 * torch.randn(HIDDEN, device=DEVICE, generator=gen)).to(DTYPE)
    residual = torch.randn_like(x) if with_residual else None
    got, want = rms_norm(x, weight, EPS, residual), rms_norm_ref(x, weight, EPS, residual)
    errors = {"max_err_vs_ref": max_abs(got[0], want[0]) if with_residual else max_abs(got, want)}
    if with_residual:
        errors["new_residual_max_err"] = max_abs(got[1], want[1])
    tensors = 4 if with_residual else 2  # x (+ residual) in, out (+ new residual) out
    return dict(
        kernel=lambda: rms_norm(x, weight, EPS, residual),
        ref=lambda: rms_norm_ref(x, weight, EPS, residual),
        num_bytes=tensors * x.numel() * x.element_size() + weight.numel() * weight.element_size(),
        **errors,
    )


def case_rotary(num_tokens: int, gen: torch.Generator, cos: torch.Tensor, sin: torch.Tensor) -> dict:
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE, generator=gen).to(DTYPE)
    q = qkv[:, :q_size].view(num_tokens, NUM_HEADS, HEAD_DIM)  # strided views, as in the model
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), device=DEVICE, generator=gen)
    q_in, k_in = q.clone(), k.clone()
    hf_q, hf_k = rotary_embedding_ref(q_in, k_in, positions, cos, sin)  # HF's bf16 order
    exact_q, exact_k = rotary_embedding_ref(q_in.double(), k_in.double(), positions, cos.double(), sin.double())
    rotary_embedding(q, k, positions, cos, sin)
    return dict(
        kernel=lambda: rotary_embedding(q, k, positions, cos, sin),
        ref=lambda: rotary_embedding_ref(q, k, positions, cos, sin),
        # q and k read and written, positions and a cos and a sin row per token read
        num_bytes=2 * (q.numel() + k.numel()) * q.element_size() + num_tokens * (8 + 2 * cos.shape[1] * 4),
        max_err_vs_ref=max(max_abs(q, hf_q), max_abs(k, hf_k)),
        kernel_max_err_vs_fp64=max(max_abs(q, exact_q), max_abs(k, exact_k)),
        hf_order_max_err_vs_fp64=max(max_abs(hf_q, exact_q), max_abs(hf_k, exact_k)),
    )


def case_silu_and_mul(num_tokens: int, gen: torch.Generator) -> dict:
    x = (torch.randn(num_tokens, 2 * INTER, device=DEVICE, generator=gen) * 3).to(DTYPE)
    got = silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    hf = F.silu(gate) * up  # HF's order: silu rounded to bf16 before the multiply
    g64, u64 = gate.double(), up.double()
    exact = g64 * torch.sigmoid(g64) * u64
    return dict(
        kernel=lambda: silu_and_mul(x),
        ref=lambda: silu_and_mul_ref(x),
        num_bytes=(x.numel() + got.numel()) * x.element_size(),
        max_err_vs_ref=max_abs(got, silu_and_mul_ref(x)),
        kernel_max_err_vs_fp64=max_abs(got, exact),
        hf_order_max_err_vs_fp64=max_abs(hf, exact),
    )


def case_write_kv(num_tokens: int, gen: torch.Generator) -> dict:
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE, generator=gen).to(DTYPE)
    key = qkv[:, q_size:q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, q_size + kv_size:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    num_blocks = triton.cdiv(num_tokens, BLOCK_SIZE) * 2 + 1
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE, generator=gen)[:num_tokens]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    return dict(
        kernel=lambda: write_kv(key, value, k_cache, v_cache, slots),
        ref=lambda: write_kv_ref(key, value, k_cache, v_cache, slots),
        num_bytes=2 * 2 * key.numel() * key.element_size() + slots.numel() * 8,
        max_err_vs_ref=max(max_abs(k_cache, expected_k), max_abs(v_cache, expected_v)),
    )


def copy_bandwidth_gbps(flush: torch.Tensor, warmup: int, reps: int) -> float:
    """Device-to-device copy of 1 GiB, bytes read plus written: the ceiling for these kernels."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup, reps, flush)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_layers.json", help="JSON results file")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512, 4096])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEVICE)  # > 4x the H200's 60 MB L2
    inv_freq = compute_inv_freq(HEAD_DIM, ROPE_THETA, LLAMA3_SCALING, torch.device(DEVICE))
    cos, sin = build_cos_sin_cache(inv_freq, MAX_POSITIONS)
    meta = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), dtype=str(DTYPE),
        shapes=dict(hidden=HIDDEN, intermediate=INTER, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                    head_dim=HEAD_DIM, block_size=BLOCK_SIZE),
        timing=f"CUDA events, median of {args.reps} after {args.warmup} warm-up calls, L2 flushed before each",
        copy_gbps=round(copy_bandwidth_gbps(flush, args.warmup, args.reps), 1),
    )
    cases = {
        "rms_norm": lambda t: case_rms_norm(t, False, gen),
        "rms_norm+residual": lambda t: case_rms_norm(t, True, gen),
        "rotary_embedding": lambda t: case_rotary(t, gen, cos, sin),
        "silu_and_mul": lambda t: case_silu_and_mul(t, gen),
        "write_kv": lambda t: case_write_kv(t, gen),
    }
    rows = []
    for op, make in cases.items():
        for num_tokens in args.tokens:
            case = make(num_tokens)
            kernel_ms = time_ms(case.pop("kernel"), args.warmup, args.reps, flush)
            ref_ms = time_ms(case.pop("ref"), args.warmup, args.reps, flush)
            num_bytes = case.pop("num_bytes")
            rows.append(dict(
                op=op, num_tokens=num_tokens, num_bytes=num_bytes,
                kernel_us=round(kernel_ms * 1e3, 2), ref_us=round(ref_ms * 1e3, 2),
                kernel_gbps=round(num_bytes / kernel_ms / 1e6, 1), ref_gbps=round(num_bytes / ref_ms / 1e6, 1),
                speedup=round(ref_ms / kernel_ms, 2), **case,
            ))
            del case
            torch.cuda.empty_cache()

    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    print(f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}; "
          f"{meta['timing']}; 1 GiB copy {meta['copy_gbps']} GB/s")
    print(f"{'op':<18} {'T':>5} {'MB':>8} {'kernel us':>10} {'GB/s':>7} {'ref us':>9} {'GB/s':>7} "
          f"{'x':>6} {'max err':>9}  fp64 err kernel/HF")
    for r in rows:
        fp64 = (f"{r['kernel_max_err_vs_fp64']:.3g}/{r['hf_order_max_err_vs_fp64']:.3g}"
                if "kernel_max_err_vs_fp64" in r else "")
        print(f"{r['op']:<18} {r['num_tokens']:>5} {r['num_bytes'] / 1e6:>8.2f} {r['kernel_us']:>10.2f} "
              f"{r['kernel_gbps']:>7.0f} {r['ref_us']:>9.2f} {r['ref_gbps']:>7.0f} {r['speedup']:>6.2f} "
              f"{r['max_err_vs_ref']:>9.3g}  {fp64}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
