"""FP8 weights (EngineConfig.quantization = "fp8"): W8A8 projections made at load time from a
bf16 / fp16 / fp32 checkpoint, as vLLM's dynamic `--quantization fp8` does.

- Weights: float8_e4m3fn, one float32 scale per output channel (row of [N, K]):
  scale[n] = max_k |W[n, k]| * fp32(1 / 448), W8[n, k] = fp8(W[n, k] / scale[n]), as
  kernels/fp8_quant.py scales a row. Per channel, so our fused
  qkv_proj / gate_up_proj rows quantize exactly as HF's separate projections would.
- Inputs: quantized per row (per token) at run time, kernels/fp8_quant.py (Triton on CUDA, its
  reference elsewhere).
- Product: on CUDA torch._scaled_mm with row-wise scales, out in the input's dtype (FP8 tensor
  cores, whose sums keep fewer bits than fp32: 1-3e-4 of the largest, measured in
  benchmarks/h200/fp8_weights.md); elsewhere kernels.fp8_quant.fp8_matmul_ref, the same math in fp32.

The decoder layers' four projections take it; the embeddings and lm_head stay in the model's
dtype (as vLLM's). Such a projection never runs the skinny GEMM (engine/gemm_tuning.py skips it)
and never returns SplitSums.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul
from kernels.fp8_quant import fp8_matmul_ref, quantize_rows, quantize_rows_ref, silu_mul_quantize_rows


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8 [N, K] float8_e4m3fn, scale [N, 1] float32) for a weight [N, K]: its rows (output
    channels) quantized as the inputs' rows are (module docstring)."""
    return quantize_rows_ref(weight)


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)                  # [N, K] float8_e4m3fn
        self.register_buffer("weight_scale", weight_scale)      # [N, 1] float32
        self.bias = bias                                        # [N] model dtype, or None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        weight, scale = quantize_weight(linear.weight)
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        return cls(weight, scale, bias)

    def forward(self, x: torch.Tensor, pdl: bool = False, unmerged: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The Linear interface (engine/models/linear.py); unmerged and out are not used here."""
        if x.is_cuda:
            return self._scaled_product(*quantize_rows(x, pdl=pdl), x.dtype)
        q, scale = quantize_rows_ref(x)
        y = fp8_matmul_ref(q, scale, self.weight, self.weight_scale).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def forward_silu_mul(self, gate_up: torch.Tensor, pdl: bool = False,
                         unmerged: bool = False) -> torch.Tensor:
        """self(silu_and_mul(gate_up)): on CUDA the activation and the quantization are one
        kernel (kernels/fp8_quant.silu_mul_quantize_rows, the same bits)."""
        if gate_up.is_cuda:
            return self._scaled_product(*silu_mul_quantize_rows(gate_up, pdl=pdl), gate_up.dtype)
        return self(silu_and_mul(gate_up, pdl=pdl), pdl=pdl)

    def _scaled_product(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # a bias (Qwen2's qkv_proj) is added after the product, as on the CPU
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale.t(), out_dtype=dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_e4m3 per channel"


def quantize_model(model: nn.Module) -> None:
    """Every decoder layer's four projections become Fp8Linear, in place, one at a time (the
    model's dtype copy of each is freed as its FP8 copy is made)."""
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            setattr(parent, name, Fp8Linear.from_linear(getattr(parent, name)))
