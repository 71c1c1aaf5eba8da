"""Skinny GEMM for decode steps: y = x @ W^T (+ bias) for a few rows (M <= 16), one launch.

Math, with W [N, K] in nn.Linear's layout and fp32 accumulation, rounded once to x's dtype:

    y[m, n] = sum_k a[m, k] * W[n, k]  (+ bias[n])

where a = x [M, K], or with silu_mul=True a = silu_and_mul(x) for x [M, 2K] (gate columns first,
up second), computed as kernels/activation.py does (fp32 g / (1 + exp(-g)) * u, rounded to x's
dtype), so the fused prologue gives bitwise what silu_and_mul followed by this kernel gives.

Tiling ("swap AB"): a program owns BLOCK_N rows of W and one of SPLIT_K slices of K, and
accumulates acc[BLOCK_N, 16] += W[BLOCK_N, BLOCK_K] @ a^T[BLOCK_K, 16] with tl.dot. W's rows take
the MMA's tall side (64 rows for a Hopper wgmma) and x's <= 16 rows, zero-padded to 16, its
narrow side: the kernel is shaped around the weight stream, which is all a decode GEMM moves
(x and y are kilobytes). Compute is 16 / M times what M rows need; at these sizes it stays far
below the time the weights take to arrive.

Split-K without a second kernel. With SPLIT_K > 1 each program stores its fp32 partial
[BLOCK_N, 16] in a workspace, then (after a barrier, so all its threads' stores come first)
increments its N tile's counter with an acq_rel atomic. The program that brings the counter to
SPLIT_K adds the SPLIT_K partials in split order (the same order whichever program is last:
deterministic), writes y and resets the counter to 0. The counters (kernels/arrival_counters.py)
live per device, zeroed once and back at zero after every call, so a CUDA graph replays the
kernel alone (no memset, no reduce). Calls on one device share them: they must not overlap in
time (one stream).

Or no merge at all (merge=False): every program stores its fp32 partial [M, BLOCK_N] of its K
slice in parts [S, M, N] and is done; the kernel after the GEMM adds them up in slice order as
it reads them (kernels/rmsnorm.py, kernels/rotary_write_kv.py: the same bits). The merge's
store, atomic and reload sit on the critical path of the last program: 2-6 us a call of a
decode projection on an H100 (benchmarks/h100/decode_experiments.md).

Layouts: x [M, K] (or [M, 2K] with silu_mul) with unit column stride, any row stride; W [N, K]
with unit column stride, any row stride; bias [N]; y [M, N] contiguous, x's dtype.

With pdl=True (programmatic dependent launch, kernels/pdl.py) the kernel is launched while the
kernel ahead still runs and waits for it before anything else. Loading the first weight step
before the wait (weights are read-only) made the H200's decode step slower, not faster
(benchmarks/h200/decode_pdl.md), as did prefetching weights into L2 there, and o_proj's alone
behind the attention (an H100: benchmarks/h100/decode_experiments.md). Folding a layer's norms and
residual adds into the projections' prologue and epilogue (5097ce1) took 0.3% off the step:
in a PDL chain the small kernels between GEMMs cost little; not kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters
from kernels.pdl import check as check_pdl, launch_options

__all__ = ["SkinnyConfig", "candidate_configs", "chain_candidate_configs", "default_config", "skinny_gemm",
           "skinny_gemm_ref", "MAX_ROWS", "num_k_slices", "add_k_slices"]

MAX_ROWS = 16                   # x rows per call: the MMA's narrow side
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_H200_NUM_SMS = 132


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split, num_splits,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, HAS_SPLITS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, SPLIT_OUT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_in = offs_n < N
    m_in = offs_m < M
    # Rows past N read row N - 1 (in bounds, never stored): the weight loads need no mask.
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm            # a^T tile: [BLOCK_K, BLOCK_M]
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.full([BLOCK_N, BLOCK_M], 0.0, dtype=tl.float32)
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:          # every step is a whole BLOCK_K inside [k_lo, k_hi)
            w = tl.load(w_rows + offs_k[None, :])
            x_mask = m_in[None, :] & (offs_k[:, None] >= 0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=offs_k[None, :] < k_hi, other=0.0)
            x_mask = m_in[None, :] & (offs_k[:, None] < k_hi)
        a = _load_a(x_cols, offs_k, x_mask, K, SILU_MUL)
        acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)

    if SPLIT_OUT:       # the fp32 partial of this K slice, parts[pid_k, m, n]: the reader adds them
        tl.store(part_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None], acc,
                 mask=n_in[:, None] & m_in[None, :])
    elif HAS_SPLITS:
        tile = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None] * BLOCK_M + offs_m[None, :]
        tile_size = tl.num_programs(0) * BLOCK_N * BLOCK_M
        tl.store(part_ptr + pid_k * tile_size + tile, acc)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            acc = tl.full([BLOCK_N, BLOCK_M], 0.0, dtype=tl.float32)
            for s in range(0, num_splits):
                acc += tl.load(part_ptr + s * tile_size + tile, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)
            _store_y(acc, bias_ptr, y_ptr, offs_n, offs_m, n_in, m_in, stride_ym, HAS_BIAS)
    else:
        _store_y(acc, bias_ptr, y_ptr, offs_n, offs_m, n_in, m_in, stride_ym, HAS_BIAS)


@triton.jit
def _load_a(x_cols, offs_k, x_mask, K, SILU_MUL: tl.constexpr):
    """a^T [BLOCK_K, BLOCK_M] for the columns offs_k: x's, or silu_and_mul's of x."""
    x_ptrs = x_cols + offs_k[:, None]
    if SILU_MUL:        # kernels/activation.py's expression and rounding
        gate = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_cols.dtype.element_ty)
    return tl.load(x_ptrs, mask=x_mask, other=0.0)


@triton.jit
def _store_y(acc, bias_ptr, y_ptr, offs_n, offs_m, n_in, m_in, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_in[:, None] & m_in[None, :])


@triton.jit
def add_k_slices(acc, parts_ptrs, stride_ps, mask, bias_ptrs, NUM_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc (fp32 zeros) + the unmerged K-slice partials at parts_ptrs (slice s at
    + s * stride_ps, merge=False) in slice order, + the bias at bias_ptrs: this kernel's own merge
    before its rounding. The kernels that read the partials (kernels/rmsnorm.py,
    kernels/rotary_write_kv.py) add them up through this one function."""
    for s in tl.static_range(NUM_PARTS):
        acc += tl.load(parts_ptrs + s * stride_ps, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptrs, mask=mask, other=0.0).to(tl.float32)
    return acc


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not isinstance(_skinny_gemm_kernel, triton.runtime.JITFunction)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int        # W rows per program (64 and up: Hopper wgmma)
    block_k: int        # K per step
    split_k: int        # K slices (programs per N tile); 1: no workspace, no counters
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}st{self.num_stages}"


# (block_n, block_k, num_warps, num_stages, programs per SM wanted): the shapes the start-up
# timing (engine/gemm_tuning.py) tries. Guesses for the H200 to be narrowed by measurement
# (scripts/gpu_check_decode_kernels.py sweeps wider); the tile is 16-32 KB of weights a stage.
_TILES = ((64, 128, 4, 4, 2), (64, 256, 4, 3, 2), (64, 128, 4, 4, 4), (128, 128, 8, 3, 2), (32, 256, 4, 3, 2))


def _split(n: int, k: int, block_n: int, block_k: int, num_sms: int, per_sm: int) -> int:
    """Enough programs for per_sm per SM, each with at least two BLOCK_K steps of K."""
    tiles = triton.cdiv(n, block_n)
    return max(1, min(triton.cdiv(per_sm * num_sms, tiles), k // (2 * block_k)))


def candidate_configs(n: int, k: int, num_sms: int = _H200_NUM_SMS) -> list[SkinnyConfig]:
    out = []
    for block_n, block_k, warps, stages, per_sm in _TILES:
        cfg = SkinnyConfig(block_n, block_k, _split(n, k, block_n, block_k, num_sms, per_sm), warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


def chain_candidate_configs(n: int, k: int, num_sms: int = _H200_NUM_SMS) -> list[SkinnyConfig]:
    """`candidate_configs`, and the first tile also at every split count below its own: the
    candidates for a decode graph's PDL chain (engine/gemm_tuning.py). There, fewer K slices
    than the kernel alone runs fastest with made the step faster: H200, batch 1, 64 x 128 tiles
    on 4 stages with 2 / 2-3 / 3 slices for qkv / o / down against the 3 / 5 / 5 of two programs
    an SM (benchmarks/h200/chain_configs.md)."""
    out = candidate_configs(n, k, num_sms)
    first = out[0]
    for split in range(1, first.split_k):
        cfg = SkinnyConfig(first.block_n, first.block_k, split, first.num_warps, first.num_stages)
        if cfg not in out:
            out.append(cfg)
    return out


def default_config(n: int, k: int, num_sms: int = _H200_NUM_SMS) -> SkinnyConfig:
    return candidate_configs(n, k, num_sms)[0]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_NUM_SMS


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: SkinnyConfig | None = None,
    pdl: bool = False,
    merge: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = a @ weight^T (+ bias), a = x [M, K] or silu_and_mul(x) for x [M, 2K] (see the
    module docstring). config: the tiling; None: `default_config`. pdl: launch with programmatic
    dependent launch. merge=False: no merge of the K slices and no bias; returns their fp32
    partials [S, M, N] (S slices, `num_k_slices`), which the reader adds in slice order (then the
    bias, then rounds to x's dtype: the same bits as y; kernels/rmsnorm.py reads them so).
    out: y is written there and returned (x's dtype, [M, N], unit column stride; merge=True)."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    num_rows, num_cols = x.shape
    n, k = weight.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"x may have at most {MAX_ROWS} rows, got {num_rows}")
    if num_cols != (2 * k if silu_mul else k):
        raise ValueError(f"x must have {'2K' if silu_mul else 'K'} = {2 * k if silu_mul else k} columns "
                         f"for weight [N, K={k}], got {num_cols}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one dtype of {_DTYPES}, got {x.dtype} and {weight.dtype}")
    if (num_cols > 1 and x.stride(1) != 1) or (k > 1 and weight.stride(1) != 1):
        raise ValueError(f"x and weight must have unit column stride, got {x.stride()} and {weight.stride()}")
    device = x.device
    if device.type != "cuda" and not (_INTERPRETED and device.type == "cpu"):
        raise ValueError(f"x is on {device}: skinny_gemm needs CUDA tensors (CPU only with TRITON_INTERPRET=1 "
                         f"set before kernels.skinny_gemm is imported)")
    if weight.device != device or (bias is not None and bias.device != device):
        raise ValueError(f"weight and bias must be on {device} like x")
    if bias is not None and (bias.shape != (n,) or bias.dtype not in _DTYPES or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float [{n}] tensor, got {bias.dtype} {list(bias.shape)}")
    check_pdl(pdl, device, "skinny_gemm")
    if not merge and (bias is not None or k == 0):
        raise ValueError("merge=False returns the K slices' partials: no bias (the reader adds it) and K > 0")
    if out is not None and (not merge or out.shape != (num_rows, n) or out.dtype != x.dtype
                            or out.device != device or (n > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be a {x.dtype} [{num_rows}, {n}] tensor on {device} with unit column "
                         f"stride (merge=True), got {out.dtype} {list(out.shape)} stride {out.stride()}")
    cfg = config or default_config(n, k, _num_sms(device))
    if merge:
        y = torch.empty(num_rows, n, dtype=x.dtype, device=device) if out is None else out
        if k == 0:
            return y.zero_() if bias is None else y.copy_(bias.expand(num_rows, n))
    k_per_split, num_splits = _k_slices(k, cfg)
    if not merge:
        y = torch.empty(num_splits, num_rows, n, dtype=torch.float32, device=device)
    if num_rows == 0 or n == 0:
        return y
    num_tiles = triton.cdiv(n, cfg.block_n)
    if not merge:
        part = counters = y
    elif num_splits > 1:
        part = torch.empty(num_splits, num_tiles * cfg.block_n, MAX_ROWS, dtype=torch.float32, device=device)
        counters = arrival_counters("skinny_gemm", device, num_tiles)
    else:
        part = counters = y                             # unused
    _skinny_gemm_kernel[(num_tiles, num_splits)](
        x, weight, bias if bias is not None else weight, y, part, counters,
        num_rows, n, k, k_per_split, num_splits,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, HAS_SPLITS=num_splits > 1, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl, SPLIT_OUT=not merge,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    return y


def _k_slices(k: int, cfg: SkinnyConfig) -> tuple[int, int]:
    """(K per slice, slices): whole BLOCK_K steps, so rounding up may leave fewer than split_k."""
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def num_k_slices(k: int, config: SkinnyConfig) -> int:
    """S of skinny_gemm(merge=False)'s partials [S, M, N] for a weight of K columns."""
    return _k_slices(k, config)[1]


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    *, silu_mul: bool = False) -> torch.Tensor:
    """Eager fp64: (silu(g) * u if silu_mul else x) @ weight^T + bias, not rounded."""
    a = x.double()
    if silu_mul:
        gate, up = a.chunk(2, dim=-1)
        a = gate / (1.0 + torch.exp(-gate)) * up
    y = a @ weight.double().T
    return y if bias is None else y + bias.double()
