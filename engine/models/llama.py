"""Llama, Mistral and Qwen2 causal LMs over a paged KV cache (one implementation, config flags).

Our layout differs from HF's by fusing q/k/v into `qkv_proj` (rows q, then k, then v) and
gate/up into `gate_up_proj` (rows gate, then up); the loader maps HF checkpoints onto it. The
numerics follow HF's modeling code step by step so float32 logits agree to rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import TORCH_REF_BACKEND, Attention, AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.linear import Linear, SplitSums
from kernels.rmsnorm import rms_norm
from kernels.rotary import build_cos_sin_cache, rotary_embedding


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalized in fp32 and cast back to x's dtype
    *before* the weight multiply, as HF does (it matters in bf16/fp16).

    With `residual`, first x = x + residual (in x's dtype, HF's residual add) and return
    (norm(x), x): the add and the norm are one kernel on the fused path."""

    def __init__(self, hidden_size: int, eps: float, fused: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor | SplitSums, residual: torch.Tensor | None = None, pdl: bool = False):
        """x may be a projection's unmerged output (SplitSums, with a residual): the kernel
        merges it as it reads it."""
        if isinstance(x, SplitSums):
            if self.fused:
                return rms_norm(None, self.weight, self.eps, residual, pdl=pdl, x_parts=x.parts, x_bias=x.bias)
            x = x.merged(residual.dtype)
        if self.fused:
            return rms_norm(x, self.weight, self.eps, residual, pdl=pdl)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict | None, device: torch.device | None = None
) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim // 2] in fp32: theta^(-2i/D), then rescaled.

    linear: divide by `factor` (same as dividing positions). llama3: wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter
    than original_max_position_embeddings / high_freq_factor are kept, and the ones in between
    are interpolated linearly in original_max_position_embeddings / wavelength.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    rope_type = rope_scaling["rope_type"] if rope_scaling else "default"
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        factor = rope_scaling["factor"]
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        original_len = rope_scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        long_wave = wavelen > original_len / low_freq_factor
        short_wave = wavelen < original_len / high_freq_factor
        scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        interpolated = (1 - smooth) * scaled / factor + smooth * scaled
        inv_freq = torch.where(~long_wave & ~short_wave, interpolated, scaled)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope type {rope_type!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin [T, D] of positions, in HF's non-interleaved layout (frequencies repeated twice)."""

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None):
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, rope_theta, rope_scaling), persistent=False)

    def _apply(self, fn, recurse=True):
        # `.to(dtype)` / `.to_empty()` would round or blank the fp32 frequencies: recompute them.
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.inv_freq = compute_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling, self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2], fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def cos_sin_cache(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 tables [max_positions, D/2] for the fused kernel, built once (before any CUDA
        graph capture, by the first forward) and kept out of the module's buffers so a dtype
        cast never rounds them."""
        cache = getattr(self, "_cos_sin", None)
        if cache is None or cache[0].device != self.inv_freq.device:
            cache = build_cos_sin_cache(self.inv_freq, max_positions)
            self._cos_sin = cache
        return cache


class Rope:
    """This step's rotary embedding, applied to each layer's q and k.

    with_kv_write: the layers hand the tables to attention's backend, whose fused kernel rotates
    q and k as it writes the KV cache (if the backend has one)."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype,
                 fused: bool, max_positions: int, with_kv_write: bool = False):
        self.fused = fused
        self.with_kv_write = fused and with_kv_write
        self.positions = positions
        if fused:
            self.cos, self.sin = rotary.cos_sin_cache(max_positions)  # [max_pos, D/2] fp32
        else:
            self.cos, self.sin = rotary(positions, dtype)  # [T, D]

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] (views into the qkv output on the fused path, rotated in
        place there)."""
        if self.fused:
            rotary_embedding(q, k, self.positions, self.cos, self.sin)
            return q, k
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, cos_cache, sin_cache) for a fused kernel (fused path only)."""
        assert self.fused
        return self.positions, self.cos, self.sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=self.head_dim**-0.5,
            sliding_window=config.layer_sliding_window(layer_idx), backend=backend,
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        unmerged: bool = False,
    ) -> torch.Tensor | SplitSums:
        """unmerged: o_proj's output may come back as SplitSums, and qkv_proj's partials are
        merged by the rotary + KV-write kernel where that runs (engine/models/linear.py)."""
        num_tokens = x.shape[0]
        kv_write = rope.with_kv_write and self.attn.backend.rotary_write_kv is not None
        qkv = self.qkv_proj(x, pdl=attn.launch_pdl, unmerged=unmerged and kv_write)  # [T, (Hq + 2Hkv) * D]
        qkv_parts = None
        if isinstance(qkv, SplitSums):      # rotary_write_kv merges it into this buffer
            qkv_parts, qkv = qkv, torch.empty(num_tokens, qkv.parts.shape[2], dtype=x.dtype, device=x.device)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if kv_write:    # rotated as K/V are written
            out = self.attn(q, k, v, kv_cache, attn, rope.tables(), qkv_parts=qkv_parts)
        else:
            q, k = rope.apply(q, k)
            out = self.attn(q, k, v, kv_cache, attn)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size), pdl=attn.launch_pdl, unmerged=unmerged)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, fused: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.fused = fused

    def forward(self, x: torch.Tensor, pdl: bool = False, unmerged: bool = False) -> torch.Tensor | SplitSums:
        """unmerged: down_proj's output may come back as SplitSums (engine/models/linear.py)."""
        gate_up = self.gate_up_proj(x, pdl=pdl)  # [T, 2I]
        if self.fused:  # SiLU-and-mul, maybe inside down_proj's kernel (engine/models/linear.py)
            return self.down_proj.forward_silu_mul(gate_up, pdl=pdl, unmerged=unmerged)
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [T, I]
        return self.down_proj(F.silu(gate) * up, unmerged=unmerged)


class LlamaDecoderLayer(nn.Module):
    """HF's x = x + attn(norm(x)); x = x + mlp(norm(x)), carried as (hidden, residual) so that
    each residual add is fused with the norm that follows it."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend,
                 fused: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = LlamaAttention(config, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = LlamaMLP(config, fused)

    def forward(self, x, residual, rope: Rope, kv_cache, attn: AttentionMetadata, late_merge: bool = False):
        """late_merge: the projections' split-K partials are merged by the kernel after them
        (LlamaForCausalLM.late_merge); the x returned may then be SplitSums."""
        pdl = attn.launch_pdl
        if residual is None:
            residual, x = x, self.input_layernorm(x, pdl=pdl)
        else:
            x, residual = self.input_layernorm(x, residual, pdl=pdl)
        x = self.self_attn(x, rope, kv_cache, attn, unmerged=late_merge)
        x, residual = self.post_attention_layernorm(x, residual, pdl=pdl)
        return self.mlp(x, pdl=pdl, unmerged=late_merge), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM for LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM checkpoints.

    Parameter names are HF's without the leading "model." and with the fused projections above.
    With tied embeddings there is no `lm_head`; the logits use `embed_tokens.weight`.
    """

    def __init__(self, config: ModelConfig, attention_backend: AttentionBackend = TORCH_REF_BACKEND,
                 fused_kernels: bool = False, fuse_rope_kv_write: bool = True):
        """fused_kernels: Triton RMSNorm(+residual), rotary and SiLU-and-mul (CUDA only).
        fuse_rope_kv_write: with fused_kernels and a backend that has the kernel, rotary and the
        KV-cache write are one kernel (kernels/rotary_write_kv.py). A plain attribute, read by
        each forward: change it before CUDA graphs are captured, not after."""
        super().__init__()
        self.config = config
        self.fused = fused_kernels
        self.fuse_rope_kv_write = fuse_rope_kv_write
        # qkv_proj, o_proj and down_proj hand their skinny GEMM's split-K partials to the kernel
        # after them (rotary + KV write, RMSNorm), which merges them as it reads them (the same
        # bits; EngineConfig.decode_late_merge). A plain attribute, as fuse_rope_kv_write.
        self.late_merge = False
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, attention_backend, fused_kernels)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_kernels)
        self.lm_head = None
        if not config.tie_word_embeddings:      # a Linear: decode rows may run the skinny GEMM
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, each [num_blocks, block_size, Hkv, D]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        x = self.embed_tokens(input_ids)  # [T, hidden]
        rope = Rope(self.rotary_emb, positions, x.dtype, self.fused,
                    self.config.max_context_len, self.fuse_rope_kv_write)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, attn, self.late_merge)
        x, _ = self.norm(x, residual, pdl=attn.launch_pdl)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       pdl: bool = False) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32, rounded to the model's dtype first.
        out: a [N, vocab] buffer of the model's dtype or float32 to write them into instead (no
        float32 temporary: at 256 rows and a 128k vocabulary that is 131 MB written and read); in
        the model's dtype the lm_head writes it directly. pdl: the call ends a decode graph's PDL
        chain (the lm_head runs its skinny GEMM in it, engine/models/linear.py)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight)
        elif out is not None and out.dtype == hidden.dtype:
            return self.lm_head(hidden, pdl=pdl, out=out)
        else:
            logits = self.lm_head(hidden, pdl=pdl)
        return logits.float() if out is None else out.copy_(logits)
