"""Skinny GEMM for decode steps: y = x @ W^T (+ bias) for a few rows (M <= 16), one launch.

Math, with W [N, K] in nn.Linear's layout and fp32 accumulation, rounded once to x's dtype:

    y[m, n] = sum_k a[m, k] * W[n, k]  (+ bias[n])

where a = x [M, K], or with silu_mul=True a = silu_and_mul(x) for x [M, 2K] (gate columns first,
up second), computed as kernels/activation.py does (fp32 g / (1 + exp(-g)) * u, rounded to x's
dtype), so the fused prologue gives bitwise what silu_and_mul followed by this kernel gives; or
with norm_weight g, a = RMSNorm(x) with kernels/rmsnorm.py's expression and roundings:

    a[m, k] = g[k] * (x[m, k] * rsqrt(sum_p sum_sq[m, p] / K + eps) rounded) rounded

where sum_sq [M, P] are partial sums of x's squared rows, written by the call that produced x
(below), so the prologue needs no pass over x of its own before its weight stream starts.
A prologue that computes a cannot feed the MMA straight from memory as a plain x does; its
loads for step i + 1 are issued before step i's math so their latency is hidden.

With a residual r [M, N] (HF's residual add after o_proj and down_proj):

    y[m, n] = (rounded(sum_k a[m, k] W[n, k] + bias[n]) + r[m, n]) rounded
    sum_sq_out[m, t] = sum over N tile t of y[m, n]^2     (fp32, one column per BLOCK_N tile)

A decode layer's two RMSNorms then need no kernel of their own: o_proj adds the residual and
hands gate_up_proj the sums for its norm prologue, down_proj does the same for the next
layer's qkv_proj (engine/models/llama.py).

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

Layouts: x [M, K] (or [M, 2K] with silu_mul) with unit column stride, any row stride; W [N, K]
with unit column stride, any row stride; bias [N]; y [M, N] contiguous, x's dtype, and it may be
the residual itself (each program reads its tile of r before writing it); sum_sq, sum_sq_out
fp32 with unit column stride.

With pdl=True (programmatic dependent launch, kernels/pdl.py) the kernel is launched while the
kernel ahead still runs and waits for it before anything else. Loading the first weight step
before the wait (weights are read-only) made the H200's decode step slower, not faster
(benchmarks/h200/decode_pdl.md), as did prefetching weights into L2 there, in every projection
or in o_proj alone behind the attention (whose loads then queue behind the prefetches).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.arrival_counters import arrival_counters
from kernels.pdl import check as check_pdl, launch_options

__all__ = ["SkinnyConfig", "candidate_configs", "default_config", "skinny_gemm", "skinny_gemm_ref",
           "MAX_ROWS", "sum_sq_parts"]

MAX_ROWS = 16                   # x rows per call: the MMA's narrow side
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_H200_NUM_SMS = 132
_PLAIN, _SILU_MUL, _RMS_NORM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)    # prologues
# Issue the prologue's loads a step ahead (kept switchable to measure what it buys).
_PREFETCH = True


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    g_ptr, sq_ptr, res_ptr, sq_out_ptr,                 # the norm prologue's and residual epilogue's
    M, N, K, k_per_split, num_splits, num_parts, eps,
    stride_xm, stride_wn, stride_ym, stride_sqm, stride_rm, stride_sqom,
    HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, HAS_SPLITS: tl.constexpr,
    EVEN_K: tl.constexpr, PARTS_BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
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
    if PROLOGUE == _PLAIN:      # a = x, loaded straight into the MMA's operand
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:          # every step is a whole BLOCK_K inside [k_lo, k_hi)
                w = tl.load(w_rows + offs_k[None, :])
                x_mask = m_in[None, :] & (offs_k[:, None] >= 0)
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=offs_k[None, :] < k_hi, other=0.0)
                x_mask = m_in[None, :] & (offs_k[:, None] < k_hi)
            a = tl.load(x_cols + offs_k[:, None], mask=x_mask, other=0.0)
            acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
    else:
        # a is computed from what is loaded (SiLU-and-mul, or the RMSNorm). With PREFETCH the
        # loads of step i + 1 are issued before step i's math, so their latency hides behind it.
        if PROLOGUE == _RMS_NORM:   # 1 / rms of x's rows from their partial sums of squares
            offs_p = tl.arange(0, PARTS_BLOCK)
            sq = tl.load(sq_ptr + offs_m[None, :].to(tl.int64) * stride_sqm + offs_p[:, None],
                         mask=m_in[None, :] & (offs_p[:, None] < num_parts), other=0.0)
            inv_rms = tl.rsqrt(tl.sum(sq, 0) / K + eps)
        else:
            inv_rms = tl.full([BLOCK_M], 1.0, dtype=tl.float32)       # unused
        u0, u1 = _load_raw(x_cols, g_ptr, k_lo, k_hi, m_in, K, PROLOGUE, BLOCK_K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=offs_k[None, :] < k_hi, other=0.0)
            if PREFETCH:
                v0, v1 = _load_raw(x_cols, g_ptr, k0 + BLOCK_K, k_hi, m_in, K, PROLOGUE, BLOCK_K)
            else:
                u0, u1 = _load_raw(x_cols, g_ptr, k0, k_hi, m_in, K, PROLOGUE, BLOCK_K)
            a = _prologue(u0, u1, inv_rms, PROLOGUE)
            acc = tl.dot(w, a, acc, input_precision=DOT_PRECISION)
            if PREFETCH:
                u0, u1 = v0, v1

    if HAS_SPLITS:
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
            _store_y(acc, bias_ptr, y_ptr, res_ptr, sq_out_ptr, pid_n, offs_n, offs_m, n_in, m_in,
                     stride_ym, stride_rm, stride_sqom, HAS_BIAS, ADD_RESIDUAL)
    else:
        _store_y(acc, bias_ptr, y_ptr, res_ptr, sq_out_ptr, pid_n, offs_n, offs_m, n_in, m_in,
                 stride_ym, stride_rm, stride_sqom, HAS_BIAS, ADD_RESIDUAL)


@triton.jit
def _load_raw(x_cols, g_ptr, k0, k_hi, m_in, K, PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr):
    """What the prologue computes a^T [BLOCK_K, BLOCK_M] from, for the columns k0 + [0, BLOCK_K)
    (zeros from k_hi on): (gate, up) of x for SiLU-and-mul, (x, norm weight) for the RMSNorm."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = m_in[None, :] & (offs_k[:, None] < k_hi)
    x_ptrs = x_cols + offs_k[:, None]
    first = tl.load(x_ptrs, mask=mask, other=0.0)
    if PROLOGUE == _SILU_MUL:
        second = tl.load(x_ptrs + K, mask=mask, other=0.0)
    else:
        second = tl.load(g_ptr + offs_k, mask=offs_k < k_hi, other=0.0)
    return first, second


@triton.jit
def _prologue(u0, u1, inv_rms, PROLOGUE: tl.constexpr):
    """a^T from _load_raw's pair, with kernels/activation.py's or kernels/rmsnorm.py's
    expression and roundings."""
    if PROLOGUE == _SILU_MUL:
        gate = u0.to(tl.float32)
        a = gate / (1.0 + tl.exp(-gate)) * u1.to(tl.float32)
    else:
        normed = (u0.to(tl.float32) * inv_rms[None, :]).to(u0.dtype)
        a = u1.to(tl.float32)[:, None] * normed.to(tl.float32)
    return a.to(u0.dtype)


@triton.jit
def _store_y(acc, bias_ptr, y_ptr, res_ptr, sq_out_ptr, pid_n, offs_n, offs_m, n_in, m_in,
             stride_ym, stride_rm, stride_sqom, HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[:, None]
    mask = n_in[:, None] & m_in[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    if ADD_RESIDUAL:    # s = y + r in y's dtype (HF's residual add), and this tile's sum of s^2
        r = tl.load(res_ptr + offs_m[None, :].to(tl.int64) * stride_rm + offs_n[:, None], mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        s32 = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(sq_out_ptr + offs_m.to(tl.int64) * stride_sqom + pid_n, tl.sum(s32 * s32, 0), mask=m_in)
    tl.store(y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y, mask=mask)


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


def default_config(n: int, k: int, num_sms: int = _H200_NUM_SMS) -> SkinnyConfig:
    return candidate_configs(n, k, num_sms)[0]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _H200_NUM_SMS


def sum_sq_parts(n: int, config: SkinnyConfig) -> int:
    """Columns of the partial sums of squares a call with a residual writes: one per N tile."""
    return triton.cdiv(n, config.block_n)


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    norm_weight: torch.Tensor | None = None,
    sum_sq: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    sum_sq_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """y [M, N] = a @ weight^T (+ bias) (+ residual), see the module docstring.

    a = x [M, K]; with silu_mul, silu_and_mul(x) for x [M, 2K]; with norm_weight, the RMSNorm of
    x (kernels/rmsnorm.py without its residual) given `sum_sq` [M, P] fp32, partial sums of the
    squares of x's rows (P of them per row: their total is the row's), and `eps`.
    residual [M, N]: y = (a @ weight^T + bias) rounded, plus residual, rounded (HF's residual
    add), and `sum_sq_out` [M, sum_sq_parts(N, config)] fp32 gets the partial sums of y's squares
    (what the next call's norm needs). out: where y goes (allocated if None); it may be residual.
    config: the tiling; None: `default_config`. pdl: launch with programmatic dependent launch."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    num_rows, num_cols = x.shape
    n, k = weight.shape
    if num_rows > MAX_ROWS:
        raise ValueError(f"x may have at most {MAX_ROWS} rows, got {num_rows}")
    if silu_mul and norm_weight is not None:
        raise ValueError("silu_mul and norm_weight are two prologues: pass at most one")
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
    cfg = config or default_config(n, k, _num_sms(device))
    if norm_weight is not None:
        if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
            raise ValueError(f"norm_weight must be a contiguous {x.dtype} [{k}] tensor, "
                             f"got {norm_weight.dtype} {list(norm_weight.shape)}")
        _check_sum_sq("sum_sq", sum_sq, num_rows, None, device)
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
    elif sum_sq is not None:
        raise ValueError("sum_sq is given but norm_weight is None")
    if residual is not None:
        if residual.shape != (num_rows, n) or residual.dtype != x.dtype or residual.device != device \
                or (n > 1 and residual.stride(1) != 1):
            raise ValueError(f"residual must be a {x.dtype} [{num_rows}, {n}] tensor on {device} with unit "
                             f"column stride, got {residual.dtype} {list(residual.shape)} {residual.stride()}")
        _check_sum_sq("sum_sq_out", sum_sq_out, num_rows, sum_sq_parts(n, cfg), device)
    elif sum_sq_out is not None:
        raise ValueError("sum_sq_out is given but residual is None")
    if out is None:
        out = torch.empty(num_rows, n, dtype=x.dtype, device=device)
    elif out.shape != (num_rows, n) or out.dtype != x.dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} [{num_rows}, {n}] tensor on {device}, "
                         f"got {out.dtype} {list(out.shape)}")
    if num_rows == 0 or n == 0:
        return out
    if k == 0:
        if residual is not None:
            raise ValueError("a residual add needs K > 0")
        return out.zero_() if bias is None else out.copy_(bias.expand(num_rows, n))
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    num_splits = triton.cdiv(k, k_per_split)           # rounding up may leave fewer slices
    num_tiles = triton.cdiv(n, cfg.block_n)
    if num_splits > 1:
        part = torch.empty(num_splits, num_tiles * cfg.block_n, MAX_ROWS, dtype=torch.float32, device=device)
        counters = arrival_counters("skinny_gemm", device, num_tiles)
    else:
        part = counters = out                           # unused
    prologue = _SILU_MUL if silu_mul else _RMS_NORM if norm_weight is not None else _PLAIN
    sq = sum_sq if sum_sq is not None else out          # placeholders where unused
    res = residual if residual is not None else out
    sq_out = sum_sq_out if sum_sq_out is not None else out
    _skinny_gemm_kernel[(num_tiles, num_splits)](
        x, weight, bias if bias is not None else weight, out, part, counters,
        norm_weight if norm_weight is not None else weight, sq, res, sq_out,
        num_rows, n, k, k_per_split, num_splits, sq.shape[1], eps,
        x.stride(0), weight.stride(0), out.stride(0), sq.stride(0), res.stride(0), sq_out.stride(0),
        HAS_BIAS=bias is not None, PROLOGUE=prologue, ADD_RESIDUAL=residual is not None,
        HAS_SPLITS=num_splits > 1, EVEN_K=k % cfg.block_k == 0,
        PARTS_BLOCK=triton.next_power_of_2(sq.shape[1]) if sum_sq is not None else 1, PREFETCH=_PREFETCH,
        BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    return out


def _check_sum_sq(name: str, t: torch.Tensor | None, rows: int, parts: int | None, device) -> None:
    want = f"[{rows}, {parts}]" if parts is not None else f"[{rows}, P >= 1]"
    if t is None or t.dim() != 2 or t.shape[0] != rows or (parts is not None and t.shape[1] != parts) \
            or t.shape[1] < 1 or t.dtype != torch.float32 or t.device != device or t.stride(1) != 1:
        got = "None" if t is None else f"{t.dtype} {list(t.shape)} on {t.device}"
        raise ValueError(f"{name} must be a float32 {want} tensor on {device} with unit column stride, got {got}")


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    *, silu_mul: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """Eager fp64, not rounded: a @ weight^T + bias (+ residual), a = x, silu(g) * u with
    silu_mul, or norm_weight * x / rms(x) with norm_weight."""
    a = x.double()
    if silu_mul:
        gate, up = a.chunk(2, dim=-1)
        a = gate / (1.0 + torch.exp(-gate)) * up
    if norm_weight is not None:
        a = norm_weight.double() * a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps)
    y = a @ weight.double().T
    y = y if bias is None else y + bias.double()
    return y if residual is None else y + residual.double()
