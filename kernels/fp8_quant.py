"""Per-row (per-token) dynamic FP8 quantization of a projection's input, for the FP8 weights
path (EngineConfig.quantization = "fp8", engine/models/fp8_linear.py).

Math, for x [M, K] in any float dtype, per row m (computed in fp32):

    scale[m] = max(max_k |x[m, k]|, 1e-12) * fp32(1 / 448)
    q[m, k]  = fp8_e4m3(clamp(x[m, k] / scale[m], -448, 448))     (round to nearest even)

so x[m, k] ~= q[m, k] * scale[m]; 448 is float8_e4m3fn's largest finite value. The scale is a
product with the reciprocal (torch divides a CUDA tensor by a number that way, and by a tensor
correctly rounded) and the division by it correctly rounded (div_rn), so the kernel and
`quantize_rows_ref` give the same bits on either device, for finite x. A row holding NaN or inf
(a model already gone wrong) comes out finite from the kernel, as from vLLM's dynamic FP8
quantization (its max and clamp drop NaN), where the reference gives NaN.

Layouts: x [M, K] with unit column stride and any row stride; q [M, K] contiguous
float8_e4m3fn; scale [M, 1] float32 contiguous (torch._scaled_mm's row-wise scale_a).

`silu_mul_quantize_rows` is kernels/activation.py's SiLU-and-mul and this quantization in one
kernel (down_proj's input), with the same bits as the two one after the other.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_ref
from kernels.kv_cache import to_cache
from kernels.pdl import check as check_pdl, launch_options

FP8_MAX = 448.0
_MIN_AMAX = 1e-12
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, stride_x,
    q_ptr, scale_ptr,
    num_cols,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # grid: (M,); one program holds a whole row (K <= 16384 here: 32 values a thread at 16 warps)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    _store_quantized_row(x, q_ptr, scale_ptr, row, cols, mask, num_cols)


@triton.jit
def _store_quantized_row(x, q_ptr, scale_ptr, row, cols, mask, num_cols):
    """Row `row` of x (fp32, its columns `cols`, those past num_cols masked and 0): its scale and
    its e4m3 values (module docstring), stored."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
    scale = amax * (1.0 / 448.0)
    # to_cache clamps to +-448 and rounds to nearest even, as the GPU's cvt.rn.satfinite does, also
    # under the interpreter (whose own fp32 -> fp8 cast loses mantissa carries)
    tl.store(q_ptr + row * num_cols + cols, to_cache(tl.math.div_rn(x, scale), q_ptr), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _silu_mul_quantize_kernel(
    x_ptr, stride_x,
    q_ptr, scale_ptr,
    inter_size,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # grid: (M,); one program holds a whole row of gate and up
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    # kernels/activation.py's product, rounded to x's dtype as silu_and_mul stores it
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    _store_quantized_row(y, q_ptr, scale_ptr, row, cols, mask, inter_size)


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not isinstance(_quantize_rows_kernel, triton.runtime.JITFunction)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {list(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be one of {_FLOAT_DTYPES}, got {x.dtype}")


def quantize_rows(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K] float8_e4m3fn, scale [M, 1] float32) for x [M, K] (module docstring).
    pdl: launch with programmatic dependent launch (kernels/pdl.py)."""
    _check(x)
    if x.stride(-1) != 1:
        raise ValueError(f"x must have unit column stride, got strides {x.stride()}")
    return _launch_by_rows(_quantize_rows_kernel, x, x.shape[1], pdl, "quantize_rows")


def silu_mul_quantize_rows(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu_and_mul(x)) for x [M, 2I] (kernels/activation.py's layout: gate, then
    up) in one kernel, the same bits: the product is rounded to x's dtype before its row is
    quantized. Returns (q [M, I] float8_e4m3fn, scale [M, 1] float32). One launch and no [M, I]
    intermediate: H200, I = 14,336, 32 layers' inputs, us a layer against the two kernels:
    13.2 / 14.7 at 256 rows, 22.2 / 25.3 at 512, 73.2 / 93.2 at 2,048, 271.3 / 349.9 at 8,192
    (benchmarks/h200/fp8_decode.md, section 6). pdl: as quantize_rows."""
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [M, 2I] with an even number of columns, got shape {list(x.shape)}")
    _check(x)
    if x.shape[1] > 0 and x.stride(-1) != 1:
        raise ValueError(f"x must have unit column stride, got strides {x.stride()}")
    return _launch_by_rows(_silu_mul_quantize_kernel, x, x.shape[1] // 2, pdl, "silu_mul_quantize_rows")


def _launch_by_rows(kernel, x: torch.Tensor, num_cols: int, pdl: bool,
                    name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [M, num_cols] float8_e4m3fn, scale [M, 1] float32) from `kernel`, one program a row of
    x (checked by the caller), each row whole in one block."""
    if not (x.is_cuda or _INTERPRETED):
        raise ValueError("the Triton kernel runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1); "
                         f"use {name}_ref on CPU")
    check_pdl(pdl, x.device, name)
    num_rows = x.shape[0]
    q = torch.empty(num_rows, num_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0 or num_cols == 0:     # no row, or rows of no value (no scale to compute)
        return q, scale
    block = triton.next_power_of_2(num_cols)
    kernel[(num_rows,)](
        x, x.stride(0), q, scale, num_cols,
        BLOCK=block, USE_PDL=pdl, num_warps=max(4, min(16, block // 1024)), **launch_options(pdl),
    )
    return q, scale


def silu_mul_quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager PyTorch reference of silu_mul_quantize_rows: quantize_rows_ref of silu_and_mul_ref."""
    return quantize_rows_ref(silu_and_mul_ref(x))


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager PyTorch reference of quantize_rows, on any device."""
    _check(x)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_MIN_AMAX)
    scale = amax * (1.0 / FP8_MAX)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_matmul_ref(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                   weight_scale: torch.Tensor) -> torch.Tensor:
    """What torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.t()) computes, in
    fp32: (q @ weight^T) * scale * weight_scale^T, for q [M, K], scale [M, 1], weight [N, K]
    float8_e4m3fn and weight_scale [N, 1] float32. Returns [M, N] float32."""
    return (q.float() @ weight.float().t()) * scale * weight_scale.t()
