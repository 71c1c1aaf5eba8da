"""Rotary embedding of q and k fused with the paged KV-cache write: one launch for what
`kernels.rotary.rotary_embedding` and `kernels.kv_cache.write_kv` do in two.

Math, for each token t at position p = positions[t] with slot s = slot_mapping[t]:

    q[t], k[t] rotated in place, as rotary_embedding does (fp32 math with fp32 cos/sin tables,
        x1 * c - x2 * s and x2 * c + x1 * s, rounded once to q's dtype)
    if s >= 0:  k_cache[s // block_size, s % block_size] = rotated k[t]   (cast to the cache dtype as
                kernels/kv_cache.py's to_cache casts it)
                v_cache[s // block_size, s % block_size] = v[t]

The cache receives the rotated k after its rounding to k's dtype, so the result is bitwise what
the two kernels give one after the other: both rotate through kernels/rotary.py's
`_rotate_heads`, whose explicit FMAs leave the compiler no contraction to choose. Rows with a
negative slot (batch padding) are rotated but not written, as before.

Layouts (those of the two kernels it replaces):
  q                [T, Hq, D]   any token and head strides, unit stride along D (column slices
  k, v             [T, Hkv, D]  of a fused qkv output [T, (Hq + 2Hkv) * D] work as is)
  k_cache, v_cache [num_blocks, block_size, Hkv, D], any strides with unit stride along D
  slot_mapping     [T] int64 (or int32), each < num_blocks * block_size (unchecked: device memory)
  positions        [T] int64 (or int32), each in 0..max_positions - 1 (unchecked)
  cos_cache,       [max_positions, D/2] fp32, contiguous (`kernels.rotary.build_cos_sin_cache`)
  sin_cache

With qkv_parts (a skinny GEMM's unmerged K-slice partials of the qkv projection, see
kernels/skinny_gemm.py) q, k and v are merged from them as they are read and written to q, k
(rotated) and v: the same bits as merging first.

Grid: (T, head blocks of q followed by head blocks of kv). A kv program rotates its k heads,
stores them back, and writes them and the same v heads to the cache.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_ref import write_kv_ref
from kernels.kv_cache import CACHE_DTYPES, to_cache
# The rotation itself is rotary.py's: one @triton.jit function, with explicit FMAs, so that the
# compiler cannot contract the two kernels' arithmetic differently.
from kernels.pdl import check as check_pdl, launch_options
from kernels.rotary import _heads, _rotate_heads, _rotate_store, rotary_embedding_ref
from kernels.skinny_gemm import add_k_slices

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, stride_qt, stride_qh,
    k_ptr, stride_kt, stride_kh,
    v_ptr, stride_vt, stride_vh,
    k_cache_ptr, stride_kcb, stride_kco, stride_kch,
    v_cache_ptr, stride_vcb, stride_vco, stride_vch,
    pos_ptr, slot_ptr, cos_ptr, sin_ptr,
    num_q_heads, num_kv_heads, half_dim, block_size,
    parts_ptr, stride_ps, stride_pt, bias_ptr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * half_dim + dims, mask=dims < half_dim, other=0.0)
    sin = tl.load(sin_ptr + pos * half_dim + dims, mask=dims < half_dim, other=0.0)
    # Not tl.cdiv (a @jit library function: see kernels/rotary.py).
    num_q_blocks = (num_q_heads + BLOCK_H - 1) // BLOCK_H
    head_dim = 2 * half_dim
    parts_row = parts_ptr + token * stride_pt       # the qkv row's columns: q, then k, then v heads
    if head_block < num_q_blocks:
        if NUM_PARTS > 0:
            heads64, mask = _heads(head_block * BLOCK_H, num_q_heads, half_dim, BLOCK_H, BLOCK_D)
            q1, q2 = _merged_halves(parts_row, stride_ps, bias_ptr, heads64 * head_dim, dims, half_dim, mask,
                                    q_ptr.dtype.element_ty, NUM_PARTS, HAS_BIAS, BLOCK_H, BLOCK_D)
            _rotate_store(q1, q2, q_ptr + token * stride_qt + heads64 * stride_qh + dims[None, :], half_dim,
                          cos, sin, mask)
        else:
            _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, head_block * BLOCK_H,
                          cos, sin, half_dim, BLOCK_H, BLOCK_D)
    else:
        head0 = (head_block - num_q_blocks) * BLOCK_H
        if NUM_PARTS > 0:
            heads64, mask = _heads(head0, num_kv_heads, half_dim, BLOCK_H, BLOCK_D)
            k_cols = (num_q_heads + heads64) * head_dim
            k1, k2 = _merged_halves(parts_row, stride_ps, bias_ptr, k_cols, dims, half_dim, mask,
                                    k_ptr.dtype.element_ty, NUM_PARTS, HAS_BIAS, BLOCK_H, BLOCK_D)
            k1, k2 = _rotate_store(k1, k2, k_ptr + token * stride_kt + heads64 * stride_kh + dims[None, :],
                                   half_dim, cos, sin, mask)
        else:
            k1, k2, heads64, mask = _rotate_heads(
                k_ptr + token * stride_kt, stride_kh, num_kv_heads, head0, cos, sin, half_dim, BLOCK_H, BLOCK_D)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        head_mask = mask
        mask = mask & (slot >= 0)
        block = slot // block_size
        offset = slot % block_size
        kc = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads64 * stride_kch + dims[None, :]
        tl.store(kc, to_cache(k1, k_cache_ptr), mask=mask)
        tl.store(kc + half_dim, to_cache(k2, k_cache_ptr), mask=mask)
        v1_ptr = v_ptr + token * stride_vt + heads64 * stride_vh + dims[None, :]
        if NUM_PARTS > 0:
            v_cols = (num_q_heads + num_kv_heads + heads64) * head_dim
            v1, v2 = _merged_halves(parts_row, stride_ps, bias_ptr, v_cols, dims, half_dim, head_mask,
                                    v_ptr.dtype.element_ty, NUM_PARTS, HAS_BIAS, BLOCK_H, BLOCK_D)
            tl.store(v1_ptr, v1, mask=head_mask)      # v as the merged qkv would hold it
            tl.store(v1_ptr + half_dim, v2, mask=head_mask)
        else:
            v1 = tl.load(v1_ptr, mask=mask)
            v2 = tl.load(v1_ptr + half_dim, mask=mask)
        vc = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads64 * stride_vch + dims[None, :]
        tl.store(vc, to_cache(v1, v_cache_ptr), mask=mask)
        tl.store(vc + half_dim, to_cache(v2, v_cache_ptr), mask=mask)


@triton.jit
def _merged_halves(parts_row, stride_ps, bias_ptr, cols0, dims, half_dim, mask, dtype,
                   NUM_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The halves [BLOCK_H, BLOCK_D] of heads whose first columns are cols0 [BLOCK_H, 1], from
    the skinny GEMM's K-slice partials: summed in slice order, + bias, rounded to dtype (its merge)."""
    c1 = cols0 + dims[None, :]
    a1 = add_k_slices(tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32), parts_row + c1, stride_ps, mask,
                      bias_ptr + c1, NUM_PARTS, HAS_BIAS)
    a2 = add_k_slices(tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32), parts_row + c1 + half_dim, stride_ps,
                      mask, bias_ptr + c1 + half_dim, NUM_PARTS, HAS_BIAS)
    return a1.to(dtype), a2.to(dtype)


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only. The helper was
# decorated when kernels.rotary was imported, which may have been earlier.
_INTERPRETED = not any(isinstance(f, triton.runtime.JITFunction)
                       for f in (_rotary_write_kv_kernel, _rotate_heads, add_k_slices))


def _check(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_cache, sin_cache) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [T, Hq, D] and k, v [T, Hkv, D], got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2 != 0:
        raise ValueError(f"k must be [T={num_tokens}, Hkv, D={head_dim}] with D even, got {list(k.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"caches must be [num_blocks, block_size, Hkv={k.shape[1]}, D={head_dim}], "
                         f"got {list(k_cache.shape)} and {list(v_cache.shape)}")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype of {_FLOAT_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name} must be one of {CACHE_DTYPES}, got {t.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")
    device = q.device
    if device.type != "cuda" and not (_INTERPRETED and device.type == "cpu"):
        raise ValueError(f"q is on {device}: rotary_write_kv needs CUDA tensors (CPU only with "
                         f"TRITON_INTERPRET=1 set before kernels.rotary and kernels.rotary_write_kv are imported)")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping),
                    ("positions", positions), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like q, got {t.device}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (num_tokens,) or t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be int64 [{num_tokens}], got {t.dtype} {list(t.shape)}")
        if num_tokens > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if t.dim() != 2 or t.shape[1] != head_dim // 2 or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 [max_positions, D/2={head_dim // 2}] "
                             f"tensor, got {t.dtype} {list(t.shape)} with strides {t.stride()}")
    if cos_cache.shape != sin_cache.shape:
        raise ValueError(f"cos_cache {list(cos_cache.shape)} and sin_cache {list(sin_cache.shape)} differ")


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    pdl: bool = False,
    qkv_parts: torch.Tensor | None = None,
    qkv_bias: torch.Tensor | None = None,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place and store the rotated k and v [T, Hkv, D]
    in the paged caches at slot_mapping (see the module docstring). q, k and v must not overlap
    each other (disjoint slices of one qkv buffer are fine). pdl: launch with programmatic
    dependent launch (kernels/pdl.py).
    qkv_parts [S, T, (Hq + 2 Hkv) D] fp32 (+ qkv_bias): q, k and v are not read but merged from
    the qkv projection's unmerged K-slice partials (kernels/skinny_gemm.py, merge=False: summed
    in order, + bias, rounded to q's dtype), then written to q, k (rotated) and v as above: the
    same bits as merging first."""
    _check(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_cache, sin_cache)
    check_pdl(pdl, q.device, "rotary_write_kv")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv_parts is not None:
        if (qkv_parts.dim() != 3 or qkv_parts.shape[0] < 1 or qkv_parts.shape[1:] != (num_tokens, width)
                or qkv_parts.dtype != torch.float32 or qkv_parts.stride(2) != 1 or qkv_parts.device != q.device):
            raise ValueError(f"qkv_parts must be float32 [S >= 1, T={num_tokens}, (Hq + 2 Hkv) D={width}] with "
                             f"unit column stride on {q.device}, got {qkv_parts.dtype} {list(qkv_parts.shape)}")
        if qkv_bias is not None and (qkv_bias.shape != (width,) or not qkv_bias.is_contiguous()
                                     or qkv_bias.device != q.device):
            raise ValueError(f"qkv_bias must be a contiguous [{width}] tensor, got {list(qkv_bias.shape)}")
    elif qkv_bias is not None:
        raise ValueError("qkv_bias is given but qkv_parts is None")
    if num_tokens == 0:
        return
    parts = qkv_parts if qkv_parts is not None else cos_cache       # placeholders: NUM_PARTS is 0
    half_dim = head_dim // 2
    block_d = triton.next_power_of_2(half_dim)
    # As kernels/rotary.py: about 2K elements per program and tensor.
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), max(2048 // block_d, 1))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _rotary_write_kv_kernel[grid](
        q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        positions, slot_mapping, cos_cache, sin_cache,
        num_q_heads, num_kv_heads, half_dim, k_cache.shape[1],
        parts, parts.stride(0), parts.stride(1) if qkv_parts is not None else 0,
        qkv_bias if qkv_bias is not None else cos_cache,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        USE_PDL=pdl,
        NUM_PARTS=0 if qkv_parts is None else qkv_parts.shape[0],
        HAS_BIAS=qkv_bias is not None,
        num_warps=4,
        **launch_options(pdl),
    )


def rotary_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two eager references one after the other: HF-order RoPE (`rotary_embedding_ref`), then
    `write_kv_ref` of the rotated k and v into the caches (in place). Returns the new (q, k); the
    inputs q, k, v are left alone."""
    q_rot, k_rot = rotary_embedding_ref(q, k, positions, cos_cache, sin_cache)
    write_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot, k_rot
