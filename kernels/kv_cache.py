"""Paged KV-cache write: scatter each new token's K and V rows into their cache slots.

Math: for every token t with s = slot_mapping[t] >= 0,

    k_cache[s // block_size, s % block_size] = key[t]    (cast to the cache dtype)
    v_cache[s // block_size, s % block_size] = value[t]

Rows with a negative slot (batch padding) are skipped. The reference is
`kernels.attention_ref.write_kv_ref`, re-exported here as `write_kv_ref`.

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

from kernels.attention_ref import write_kv_ref  # noqa: F401  (the reference, kept in one place)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


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
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be one of {_FLOAT_DTYPES}, got {t.dtype}")
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
