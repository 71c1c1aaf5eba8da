"""Cascade attention in PyTorch: the engine's CPU path when a step has shared-prefix groups.

Same contract and layouts as `attention_ref.cascade_attention_ref` and the Triton kernel
(kernels/cascade_attention.py), and computed the way the kernel does it, so that the engine's
grouping (row order, prefix_lens, cu_group_seqs, the first member's block table standing for the
group) is exercised on CPU: each group's prefix keys are read once, through the group's first
member, for all its query rows; each sequence's own keys [prefix_len, seq_len) alone, causally;
the two softmax parts merged by their maxima and sums. Decode rows' own parts go as one batch.
fp32 math, q's dtype out; rows past cu_seqlens_q[-1] are zero.
"""
from __future__ import annotations

import torch


def _partials(q, k, v, scale, visible=None):
    """q [..., G, D] against k, v [..., K, D] (kv heads leading, shared by the G query heads):
    the softmax's (max, sum, unnormalized output) over the visible keys. A row that sees no key
    gets m = -inf, l = 0, acc = 0."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale                     # [..., G, K]
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1)
    p = torch.exp(s - torch.where(m == float("-inf"), 0.0, m)[..., None])
    return m, p.sum(-1), torch.matmul(p, v)


def _gather(cache, blocks, num_keys):
    """Keys of a block list: [num_keys, Hkv, D]."""
    return cache[blocks].reshape(-1, *cache.shape[2:])[:num_keys]


def cascade_attention_torch(
    q: torch.Tensor,               # [T, Hq, D]
    k_cache: torch.Tensor,         # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,     # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,    # [B + 1] int32
    seq_lens: torch.Tensor,        # [B] int32
    prefix_lens: torch.Tensor,     # [B] int32, multiples of block_size
    cu_group_seqs: torch.Tensor,   # [max_groups + 1] int32
    scale: float,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    prefixes, cu_groups = prefix_lens.tolist(), cu_group_seqs.tolist()
    dev = q.device                  # the engine runs this on CPU; its tests run it anywhere
    qf = q.float().view(num_tokens, num_kv_heads, group, head_dim)          # [T, Hkv, G, D]
    m = torch.full((num_tokens, num_kv_heads, group), float("-inf"), device=dev)
    l = torch.zeros(num_tokens, num_kv_heads, group, device=dev)            # noqa: E741
    acc = torch.zeros(num_tokens, num_kv_heads, group, head_dim, device=dev)

    # Own keys. Decode rows (one query, at seq_len - 1, sees all of [P, L)) in one batch.
    decode = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if decode:
        rows = torch.tensor([cu[b] for b in decode], device=dev)
        first = torch.tensor([prefixes[b] // block_size for b in decode], device=dev)
        num_own = torch.tensor([lens[b] - prefixes[b] for b in decode], device=dev)
        count = torch.tensor([-(-lens[b] // block_size) - prefixes[b] // block_size
                              for b in decode], device=dev)
        width = int(count.max())
        steps = torch.arange(width, device=dev)
        # Entries past a sequence's own blocks are not read as block ids: repeat its first one.
        idx = first[:, None] + steps[None]
        idx = torch.where(steps[None] < count[:, None], idx, first[:, None])
        blocks = block_table[torch.tensor(decode, device=dev)[:, None], idx].long()  # [N, width]
        shape = (len(decode), width * block_size, num_kv_heads, head_dim)
        k = k_cache[blocks].reshape(shape).float().transpose(1, 2)          # [N, Hkv, K, D]
        v = v_cache[blocks].reshape(shape).float().transpose(1, 2)
        visible = (torch.arange(width * block_size, device=dev)[None]
                   < num_own[:, None])[:, None, None, :]
        m[rows], l[rows], acc[rows] = _partials(qf[rows], k, v, scale, visible)
    for b in range(len(lens)):
        q_len = cu[b + 1] - cu[b]
        if q_len <= 1:
            continue
        p, n = prefixes[b], lens[b]
        blocks = block_table[b, p // block_size:-(-n // block_size)].long()
        k = _gather(k_cache, blocks, n - p).float().permute(1, 0, 2)[None]     # [1, Hkv, K, D]
        v = _gather(v_cache, blocks, n - p).float().permute(1, 0, 2)[None]
        q_pos = torch.arange(n - q_len, n, device=dev)
        visible = (torch.arange(p, n, device=dev)[None, :] <= q_pos[:, None])[:, None, None, :]
        r0, r1 = cu[b], cu[b + 1]
        m[r0:r1], l[r0:r1], acc[r0:r1] = _partials(qf[r0:r1], k, v, scale, visible)

    # Each group's prefix, read once (through its first member's table) for all its rows.
    for g in range(len(cu_groups) - 1):
        lo, hi = cu_groups[g], cu_groups[g + 1]
        if hi <= lo or prefixes[lo] == 0 or cu[hi] <= cu[lo]:
            continue
        p, r0, r1 = prefixes[lo], cu[lo], cu[hi]
        blocks = block_table[lo, :p // block_size].long()
        k = _gather(k_cache, blocks, p).float().permute(1, 0, 2)             # [Hkv, P, D]
        v = _gather(v_cache, blocks, p).float().permute(1, 0, 2)
        # [Hkv, R * G, D] against the prefix, then back to [R, Hkv, G].
        rows = qf[r0:r1].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        m_p, l_p, acc_p = _partials(rows, k, v, scale)
        m_p = m_p.view(num_kv_heads, r1 - r0, group).permute(1, 0, 2)
        l_p = l_p.view(num_kv_heads, r1 - r0, group).permute(1, 0, 2)
        acc_p = acc_p.view(num_kv_heads, r1 - r0, group, head_dim).permute(1, 0, 2, 3)
        m_new = torch.maximum(m[r0:r1], m_p)
        alpha, beta = torch.exp(m[r0:r1] - m_new), torch.exp(m_p - m_new)
        acc[r0:r1] = acc[r0:r1] * alpha[..., None] + acc_p * beta[..., None]
        l[r0:r1] = l[r0:r1] * alpha + l_p * beta
        m[r0:r1] = m_new

    out = acc / torch.where(l == 0, 1.0, l)[..., None]
    out[cu[-1]:] = 0
    return out.view(num_tokens, num_heads, head_dim).to(q.dtype)
