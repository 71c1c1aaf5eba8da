"""Paged KV-cache write: scatter each new token's K and V rows into their cache slots.

Math: for every token t with s = slot_mapping[t] >= 0,

    k_cache[s // block_size, s % block_size] = key[t]    (cast to the cache dtype; an FP8 cache
                                                           takes key[t] clamped to +-448: `to_cache`)
    v_cache[s // block_size, s % block_size] = value[t]

Rows with a negative slot (batch padding) are skipped. The reference is
`kernels.attention_ref.write_kv_ref`, re-exported here as `write_kv_ref`; they agree for finite
values. A NaN or infinite value (a model already gone wrong) goes into an FP8 cache clamped to
a finite one, as vLLM's FP8 conversion (fmin / fmax) does, where the reference's cast keeps NaN.

Layouts:
  key, value        [T, Hkv, D]    any token and head strides, unit stride along D, so the k and v
                                   column slices of a fused qkv output [T, (Hq + 2Hkv) * D] work as is
  k_cache, v_cache  [num_blocks, block_size, Hkv, D], any strides with unit stride along D
  slot_mapping      [T] int64 (or int32); each slot < num_blocks * block_size (not checked on the
                    host: that would read device memory)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_ref import FP8_KV_DTYPES, write_kv_ref  # noqa: F401  (the reference, kept in one place)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = _FLOAT_DTYPES + FP8_KV_DTYPES


@triton.jit
def to_cache(x, cache_ptr):
    """x rounded to the cache's element type, as attention_ref.to_cache_dtype rounds it: an FP8
    (e4m3) cache takes x in fp32 clamped to +-448 (attention_ref.E4M3_MAX), rounded to nearest even."""
    ty = cache_ptr.dtype.element_ty
    if ty == tl.float8e4nv:
        x = _round_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0))
    return x.to(ty)


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to nearest even on e4m3's grid (3 mantissa bits, subnormal step
    2^-9), in fp32: the cast to FP8 after it is exact. Triton's interpreter rounds its own fp32 ->
    fp8 casts half up and loses a mantissa carry (127.9 -> 64), so the CPU tests could not hold
    the kernel to the reference without this; on a GPU, cvt.rn.satfinite gives the same bits.
    |x| + 1.5 * 2^23 * step has ulp = step, so the add rounds |x| to a multiple of step (nearest
    even) and the subtraction is exact."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 121)      # biased; 2^-6 and below: the subnormal step
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + magic) - magic
    sign = (bits >> 31) << 31                             # x's sign bit: -0.0 stays -0.0
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _write_kv_kernel(
    key_ptr, stride_kt, stride_kh,
    value_ptr, stride_vt, stride_vh,
    k_cache_ptr, stride_kcb, stride_kco, stride_kch,
    v_cache_ptr, stride_vcb, stride_vco, stride_vch,
    slot_ptr,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (T, head blocks)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim) & (slot >= 0)
    block = slot // block_size
    offset = slot % block_size
    heads64 = heads[:, None].to(tl.int64)

    k = tl.load(key_ptr + token * stride_kt + heads64 * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads64 * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads64 * stride_kch + dims[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads64 * stride_vch + dims[None, :]
    tl.store(k_dst, to_cache(k, k_cache_ptr), mask=mask)
    tl.store(v_dst, to_cache(v, v_cache_ptr), mask=mask)


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not isinstance(_write_kv_kernel, triton.runtime.JITFunction)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, Hkv, D] into the paged caches at slot_mapping, in place."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {list(key.shape)} and {list(value.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"caches must be [num_blocks, block_size, Hkv={num_kv_heads}, D={head_dim}], "
            f"got {list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {list(slot_mapping.shape)}"
        )
    device = key.device
    if device.type != "cuda" and not (_INTERPRETED and device.type == "cpu"):
        raise ValueError(
            f"key is on {device}: write_kv needs CUDA tensors (CPU only with TRITON_INTERPRET=1 "
            f"set before kernels.kv_cache is imported)"
        )
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name} must be on {device} like key, got {t.device}")
    for name, t, allowed in (("key", key, _FLOAT_DTYPES), ("value", value, _FLOAT_DTYPES),
                             ("k_cache", k_cache, CACHE_DTYPES), ("v_cache", v_cache, CACHE_DTYPES)):
        if t.dtype not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {t.dtype}")
        if head_dim > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along D, got strides {t.stride()}")
    if num_tokens > 1 and slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous, got stride {slot_mapping.stride()}")
    if num_tokens == 0 or key.numel() == 0:
        return

    block_d = triton.next_power_of_2(head_dim)
    # About 2K elements per program and tensor.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(2048 // block_d, 1))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key, key.stride(0), key.stride(1),
        value, value.stride(0), value.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slot_mapping,
        num_kv_heads, head_dim, k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
