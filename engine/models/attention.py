"""Paged attention as the model sees it: the per-step metadata and a layer over one KV cache.

The runner builds one `AttentionMetadata` per step and passes it down through `forward`; the
kernels doing the work come from an `AttentionBackend` chosen when the model is built, so GPU
kernels plug in beside the PyTorch reference without the layers changing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from kernels.attention_ref import paged_attention_ref, write_kv_ref
from kernels.attention_torch import decode_attention_torch, paged_attention_torch
from kernels.cascade_torch import cascade_attention_torch
from kernels.side_stream import side_stream


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged KV cache (B sequences, T new tokens)."""

    # [T] int64, block_id * block_size + offset; < 0 for padding rows. None only for a step
    # replayed by engine/piecewise_graphs.py, whose pieces write KV through a buffer of their own.
    slot_mapping: torch.Tensor | None
    block_table: torch.Tensor  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32, sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    max_seqlen_q: int
    max_seqlen_k: int
    num_kv_splits: int | None = None  # decode split-KV count, fixed for a CUDA graph
    kv_merge_in_kernel: bool = False  # the splits merge in the attention kernel (no second launch)
    # The first num_decodes sequences have one query row each. In a mixed step (prompt chunks
    # too) the GPU kernel runs them apart: a prompt chunk's tiles are 32 positions tall, and a
    # decode row in one would waste most of it (measured on the H200: 282 us a layer for 256
    # decode rows beside 430 prompt tokens, 2.3x the decode-only step's attention).
    num_decodes: int = 0
    # The prompt-chunk sequences' own block_table / cu_seqlens_q / seq_lens (rows num_decodes
    # and on; cu_seqlens_q with absolute row indices), made by the runner: slices of the
    # tensors above would start at unaligned addresses, and Triton compiles a kernel variant
    # per pointer alignment (a compile in the middle of serving).
    chunk_block_table: torch.Tensor | None = None
    chunk_cu_seqlens_q: torch.Tensor | None = None
    chunk_seq_lens: torch.Tensor | None = None
    # Shared-prefix groups (engine/cascade_plan.py); None: plain paged attention. A group's members
    # are consecutive sequences sharing their first prefix_lens blocks (kernels/cascade_attention.py).
    prefix_lens: torch.Tensor | None = None    # [B] int32, whole blocks; 0: no shared prefix
    cu_group_seqs: torch.Tensor | None = None  # [max_groups + 1] int32
    max_group_rows: int = 1                    # host ints, fixed for a CUDA graph
    max_prefix_len: int = 0
    num_prefix_splits: int = 1
    # A cascade step of one-row sequences beside prompt chunks: [n] int32 each, the sequences of
    # each kind, whose own pass runs apart in its own tiles (kernels/cascade_attention.py).
    own_decode_seqs: torch.Tensor | None = None
    own_prompt_seqs: torch.Tensor | None = None
    # False: no sequence in own_prompt_seqs has a prefix (their launch skips the partials' fold).
    prompt_prefixes: bool = True
    # The step's Triton kernels (norms, projections, rotary, attention) are launched with
    # programmatic dependent launch (kernels/pdl.py): decode graphs of up to 16 rows with
    # EngineConfig.decode_pdl, on a GPU that has it.
    launch_pdl: bool = False

    @property
    def is_cascade(self) -> bool:
        return self.cu_group_seqs is not None


@dataclass(frozen=True)
class AttentionBackend:
    """The two kernels a paged attention layer runs."""

    name: str
    write_kv: Callable[..., None]  # (key, value, k_cache, v_cache, slot_mapping)
    # (q, k_cache, v_cache, attn: AttentionMetadata, scale, sliding_window) -> out [T, Hq, D];
    # the GPU backend also takes out= (a buffer to write into: engine/piecewise_graphs.py)
    paged_attention: Callable[..., torch.Tensor]
    # (q, k, v, k_cache, v_cache, slot_mapping, positions, cos_cache, sin_cache): rotates q and k
    # in place and writes k and v, one kernel for RoPE and write_kv; None: the layer rotates and
    # then calls write_kv.
    rotary_write_kv: Callable[..., None] | None = None


def _with_metadata(fn):
    """Adapts a kernels/attention_ref.py-style function to the backend signature."""
    def run(q, k_cache, v_cache, attn: AttentionMetadata, scale, sliding_window):
        return fn(q, k_cache, v_cache, attn.block_table, attn.cu_seqlens_q, attn.seq_lens,
                  scale, sliding_window)
    return run


def _torch_attention(q, k_cache, v_cache, attn: AttentionMetadata, scale, sliding_window):
    if attn.is_cascade:
        assert sliding_window is None, "cascade attention has no sliding window"
        return cascade_attention_torch(q, k_cache, v_cache, attn.block_table, attn.cu_seqlens_q,
                                       attn.seq_lens, attn.prefix_lens, attn.cu_group_seqs, scale)
    if attn.max_seqlen_q == 1:            # a decode-only step: no per-layer sorting of rows
        return decode_attention_torch(q, k_cache, v_cache, attn.block_table, attn.seq_lens,
                                      scale, sliding_window, attn.max_seqlen_k)
    return paged_attention_torch(q, k_cache, v_cache, attn.block_table, attn.cu_seqlens_q,
                                 attn.seq_lens, scale, sliding_window)


TORCH_REF_BACKEND = AttentionBackend("torch_ref", write_kv_ref, _with_metadata(paged_attention_ref))
# The engine's CPU default: decode rows batched in one matmul, same results as the reference.
TORCH_BACKEND = AttentionBackend("torch", write_kv_ref, _torch_attention)


# Cascade steps without own lists run the prefix pass beside the own pass (two streams, a merge
# kernel; the same bits): kernels/cascade_attention.py, benchmarks/h200/cascade_side_by_side.md.
CASCADE_SIDE_BY_SIDE = True


# A mixed step's prompt chunks on a side stream beside its decode rows (_mixed_paged_attention;
# benchmarks/h200/wide_rows_and_prompt_backends.md section 2: 10-28 us a layer less at 64-256
# decode rows).
MIXED_SIDE_BY_SIDE = True


def triton_backend() -> AttentionBackend:
    """The GPU kernels (imported on demand; CUDA-graph safe)."""
    from kernels.cascade_attention import cascade_attention
    from kernels.kv_cache import write_kv
    from kernels.paged_attention import paged_attention
    from kernels.rotary_write_kv import rotary_write_kv

    def run(q, k_cache, v_cache, attn: AttentionMetadata, scale, sliding_window, out=None):
        if attn.is_cascade:
            assert sliding_window is None, "cascade attention has no sliding window"
            return cascade_attention(
                q, k_cache, v_cache, attn.block_table, attn.cu_seqlens_q, attn.seq_lens,
                attn.prefix_lens, attn.cu_group_seqs, scale, max_seqlen_q=attn.max_seqlen_q,
                max_group_rows=attn.max_group_rows, max_prefix_len=attn.max_prefix_len,
                num_prefix_splits=attn.num_prefix_splits, own_decode_seqs=attn.own_decode_seqs,
                own_prompt_seqs=attn.own_prompt_seqs, prompt_prefixes=attn.prompt_prefixes,
                side_by_side=CASCADE_SIDE_BY_SIDE, out=out)
        nd = attn.num_decodes
        if attn.max_seqlen_q > 1 and 0 < nd < attn.seq_lens.shape[0]:
            return _mixed_paged_attention(paged_attention, q, k_cache, v_cache, attn, scale,
                                          sliding_window, out)
        return paged_attention(q, k_cache, v_cache, attn.block_table, attn.cu_seqlens_q,
                               attn.seq_lens, scale, sliding_window,
                               max_seqlen_q=attn.max_seqlen_q, max_seqlen_k=attn.max_seqlen_k,
                               num_kv_splits=attn.num_kv_splits,
                               merge_in_kernel=attn.kv_merge_in_kernel, out=out,
                               pdl=attn.launch_pdl)
    return AttentionBackend("triton", write_kv, run, rotary_write_kv)


def _mixed_paged_attention(paged_attention, q, k_cache, v_cache, attn: AttentionMetadata, scale,
                           sliding_window, out=None) -> torch.Tensor:
    """A step of decode rows (the first num_decodes sequences, rows 0..num_decodes-1) and prompt
    chunks: two calls, each tiled for its kind, into one output. The second call's cu_seqlens_q
    keeps absolute row indices, so it reads its rows of q in place and zeroes the padding rows
    after the last chunk. On a GPU the chunks' call runs on a side stream beside the decode rows'
    (MIXED_SIDE_BY_SIDE). The decode rows take one KV split (as the whole mixed step did): a
    split count is a kernel variant, and one the start-up did not compile would compile in the
    middle of serving."""
    nd = attn.num_decodes
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if attn.chunk_block_table is not None:
        table, cu, seq_lens = attn.chunk_block_table, attn.chunk_cu_seqlens_q, attn.chunk_seq_lens
    else:
        table, cu, seq_lens = attn.block_table[nd:], attn.cu_seqlens_q[nd:], attn.seq_lens[nd:]
    # The chunks first, on the side stream where there is one, then the decode rows beside them
    # (they write disjoint rows of out): the chunks' few long programs no longer run after the
    # decode rows' many short ones.
    with side_stream(q.device, enabled=MIXED_SIDE_BY_SIDE) as on_side:
        with on_side:
            paged_attention(q, k_cache, v_cache, table, cu, seq_lens, scale, sliding_window,
                            max_seqlen_q=attn.max_seqlen_q, max_seqlen_k=attn.max_seqlen_k, out=out)
        paged_attention(q[:nd], k_cache, v_cache, attn.block_table[:nd], attn.cu_seqlens_q[:nd + 1],
                        attn.seq_lens[:nd], scale, sliding_window, max_seqlen_q=1,
                        max_seqlen_k=attn.max_seqlen_k, num_kv_splits=1, out=out[:nd])
    return out


class Attention(nn.Module):
    """Store the new tokens' K/V in this layer's cache, then attend over the whole context."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        backend: AttentionBackend = TORCH_REF_BACKEND,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.backend = backend

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D], after rotary (unless rope_tables)
        k: torch.Tensor,  # [T, Hkv, D], after rotary (unless rope_tables)
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, Hkv, D]
        attn: AttentionMetadata,
        rope_tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        qkv_parts=None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """rope_tables: (positions [T], cos_cache, sin_cache [max_positions, D/2] fp32): q and k
        come unrotated and the backend's rotary_write_kv rotates them (in place) as it writes
        the KV cache. qkv_parts (with rope_tables): the qkv projection's unmerged output
        (engine/models/linear.py, SplitSums), which rotary_write_kv merges into q, k and v."""
        k_cache, v_cache = kv_cache
        if rope_tables is None:
            assert qkv_parts is None, "only rotary_write_kv merges a projection's partials"
            self.backend.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        else:
            merge = {} if qkv_parts is None else {"qkv_parts": qkv_parts.parts, "qkv_bias": qkv_parts.bias}
            self.backend.rotary_write_kv(q, k, v, k_cache, v_cache, attn.slot_mapping, *rope_tables,
                                         pdl=attn.launch_pdl, **merge)
        return self.backend.paged_attention(q, k_cache, v_cache, attn, self.scale,
                                            self.sliding_window)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}, backend={self.backend.name}"
        )
