"""The model's projections: nn.Linear, save that decode-sized inputs (up to 16 rows) may run the
Triton skinny GEMM (kernels/skinny_gemm.py) instead of cuBLAS, where it was measured faster.

`skinny` maps a row bucket (the row count rounded up to a power of two, at most
kernels.skinny_gemm.MAX_ROWS) to the SkinnyConfig to run; inputs of any other row count use
F.linear. It starts empty (CPU, tests, EngineConfig.skinny_gemm = "off"): the start-up timing in
engine/gemm_tuning.py fills it. `skinny_silu` is the same for `forward_silu_mul` (down_proj with
SiLU-and-mul folded into the kernel's prologue).

`skinny_chain` holds the fastest skinny config per bucket whether or not it beat cuBLAS: a call
with pdl=True (a decode graph's chain of kernels launched with programmatic dependent launch,
kernels/pdl.py) runs it, because a cuBLAS kernel takes no part in PDL: it starts only when the
kernel ahead has finished, and so does the kernel after it.

A decode layer's norms inside its projections (LlamaForCausalLM.norms_in_gemms, where every
projection runs the skinny GEMM): `forward_add` is o_proj / down_proj with HF's residual add
after it, in place, handing on the partial sums of squares of the new residual, and
`forward_norm` is qkv_proj / gate_up_proj with the RMSNorm before it, from those sums
(kernels/skinny_gemm.py's prologue and epilogue). They run the `skinny_fused` table's config
(the fastest of the fused form, engine/gemm_tuning.py), with or without PDL.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul
from kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_gemm, sum_sq_parts

ROW_BUCKETS = tuple(1 << i for i in range(MAX_ROWS.bit_length()) if 1 << i <= MAX_ROWS)   # 1, 2, 4, 8, 16


def row_bucket(num_rows: int) -> int:
    """The bucket whose choice covers num_rows rows: the next power of two; 0 past MAX_ROWS."""
    return next((b for b in ROW_BUCKETS if b >= num_rows), 0)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.skinny: dict[int, SkinnyConfig] = {}
        self.skinny_silu: dict[int, SkinnyConfig] = {}
        self.skinny_chain: dict[int, SkinnyConfig] = {}
        self.skinny_fused: dict[int, SkinnyConfig] = {}

    def _config(self, table: dict[int, SkinnyConfig], x: torch.Tensor) -> SkinnyConfig | None:
        if not table or x.dim() != 2 or x.stride(-1) != 1:
            return None
        return table.get(row_bucket(x.shape[0]))

    def skinny_config(self, x: torch.Tensor, pdl: bool = False) -> SkinnyConfig | None:
        """The skinny GEMM config a call on x runs (None: cuBLAS)."""
        return self._config(self.skinny_chain if pdl else self.skinny, x)

    def forward(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """pdl: the call is in a chain launched with programmatic dependent launch."""
        cfg = self.skinny_config(x, pdl)
        if cfg is None:
            return F.linear(x, self.weight, self.bias)
        return skinny_gemm(x, self.weight, self.bias, config=cfg, pdl=pdl)

    def fused_config(self, x: torch.Tensor) -> SkinnyConfig | None:
        """The config forward_norm / forward_add run on x (None: they cannot)."""
        return self._config(self.skinny_fused, x)

    def forward_norm(self, x: torch.Tensor, norm, sum_sq: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """self(norm(x)), the norm (the model's RMSNorm module: its weight and eps) in the
        kernel's prologue, from sum_sq [T, P], partial sums of x's squared rows. Only where
        fused_config(x) is a config."""
        return skinny_gemm(x, self.weight, self.bias, norm_weight=norm.weight, sum_sq=sum_sq, eps=norm.eps,
                           config=self._required_config(x), pdl=pdl)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, pdl: bool = False,
                    silu_mul: bool = False) -> torch.Tensor:
        """residual <- residual + self(x) (self(silu_and_mul(x)) with silu_mul), rounded as HF
        adds, in place; returns the partial sums of squares of the new residual's rows
        [T, P] fp32, for the forward_norm after it. Only where fused_config(x) is a config."""
        cfg = self._required_config(x)
        sum_sq = torch.empty(x.shape[0], sum_sq_parts(self.out_features, cfg), dtype=torch.float32,
                             device=x.device)
        skinny_gemm(x, self.weight, self.bias, silu_mul=silu_mul, residual=residual, sum_sq_out=sum_sq,
                    out=residual, config=cfg, pdl=pdl)
        return sum_sq

    def _required_config(self, x: torch.Tensor) -> SkinnyConfig:
        cfg = self.fused_config(x)
        if cfg is None:
            raise ValueError(f"no skinny_fused config for {x.shape[0]} rows: the fused norm and residual "
                             f"forms run only where engine/gemm_tuning.py chose one")
        return cfg

    def forward_silu_mul(self, gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """self(silu_and_mul(gate_up)) for gate_up [T, 2 * in_features] (the Triton SiLU-and-mul:
        the fused path's numerics either way)."""
        cfg = self._config(self.skinny_silu, gate_up)
        if cfg is None:
            return self(silu_and_mul(gate_up, pdl=pdl), pdl=pdl)
        return skinny_gemm(gate_up, self.weight, self.bias, silu_mul=True, config=cfg, pdl=pdl)

    def extra_repr(self) -> str:
        chosen = ", ".join(f"{b} rows: {c}" for b, c in sorted(self.skinny.items()))
        return super().extra_repr() + (f", skinny=[{chosen}]" if chosen else "")
