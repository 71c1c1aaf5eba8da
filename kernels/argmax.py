"""Row-wise argmax of logits (greedy sampling and the sampler's exponential race), in two launches.

Math, for x [B, V]: out[b] = the first index v of max_v x[b, v], as torch.argmax(x, -1) gives it,
with NaN counted as larger than any number, +inf too (a row holding NaN gives its first NaN).

Why not torch.argmax: for one row of a 128k vocabulary it is a single block reducing the whole
row, 37 us on an H200 (1x128x128 decode profile), about 1% of a single stream's step. Here the
first launch cuts each row into chunks of CHUNK values, one program a chunk, each writing its
chunk's max and the first index holding it; the second takes, per row, the largest of those
maxima and, among the chunks holding it, the smallest index: the first occurrence, because
chunks are in index order. Values are compared in fp32 (exact for every input dtype), so the
result is the argmax of the values as given, not of a rounding of them.

Layouts: x [B, V] with unit column stride, any row stride; fp32, fp16 or bf16. out [B] int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["argmax_rows", "CHUNK"]

CHUNK = 4096                    # values a program of the first launch reduces
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_CHUNKS = 65535             # grid axis 1
# Triton's own combine functions through tl.reduce (not tl.max / tl.min, which triton decorated
# when first imported and which would not run interpreted: see kernels/paged_attention.py).
_MAX = tl.standard._elementwise_max
_MIN = tl.standard._elementwise_min


@triton.jit
def _chunk_max_kernel(x_ptr, stride_xb, val_ptr, idx_ptr, num_cols, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < num_cols
    x = tl.load(x_ptr + row * stride_xb + cols, mask=inside, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.reduce(tl.where(inside & is_nan, cols, num_cols), 0, _MIN)
    x = tl.where(is_nan, float("-inf"), x)
    top = tl.reduce(x, 0, _MAX)
    first = tl.reduce(tl.where(inside & (x == top), cols, num_cols), 0, _MIN)
    # A chunk holding NaN: its first NaN, with NaN as its max (the largest, in _pick_kernel).
    has_nan = first_nan < num_cols
    tl.store(val_ptr + row * num_chunks + chunk, tl.where(has_nan, float("nan"), top))
    tl.store(idx_ptr + row * num_chunks + chunk, tl.where(has_nan, first_nan, first))


@triton.jit
def _pick_kernel(val_ptr, idx_ptr, out_ptr, num_cols, num_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    inside = c < num_chunks
    top_c = tl.load(val_ptr + row * num_chunks + c, mask=inside, other=float("-inf"))
    first_c = tl.load(idx_ptr + row * num_chunks + c, mask=inside, other=num_cols)
    nan_c = inside & (top_c != top_c)
    first_nan = tl.reduce(tl.where(nan_c, first_c, num_cols), 0, _MIN)
    top_c = tl.where(nan_c, float("-inf"), top_c)
    top = tl.reduce(top_c, 0, _MAX)
    first = tl.reduce(tl.where(inside & (top_c == top), first_c, num_cols), 0, _MIN)
    first = tl.where(first_nan < num_cols, first_nan, first)
    tl.store(out_ptr + row, first.to(tl.int64))


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not isinstance(_chunk_max_kernel, triton.runtime.JITFunction)


def argmax_rows(x: torch.Tensor, *, chunk: int = CHUNK) -> torch.Tensor:
    """out [B] int64: the first index of each row's largest value of x [B, V] (module docstring).
    chunk: values per program of the first launch (a power of two; tests use small ones)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [B, V], got shape {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x must be one of {_DTYPES}, got {x.dtype}")
    if x.device.type != "cuda" and not (_INTERPRETED and x.device.type == "cpu"):
        raise ValueError(f"x is on {x.device}: argmax_rows needs CUDA tensors (CPU only with TRITON_INTERPRET=1 "
                         f"set before kernels.argmax is imported)")
    num_rows, num_cols = x.shape
    if num_cols == 0:
        raise ValueError("x must have at least one column: an empty row has no argmax")
    if num_cols > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have unit column stride, got strides {x.stride()}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    num_chunks = triton.cdiv(num_cols, chunk)
    if num_chunks > _MAX_CHUNKS:
        raise ValueError(f"V = {num_cols} needs {num_chunks} chunks of {chunk}, more than {_MAX_CHUNKS}")
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    vals = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(num_rows, num_chunks)](x, x.stride(0), vals, idx, num_cols, num_chunks,
                                              BLOCK=chunk, num_warps=4)
    _pick_kernel[(num_rows,)](vals, idx, out, num_cols, num_chunks,
                              BLOCK_C=max(16, triton.next_power_of_2(num_chunks)), num_warps=1)
    return out
