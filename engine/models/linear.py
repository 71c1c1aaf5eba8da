"""The model's projections: nn.Linear, save that decode-sized inputs (up to 16 rows) may run the
Triton skinny GEMM (kernels/skinny_gemm.py) instead of cuBLAS, where it was measured faster.

`skinny` maps a row bucket (the row count rounded up to a power of two, at most
kernels.skinny_gemm.MAX_ROWS) to the SkinnyConfig to run; inputs of any other row count use
F.linear. It starts empty (CPU, tests, EngineConfig.skinny_gemm = "off"): the start-up timing in
engine/gemm_tuning.py fills it. `skinny_silu` is the same for `forward_silu_mul` (down_proj with
SiLU-and-mul folded into the kernel's prologue).

`skinny_chain` holds a skinny config per bucket whether or not it beat cuBLAS (chosen by
engine/gemm_tuning.py's `pick_chain`: timed as the chain runs it, the fewest K slices among the
near-fastest). A call with pdl=True (a decode graph's chain of kernels launched with
programmatic dependent launch, kernels/pdl.py) runs it, because a cuBLAS kernel takes no part
in PDL: it starts only when the kernel ahead has finished, and so does the kernel after it.

unmerged=True (LlamaForCausalLM.late_merge: qkv_proj, whose output goes to the rotary + KV
write kernel, o_proj and down_proj, whose output goes to an RMSNorm with the residual add):
where the skinny GEMM runs, its K slices' partials are not merged in the kernel (the last
program's store, atomic and reload: 2-6 us a call on an H100, benchmarks/h100/
decode_experiments.md) but handed on as `SplitSums`, which the next kernel adds up as it reads
them: the same bits.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kernels.activation import silu_and_mul
from kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_gemm

ROW_BUCKETS = tuple(1 << i for i in range(MAX_ROWS.bit_length()) if 1 << i <= MAX_ROWS)   # 1, 2, 4, 8, 16


def row_bucket(num_rows: int) -> int:
    """The bucket whose choice covers num_rows rows: the next power of two; 0 past MAX_ROWS."""
    return next((b for b in ROW_BUCKETS if b >= num_rows), 0)


class SplitSums(NamedTuple):
    """A projection's output left unmerged: its skinny GEMM's K-slice partials [S, T, N] fp32 and
    its bias. `merged` is the output (kernels/rmsnorm.py reads the partials itself)."""
    parts: torch.Tensor
    bias: torch.Tensor | None

    def merged(self, dtype: torch.dtype) -> torch.Tensor:
        acc = torch.zeros(self.parts.shape[1:], dtype=torch.float32, device=self.parts.device)
        for part in self.parts:         # slice order, as the kernel's own merge
            acc += part
        return (acc if self.bias is None else acc + self.bias.float()).to(dtype)


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias, **kwargs)
        self.skinny: dict[int, SkinnyConfig] = {}
        self.skinny_silu: dict[int, SkinnyConfig] = {}
        self.skinny_chain: dict[int, SkinnyConfig] = {}

    def _config(self, table: dict[int, SkinnyConfig], x: torch.Tensor) -> SkinnyConfig | None:
        if not table or x.dim() != 2 or x.stride(-1) != 1:
            return None
        return table.get(row_bucket(x.shape[0]))

    def forward(self, x: torch.Tensor, pdl: bool = False, unmerged: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor | SplitSums:
        """pdl: the call is in a chain launched with programmatic dependent launch. unmerged:
        where the skinny GEMM runs, return its partials as SplitSums (module docstring). out: a
        [T, out_features] buffer of x's dtype to write the output into (and return), with no
        copy: the lm_head's logits in a decode graph."""
        cfg = self._config(self.skinny_chain if pdl else self.skinny, x)
        if cfg is None:
            if out is None:
                return F.linear(x, self.weight, self.bias)
            if self.bias is None:
                return torch.matmul(x, self.weight.t(), out=out)
            return torch.addmm(self.bias, x, self.weight.t(), out=out)
        if unmerged:
            return SplitSums(skinny_gemm(x, self.weight, config=cfg, pdl=pdl, merge=False), self.bias)
        return skinny_gemm(x, self.weight, self.bias, config=cfg, pdl=pdl, out=out)

    def forward_silu_mul(self, gate_up: torch.Tensor, pdl: bool = False,
                         unmerged: bool = False) -> torch.Tensor | SplitSums:
        """self(silu_and_mul(gate_up)) for gate_up [T, 2 * in_features] (the Triton SiLU-and-mul:
        the fused path's numerics either way)."""
        cfg = self._config(self.skinny_silu, gate_up)
        if cfg is None:
            return self(silu_and_mul(gate_up, pdl=pdl), pdl=pdl, unmerged=unmerged)
        if unmerged:
            return SplitSums(skinny_gemm(gate_up, self.weight, silu_mul=True, config=cfg, pdl=pdl, merge=False),
                             self.bias)
        return skinny_gemm(gate_up, self.weight, self.bias, silu_mul=True, config=cfg, pdl=pdl)

    def extra_repr(self) -> str:
        chosen = ", ".join(f"{b} rows: {c}" for b, c in sorted(self.skinny.items()))
        return super().extra_repr() + (f", skinny=[{chosen}]" if chosen else "")
