"""Paged KV-cache write and paged attention in plain PyTorch.

This is the reference every GPU attention kernel is held to, and the CPU path of the engine.
It loops over sequences through the block table, so it knows nothing of any kernel's tiling.

Layouts (T = number of new tokens in the batch, B = number of sequences):
  q                [T, Hq, D]     new tokens of the B sequences packed back to back
  key, value       [T, Hkv, D]
  k_cache, v_cache [num_blocks, block_size, Hkv, D]
  slot_mapping     [T]            slot = block_id * block_size + offset_in_block; < 0: skip row
  block_table      [B, max_blocks] int32, block ids of each sequence in position order
  cu_seqlens_q     [B + 1]        sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b + 1]
  seq_lens         [B]            context length of b including its new tokens

The caches hold q's dtype, or FP8 (torch.float8_e4m3fn, EngineConfig.kv_cache_dtype="fp8"): a
value is stored as `to_cache_dtype` rounds it (clamped to e4m3's largest finite, +-448, then
rounded to nearest even; no scale, as vLLM's fp8 cache without calibrated scales) and read back
exactly, widened to fp32 for the math.
"""
from __future__ import annotations

import torch

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
E4M3_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: a plain cast, or for FP8 a cast of x clamped to +-448."""
    if dtype in FP8_KV_DTYPES:
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(dtype)
    return x.to(dtype)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K/V in its cache slot, in place.

    k_cache[s // block_size, s % block_size] = key[t]  for every row t with s = slot_mapping[t] >= 0
    (likewise for values). Rows with a negative slot (batch padding) are not written.
    """
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"caches must be [num_blocks, block_size, {key.shape[1]}, {key.shape[2]}], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}")
    block_size = k_cache.shape[1]
    rows = (slot_mapping >= 0).nonzero().squeeze(1)
    slots = slot_mapping[rows].long()
    block_ids, offsets = slots // block_size, slots % block_size
    k_cache[block_ids, offsets] = to_cache_dtype(key[rows], k_cache.dtype)
    v_cache[block_ids, offsets] = to_cache_dtype(value[rows], v_cache.dtype)


def _shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """(T, Hq, D, block_size, Hkv) of q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D]."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D], "
            f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has {num_heads} heads of dim {head_dim}; the cache has {num_kv_heads} kv heads of dim "
            f"{cache_head_dim}: the head dims must match and Hq must be a multiple of Hkv"
        )
    return num_tokens, num_heads, head_dim, block_size, num_kv_heads


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of new query rows over their sequence's paged K/V. Returns [T, Hq, D].

    For sequence b with q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b] and L = seq_lens[b], query
    row i sits at position p = L - q_len + i; its K/V (and those of all earlier positions) must
    already be in the cache. Query head h reads kv head h // (Hq // Hkv) (GQA). Then

        out[p, h] = sum_j softmax_j(scale * q[p, h] . k[j, h']) v[j, h']
        over key positions j with j <= p and, given sliding_window W, j > p - W

    (the window counts the query's own position, as in HF's `kv_idx > q_idx - sliding_window`).
    Computed in fp32, returned in q's dtype. Rows past cu_seqlens_q[-1] (padding) come back zero.
    """
    num_tokens, num_heads, head_dim, block_size, num_kv_heads = _shapes(q, k_cache, v_cache)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    cu_q = cu_seqlens_q.tolist()
    kv_lens = seq_lens.tolist()
    if len(cu_q) != len(kv_lens) + 1 or cu_q[-1] > num_tokens:
        raise ValueError(
            f"cu_seqlens_q ({len(cu_q)} entries, last {cu_q[-1]}) must have len(seq_lens) + 1 = "
            f"{len(kv_lens) + 1} entries and end at or before T = {num_tokens}"
        )

    for b, kv_len in enumerate(kv_lens):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if not 0 < q_len <= kv_len:
            raise ValueError(f"sequence {b}: q_len {q_len} must be in 1..seq_len ({kv_len})")
        first_q_pos = kv_len - q_len
        # Keys before the first query's window are never read: skip whole blocks of them.
        first_k_pos = 0 if sliding_window is None else max(0, first_q_pos - sliding_window + 1)
        first_block = first_k_pos // block_size
        last_block = (kv_len + block_size - 1) // block_size
        blocks = block_table[b, first_block:last_block].long()
        k_start = first_block * block_size
        k_len = kv_len - k_start
        # k, v: [Hkv, k_len, D] for key positions k_start..kv_len-1
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:k_len].transpose(0, 1).float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:k_len].transpose(0, 1).float()
        # qb: [Hkv, group * q_len, D], query head h = kv_head * group + g
        qb = q[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        qb = qb.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        scores = torch.bmm(qb, k.transpose(1, 2)) * scale  # [Hkv, group * q_len, k_len]

        q_pos = torch.arange(first_q_pos, kv_len, device=q.device)
        k_pos = torch.arange(k_start, kv_len, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, k_len]
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.view(num_kv_heads, group, q_len, k_len).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, k_len)
        o = torch.bmm(probs, v)  # [Hkv, group * q_len, D]
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[q_start:q_end] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out


def cascade_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_group_seqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a batch whose sequences share prefixes in groups. Returns [T, Hq, D].

    Extra inputs beside `paged_attention_ref`'s:
      prefix_lens    [B] int   tokens of b's shared prefix (0: none), a multiple of block_size
      cu_group_seqs  [G + 1]   group g = sequences cu_group_seqs[g]:cu_group_seqs[g + 1]
                               (non-decreasing from 0; trailing empty groups allowed); sequences
                               past cu_group_seqs[-1] belong to no group
    Contract, checked here (ValueError): the members of a group have one prefix_len P and the
    same first P / block_size block ids; P <= the position of b's first query row (the prefix
    precedes every query of the group); a sequence in no group has P = 0.

    The grouping changes how keys are read, not the math. For sequence b (q_len rows, L =
    seq_lens[b], P = prefix_lens[b]) its keys are [prefix + own]: positions 0..P-1 from block
    table entries 0..P/bs-1, positions P..L-1 from the entries after them. Query row i sits at
    p = L - q_len + i and

        out[p, h] = sum_j softmax_j(scale * q[p, h] . k[j, h // G]) v[j, h // G]   over j <= p

    one plain softmax over all of its visible keys (every prefix key is visible). Computed in
    float64 on CPU and float32 elsewhere, returned in q's dtype; rows past cu_seqlens_q[-1] are 0.
    """
    num_tokens, num_heads, head_dim, block_size, num_kv_heads = _shapes(q, k_cache, v_cache)
    group = num_heads // num_kv_heads
    math_dtype = torch.float64 if q.device.type == "cpu" else torch.float32
    cu_q, kv_lens, prefixes = cu_seqlens_q.tolist(), seq_lens.tolist(), prefix_lens.tolist()
    cu_groups = cu_group_seqs.tolist()
    num_seqs = len(kv_lens)
    if len(cu_q) != num_seqs + 1 or cu_q[-1] > num_tokens or len(prefixes) != num_seqs:
        raise ValueError(
            f"with {num_seqs} sequences, cu_seqlens_q must have {num_seqs + 1} entries ending at or "
            f"before T = {num_tokens} and prefix_lens {num_seqs}; got {len(cu_q)} and {len(prefixes)}"
        )
    if not cu_groups or cu_groups[0] != 0 or cu_groups[-1] > num_seqs or any(
            a > b for a, b in zip(cu_groups, cu_groups[1:])):
        raise ValueError(f"cu_group_seqs must rise from 0 to at most {num_seqs}, got {cu_groups}")

    # The group contract: what lets a kernel read a group's prefix once for all its members.
    group_of = [None] * num_seqs
    for g in range(len(cu_groups) - 1):
        for b in range(cu_groups[g], cu_groups[g + 1]):
            group_of[b] = g
    for b in range(num_seqs):
        prefix_len, first_q_pos = prefixes[b], kv_lens[b] - (cu_q[b + 1] - cu_q[b])
        if prefix_len < 0 or prefix_len % block_size or prefix_len > first_q_pos:
            raise ValueError(
                f"sequence {b}: prefix_len {prefix_len} must be a multiple of block_size {block_size} "
                f"in 0..{first_q_pos} (its first query position)")
        if group_of[b] is None:
            if prefix_len:
                raise ValueError(f"sequence {b} is in no group but has prefix_len {prefix_len}")
            continue
        first = cu_groups[group_of[b]]
        n = prefix_len // block_size
        if prefix_len != prefixes[first] or not torch.equal(block_table[b, :n], block_table[first, :n]):
            raise ValueError(f"sequence {b} does not share group {group_of[b]}'s prefix "
                             f"(length {prefixes[first]}, blocks of sequence {first})")

    out = torch.zeros_like(q)
    for b, kv_len in enumerate(kv_lens):
        q_start, q_end = cu_q[b], cu_q[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        if q_len > kv_len:
            raise ValueError(f"sequence {b}: q_len {q_len} must be in 1..seq_len ({kv_len})")
        # keys: [prefix + own], each gathered from b's own block table entries.
        num_prefix_blocks = prefixes[b] // block_size
        parts_k, parts_v = [], []
        for first_block, num_keys in ((0, prefixes[b]), (num_prefix_blocks, kv_len - prefixes[b])):
            blocks = block_table[b, first_block:first_block + -(-num_keys // block_size)].long()
            parts_k.append(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:num_keys])
            parts_v.append(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:num_keys])
        k = torch.cat(parts_k).to(math_dtype)  # [kv_len, Hkv, D]
        v = torch.cat(parts_v).to(math_dtype)
        for h in range(num_heads):
            qh = q[q_start:q_end, h].to(math_dtype)            # [q_len, D]
            scores = qh @ k[:, h // group].T * scale           # [q_len, kv_len]
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
            out[q_start:q_end, h] = (torch.softmax(scores, dim=-1) @ v[:, h // group]).to(q.dtype)
    return out
