"""Paged attention in PyTorch, batched for speed: the engine's CPU path.

Same contract and layouts as `attention_ref.paged_attention_ref` (and held to it by tests).
Decode rows (one new token per sequence) are the bulk of a busy step; they are computed all
at once: gather every decode sequence's blocks into one padded [B, K, Hkv, D] tensor, one
masked matmul, one softmax. Sequences with several new tokens (prompt chunks) go through the
reference, one by one, as there are few of them per step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_ref import paged_attention_ref


def paged_attention_torch(
    q: torch.Tensor,             # [T, Hq, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,   # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,      # [B] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """out[p, h] = sum_j softmax_j(scale * q[p, h] . k[j, h // G]) v[j, h // G] over visible j
    (j <= p, and j > p - W with a sliding window W), computed in fp32. Returns [T, Hq, D]."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    is_decode = q_lens == 1
    num_decode = int(is_decode.sum())
    if num_decode < 2:
        return paged_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
                                   scale, sliding_window)
    out = torch.zeros_like(q)
    decode = is_decode.nonzero().squeeze(1)
    out[cu_seqlens_q[decode].long()] = decode_attention_torch(
        q[cu_seqlens_q[decode].long()], k_cache, v_cache, block_table[decode], seq_lens[decode],
        scale, sliding_window)
    rest = (~is_decode & (q_lens > 0)).nonzero().squeeze(1)
    if rest.numel():
        # The reference on the other sequences alone: repack their rows back to back.
        starts, lens = cu_seqlens_q[rest].long(), q_lens[rest].long()
        rows = torch.cat([torch.arange(s, s + n, device=q.device)
                          for s, n in zip(starts.tolist(), lens.tolist())])
        sub_cu = torch.zeros(len(rest) + 1, dtype=cu_seqlens_q.dtype, device=q.device)
        sub_cu[1:] = torch.cumsum(lens, 0)
        out[rows] = paged_attention_ref(q[rows], k_cache, v_cache, block_table[rest], sub_cu,
                                        seq_lens[rest], scale, sliding_window)
    return out


def decode_attention_torch(q, k_cache, v_cache, block_table, seq_lens, scale,
                           sliding_window=None, max_seqlen_k: int | None = None):
    """One query per sequence, at position seq_len - 1. q: [B, Hq, D] -> [B, Hq, D].
    max_seqlen_k (>= every seq_len) spares a host read of seq_lens.max()."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max()) if max_seqlen_k is None else max_seqlen_k
    num_blocks = -(-max_len // block_size)
    blocks = block_table[:, :num_blocks].reshape(-1).long()          # [B * M]
    num_keys = num_blocks * block_size
    # k, v: [B, Hkv, K, D]. index_select, not k_cache[blocks]: on CPU the general advanced
    # indexing path is 3x slower for this gather, the bulk of a decode step's attention.
    shape = (num_seqs, num_keys, num_kv_heads, head_dim)
    k = k_cache.index_select(0, blocks).view(shape).transpose(1, 2).float()
    v = v_cache.index_select(0, blocks).view(shape).transpose(1, 2).float()
    # The G query heads of a kv head take the place of SDPA's query positions.
    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)     # [B, Hkv, G, D]
    k_pos = torch.arange(num_keys, device=q.device)
    last = (seq_lens.long() - 1)[:, None]                            # query position
    visible = k_pos[None, :] <= last                                 # [B, K]
    if sliding_window is not None:
        visible &= k_pos[None, :] > last - sliding_window
    # One fused kernel instead of matmul, mask, softmax, matmul: a third faster on CPU.
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible[:, None, None, :],
                                         scale=scale)                # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
