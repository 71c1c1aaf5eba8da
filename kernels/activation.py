"""SiLU-and-mul, the activation of a gated MLP over our fused gate_up projection.

Math, for x [T, 2I] laid out gate first, up second (our `gate_up_proj` row order):

    out[t, i] = silu(g) * u,   g = x[t, i], u = x[t, I + i],   silu(g) = g / (1 + exp(-g))

computed in fp32 and rounded once to x's dtype. HF computes `F.silu(gate) * up` in the model
dtype, rounding silu(g) to it before the multiply: in bf16 the two differ by up to about one ulp
(measured on an H200, |x| up to ~15: largest error against fp64 0.25 here, 0.45 in HF's order).

Layouts: x [T, 2I] with unit column stride and any row stride; out [T, I], likewise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import check as check_pdl, launch_options

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, stride_x,
    out_ptr, stride_out,
    inter_size,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # grid: (T, column blocks of the output)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter_size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not isinstance(_silu_and_mul_kernel, triton.runtime.JITFunction)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I]; returns [T, I] in x's dtype.

    `out` is an optional preallocated [T, I] output (e.g. a static CUDA-graph buffer).
    pdl: launch with programmatic dependent launch (kernels/pdl.py).
    """
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [T, 2I] with an even number of columns, got shape {list(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if x.device.type != "cuda" and not (_INTERPRETED and x.device.type == "cpu"):
        raise ValueError(
            f"x is on {x.device}: silu_and_mul needs CUDA tensors (CPU only with TRITON_INTERPRET=1 "
            f"set before kernels.activation is imported)"
        )
    check_pdl(pdl, x.device, "silu_and_mul")
    if x.shape[1] > 0 and x.stride(1) != 1:
        raise ValueError(f"x must have unit column stride, got strides {x.stride()}")
    num_tokens, inter_size = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter_size), dtype=x.dtype, device=x.device)
    if out.shape != (num_tokens, inter_size) or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be {x.dtype} [{num_tokens}, {inter_size}] on {x.device}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if inter_size > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have unit column stride, got strides {out.stride()}")
    if num_tokens == 0 or inter_size == 0:
        return out

    grid = (num_tokens, triton.cdiv(inter_size, _BLOCK))
    _silu_and_mul_kernel[grid](x, x.stride(0), out, out.stride(0), inter_size, BLOCK=_BLOCK,
                               USE_PDL=pdl, num_warps=4, **launch_options(pdl))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Eager fp32 silu(gate) * up from the formula, rounded once to x's dtype."""
    inter_size = x.shape[-1] // 2
    gate = x[..., :inter_size].float()
    up = x[..., inter_size:].float()
    return (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype)
