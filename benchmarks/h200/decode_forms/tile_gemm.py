"""A probe, not used by the engine (benchmarks/h200/decode_attention_forms.md): a GEMM for decode
batches of 64-512 rows, y = x @ W^T, tiles chosen to fill the SMs. Kept as run; on the H200 its
best config ran 15-45% slower than cuBLAS at every shape tried.

Math as F.linear without bias: x [M, K], W [N, K] (nn.Linear's layout), fp32 accumulation,
rounded once to x's dtype:

    y[m, n] = sum_k x[m, k] * W[n, k]

Why: at 256 rows cuBLAS runs a Llama-8B layer's projections at ~622 TFLOP/s against ~742 at 512
rows (H200, benchmarks/h200/gemm_rate_3724bbd.json): o_proj's 4096 x 4096 makes 64 tiles of
128 x 128 for 132 SMs. Tiles of 64 rows make twice as many (128 for o_proj and down_proj).

A program owns a BLOCK_M x BLOCK_N tile of y (the M tiles of one N tile next to each other, so
W's tile is read from HBM once and from L2 after) and, with SPLIT_K > 1, one of SPLIT_K slices
of K; the slices' fp32 partials are added by the last of them to arrive, in slice order (an
arrival counter per tile, kernels/arrival_counters.py), so the bits do not depend on which
arrives last.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters

__all__ = ["TileConfig", "tile_gemm", "candidate_configs"]


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/s{self.num_stages}"
                f"/k{self.split_k}")


def candidate_configs() -> list[TileConfig]:
    return [TileConfig(64, 128, 64, 4, 4), TileConfig(64, 128, 64, 4, 5), TileConfig(64, 256, 64, 8, 4),
            TileConfig(128, 128, 64, 8, 4), TileConfig(128, 256, 64, 8, 3), TileConfig(64, 64, 64, 4, 5),
            TileConfig(128, 128, 64, 8, 4, 2), TileConfig(64, 128, 64, 4, 4, 2)]


@triton.jit(do_not_specialize=["M"])
def _tile_gemm_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = (M + BLOCK_M - 1) // BLOCK_M
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in = offs_m < M
    n_in = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M and N read row 0 / N - 1 (in bounds, never stored): no load needs a row mask.
    x_rows = x_ptr + tl.where(m_in, offs_m, 0).to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    k_per = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            a = tl.load(x_rows + (k0 + offs_k)[None, :])
            b = tl.load(w_rows + (k0 + offs_k)[None, :])
        else:
            k_in = (k0 + offs_k) < k_hi
            a = tl.load(x_rows + (k0 + offs_k)[None, :], mask=k_in[None, :], other=0.0)
            b = tl.load(w_rows + (k0 + offs_k)[None, :], mask=k_in[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)

    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_in[:, None] & n_in[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = pid * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_size = tl.num_programs(0) * BLOCK_M * BLOCK_N
        tl.store(part_ptr + pid_k * tile_size + tile, acc)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
            for s in range(0, SPLIT_K):
                acc += tl.load(part_ptr + s * tile_size + tile, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid, 0)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def tile_gemm(x: torch.Tensor, weight: torch.Tensor, config: TileConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T for x [M, K] and weight [N, K], both with unit column stride."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w or x.stride(1) != 1 or weight.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"x [M, K] and weight [N, K] of one dtype, unit column stride; got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    c = config
    tiles = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
    if c.split_k > 1:
        part = torch.empty(c.split_k * tiles * c.block_m * c.block_n, dtype=torch.float32, device=x.device)
        counters = arrival_counters("tile_gemm", x.device, tiles)
    else:
        part, counters = y, y
    k_per = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    _tile_gemm_kernel[(tiles, c.split_k)](
        x, weight, y, part, counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k,
        EVEN_K=k % c.block_k == 0, NUM_STAGES=c.num_stages,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=c.num_warps, num_stages=c.num_stages)
    return y
