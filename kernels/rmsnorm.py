"""RMSNorm, optionally fused with the residual add that precedes it, as one Triton kernel.

Math (HF LlamaRMSNorm, eps inside the square root), for each row of x [T, H]:

    s       = x + residual                   in x's dtype (HF adds the residual in the model dtype)
    normed  = (s_fp32 * rsqrt(mean(s_fp32^2) + eps)).to(x.dtype)
    out     = weight * normed                in promote(weight.dtype, x.dtype)

Without a residual, s = x. The normalization runs in fp32 and is rounded to x's dtype *before*
the weight multiply, exactly as HF does; the multiply itself is done in fp32 and rounded once,
which equals torch's own bf16/fp16 multiply (it also computes in fp32 and rounds).

Layouts: x, residual, out, residual_out are [T, H] with unit column stride and any row stride
(so a row-slice of a wider buffer works without a copy); weight is [H], contiguous.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import check as check_pdl, launch_options
from kernels.skinny_gemm import add_k_slices

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HIDDEN = 65536  # one row is one block in registers


@triton.jit
def _rms_norm_kernel(
    x_ptr, stride_x,
    res_ptr, stride_res,
    res_out_ptr, stride_res_out,
    w_ptr,
    out_ptr, stride_out,
    hidden_size, eps,
    parts_ptr, stride_ps, stride_pt, x_bias_ptr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    HAS_X_BIAS: tl.constexpr,
):
    if USE_PDL:     # kernels/pdl.py: the kernel ahead is done before anything is read
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size

    if NUM_PARTS > 0:   # x from a skinny GEMM's K-slice partials: its merge, in its order
        x = add_k_slices(tl.full([BLOCK_H], 0.0, dtype=tl.float32), parts_ptr + row * stride_pt + cols,
                         stride_ps, mask, x_bias_ptr + cols, NUM_PARTS, HAS_X_BIAS).to(res_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        # Round the sum to the model dtype first: that rounded value is both the new residual
        # and what HF normalizes.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)

    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / hidden_size
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


# triton.jit picked the interpreter (TRITON_INTERPRET=1 at import) or the compiler: an
# interpreted kernel runs on CPU tensors, a compiled one on CUDA tensors only.
_INTERPRETED = not any(isinstance(f, triton.runtime.JITFunction) for f in (_rms_norm_kernel, add_k_slices))


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, device: torch.device):
    if t.shape != shape:
        raise ValueError(f"{name} must be [T, H] = {list(shape)}, got {list(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")


def rms_norm(
    x: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    pdl: bool = False,
    x_parts: torch.Tensor | None = None,
    x_bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, H] (see the module docstring). Returns out, or (out, new_residual).

    `out` and `residual_out` are optional preallocated outputs (e.g. static CUDA-graph buffers).
    In-place use is allowed: `out` may be `x` itself and `residual_out` may be `residual` itself,
    since each row is read completely before it is written. Other overlaps are not checked.
    pdl: launch with programmatic dependent launch (kernels/pdl.py).
    x_parts [S, T, H] fp32 (with x None and a residual): x is the merge of a skinny GEMM's K-slice
    partials (kernels/skinny_gemm.py, merge=False): their sum in slice order, + x_bias [H], rounded
    to the residual's dtype; the same bits as the GEMM's own merge.
    """
    if x_parts is not None:
        x = _check_x_parts(x, x_parts, x_bias, residual)
    elif x_bias is not None:
        raise ValueError("x_bias is given but x_parts is None")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {list(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be one of {_FLOAT_DTYPES}, got {x.dtype}")
    if x.device.type != "cuda" and not (_INTERPRETED and x.device.type == "cpu"):
        raise ValueError(
            f"x is on {x.device}: rms_norm needs CUDA tensors (CPU only with TRITON_INTERPRET=1 "
            f"set before kernels.rmsnorm is imported)"
        )
    check_pdl(pdl, x.device, "rms_norm")
    num_tokens, hidden_size = x.shape
    if not 0 < hidden_size <= _MAX_HIDDEN:
        raise ValueError(f"H must be in 1..{_MAX_HIDDEN}, got {hidden_size}")
    _check_rows("x", x, (num_tokens, hidden_size), x.dtype, x.device)
    if weight.shape != (hidden_size,) or weight.dtype not in _FLOAT_DTYPES or weight.device != x.device:
        raise ValueError(
            f"weight must be a float [{hidden_size}] tensor on {x.device}, "
            f"got {weight.dtype} {list(weight.shape)} on {weight.device}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")

    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty((num_tokens, hidden_size), dtype=out_dtype, device=x.device)
    _check_rows("out", out, (num_tokens, hidden_size), out_dtype, x.device)
    if residual is not None:
        _check_rows("residual", residual, (num_tokens, hidden_size), x.dtype, x.device)
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        _check_rows("residual_out", residual_out, (num_tokens, hidden_size), x.dtype, x.device)
    elif residual_out is not None:
        raise ValueError("residual_out is given but residual is None")

    if num_tokens > 0:
        block_h = triton.next_power_of_2(hidden_size)
        has_residual = residual is not None
        res = residual if has_residual else x  # placeholders never read: HAS_RESIDUAL is False
        res_out = residual_out if has_residual else x
        parts = x_parts if x_parts is not None else out      # placeholders: NUM_PARTS is 0
        grid = (num_tokens,)  # one program per row
        _rms_norm_kernel[grid](
            x, x.stride(0),
            res, res.stride(0),
            res_out, res_out.stride(0),
            weight,
            out, out.stride(0),
            hidden_size, eps,
            parts, parts.stride(0), parts.stride(1) if x_parts is not None else 0,
            x_bias if x_bias is not None else weight,
            HAS_RESIDUAL=has_residual,
            BLOCK_H=block_h,
            USE_PDL=pdl,
            NUM_PARTS=0 if x_parts is None else x_parts.shape[0],
            HAS_X_BIAS=x_bias is not None,
            num_warps=min(max(block_h // 512, 1), 16),
            **launch_options(pdl),
        )
    return out if residual is None else (out, residual_out)


def _check_x_parts(x, x_parts, x_bias, residual) -> torch.Tensor:
    """Checks rms_norm's x_parts form; returns the residual to stand for x in the checks and as
    the kernel's unread x argument (the kernel reads the parts)."""
    if x is not None:
        raise ValueError("pass x or x_parts, not both")
    if residual is None:
        raise ValueError("x_parts needs the residual (x is rounded to its dtype)")
    if (x_parts.dim() != 3 or x_parts.dtype != torch.float32 or x_parts.shape[0] < 1
            or x_parts.shape[1:] != residual.shape or x_parts.stride(2) != 1 or x_parts.device != residual.device):
        raise ValueError(f"x_parts must be float32 [S >= 1, T, H] = [S, {', '.join(map(str, residual.shape))}] "
                         f"with unit column stride on the residual's device, got {x_parts.dtype} "
                         f"{list(x_parts.shape)}")
    if x_bias is not None and (x_bias.shape != (residual.shape[1],) or not x_bias.is_contiguous()
                               or x_bias.device != residual.device):
        raise ValueError(f"x_bias must be a contiguous [{residual.shape[1]}] tensor, got {list(x_bias.shape)}")
    return residual


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Eager HF LlamaRMSNorm, with HF's decoder-layer residual add (in x's dtype) in front."""
    if residual is not None:
        x = residual + x
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, x)
