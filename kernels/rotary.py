"""Rotary position embedding (RoPE) applied to q and k in place, HF's non-interleaved layout.

Math, for each token t at position p = positions[t] and each head of q and of k, with
x1 = x[..., :D/2], x2 = x[..., D/2:], c = cos_cache[p], s = sin_cache[p] (each [D/2]):

    out1 = x1 * c - x2 * s
    out2 = x2 * c + x1 * s

This is HF's `x * cos + rotate_half(x) * sin` with cos/sin = cat(freqs, freqs). The kernel
computes in fp32 with fp32 cos/sin, as fma(x1, c, -(x2 * s)) and fma(x2, c, x1 * s), and rounds
once to x's dtype. HF instead rounds cos/sin to
the model dtype and multiplies and adds in that dtype (three roundings more). Measured in bf16 at
Llama-3.1-8B shapes (H200, unit-normal q/k, T = 4096): the two differ by up to 0.03125 (one bf16
ulp at 4..8, two at 2..4), and against fp64 the kernel errs by at most 0.0156, HF's order by 0.036.
`rotary_embedding_ref` follows HF's order exactly, so it is bitwise what the model computes today.

Layouts:
  q               [T, Hq, D]   any token and head strides, unit stride along D, so the q and k
  k               [T, Hkv, D]  column slices of a fused qkv output [T, (Hq + 2Hkv) * D] work as is
  positions       [T]          int64 (or int32), each in 0..max_positions - 1 (not checked on the
                               host: that would read device memory)
  cos_cache,      [max_positions, D/2] fp32, contiguous, from `build_cos_sin_cache`
  sin_cache
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, head0, cos, sin, half_dim,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate heads head0..head0 + BLOCK_H - 1 of one token in place; x_ptr points at its head 0.
    Returns the stored halves [BLOCK_H, BLOCK_D] (in x's dtype), their heads [BLOCK_H, 1] as int64
    and the mask, for kernels/rotary_write_kv.py, which rotates through this same function."""
    heads64, mask = _heads(head0, num_heads, half_dim, BLOCK_H, BLOCK_D)
    ptr1 = x_ptr + heads64 * stride_h + tl.arange(0, BLOCK_D)[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half_dim, mask=mask, other=0.0)
    out1, out2 = _rotate_store(x1, x2, ptr1, half_dim, cos, sin, mask)
    return out1, out2, heads64, mask


@triton.jit
def _heads(head0, num_heads, half_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads head0.. [BLOCK_H, 1] as int64 and the mask of their halves' elements [BLOCK_H, BLOCK_D]."""
    heads = head0 + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    return heads[:, None].to(tl.int64), (heads[:, None] < num_heads) & (dims[None, :] < half_dim)


@triton.jit
def _rotate_store(x1, x2, ptr1, half_dim, cos, sin, mask):
    """The rotation of the halves x1, x2 [BLOCK_H, BLOCK_D], stored at ptr1 and ptr1 + half_dim;
    returns what was stored. (kernels/rotary_write_kv.py rotates values it merged itself.)"""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # Explicit FMAs: left as `x1f * c - x2f * s`, the GPU compiler may fuse either product into the
    # subtraction, and chose differently here and in the fused kernel (1 fp16 ulp apart on an
    # H200). tl.fma fixes the order: one product rounded, then fused with the other. (The CPU
    # interpreter computes tl.fma as a rounded multiply and add; it is one expression there too.)
    out1 = tl.fma(x1f, cos[None, :], -(x2f * sin[None, :])).to(x1.dtype)
    out2 = tl.fma(x2f, cos[None, :], x1f * sin[None, :]).to(x2.dtype)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr1 + half_dim, out2, mask=mask)
    return out1, out2


@triton.jit
def _rotary_embedding_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, stride_kt, stride_kh,
    pos_ptr, cos_ptr, sin_ptr,
    num_q_heads, num_kv_heads, half_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (T, head blocks of q followed by head blocks of k)
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * half_dim + dims, mask=dims < half_dim, other=0.0)
    sin = tl.load(sin_ptr + pos * half_dim + dims, mask=dims < half_dim, other=0.0)
    # Not tl.cdiv: Triton's own @jit helpers run in the CPU interpreter only if TRITON_INTERPRET
    # was set before triton was first imported; builtins and our kernels need it only before here.
    num_q_blocks = (num_q_heads + BLOCK_H - 1) // BLOCK_H
    if head_block < num_q_blocks:
        _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, head_block * BLOCK_H,
                      cos, sin, half_dim, BLOCK_H, BLOCK_D)
    else:
        _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, (head_block - num_q_blocks) * BLOCK_H,
                      cos, sin, half_dim, BLOCK_H, BLOCK_D)


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not isinstance(_rotary_embedding_kernel, triton.runtime.JITFunction)


def _check_heads(name: str, t: torch.Tensor, num_tokens: int, head_dim: int):
    if t.dim() != 3 or t.shape[0] != num_tokens or t.shape[2] != head_dim:
        raise ValueError(f"{name} must be [T={num_tokens}, heads, D={head_dim}], got {list(t.shape)}")
    if t.stride(2) != 1:
        raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (see the module docstring).

    q and k must not overlap each other (disjoint slices of one qkv buffer are fine).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {list(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2 != 0:
        raise ValueError(f"head dim D must be even, got {head_dim}")
    _check_heads("q", q, num_tokens, head_dim)
    _check_heads("k", k, num_tokens, head_dim)
    num_kv_heads = k.shape[1]
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q and k must share one dtype of {_FLOAT_DTYPES}, got {q.dtype} and {k.dtype}")
    device = q.device
    if device.type != "cuda" and not (_INTERPRETED and device.type == "cpu"):
        raise ValueError(
            f"q is on {device}: rotary_embedding needs CUDA tensors (CPU only with TRITON_INTERPRET=1 "
            f"set before kernels.rotary is imported)"
        )
    for name, t in (("k", k), ("positions", positions), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {t.device}")
    if positions.shape != (num_tokens,) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 [{num_tokens}], got {positions.dtype} {list(positions.shape)}")
    half_dim = head_dim // 2
    for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if t.dim() != 2 or t.shape[1] != half_dim or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous float32 [max_positions, D/2={half_dim}] tensor, "
                f"got {t.dtype} {list(t.shape)} with strides {t.stride()}"
            )
    if cos_cache.shape != sin_cache.shape:
        raise ValueError(f"cos_cache {list(cos_cache.shape)} and sin_cache {list(sin_cache.shape)} differ")
    if positions.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"positions must be contiguous, got stride {positions.stride()}")
    if num_tokens == 0:
        return

    block_d = triton.next_power_of_2(half_dim)
    # About 2K elements per program: enough work per program without spilling registers.
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), max(2048 // block_d, 1))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _rotary_embedding_kernel[grid](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1),
        positions, cos_cache, sin_cache,
        num_q_heads, num_kv_heads, half_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions * inv_freq, each [max_positions, D/2] fp32.

    The scaling (default, linear, llama3) lives in inv_freq, so pass the model's. The angles are
    computed exactly as HF's rotary embedding does (fp32 position times fp32 frequency), so each
    row equals the first half of HF's cos/sin for that position, before HF's cast to the dtype.
    """
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32 [D/2], got {inv_freq.dtype} {list(inv_freq.shape)}")
    if not 0 < max_positions <= 2**24:  # beyond 2**24 fp32 positions are no longer exact
        raise ValueError(f"max_positions must be in 1..{2**24}, got {max_positions}")
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, D/2]
    return freqs.cos(), freqs.sin()


def rotary_embedding_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager RoPE in HF's order: cos/sin rounded to q's dtype, then x*cos + rotate_half(x)*sin in
    that dtype. Returns new (q, k); the inputs are left alone."""
    cos = cos_cache[positions.long()]
    sin = sin_cache[positions.long()]
    cos = torch.cat((cos, cos), dim=-1).to(q.dtype)[:, None, :]  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1).to(q.dtype)[:, None, :]

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
