"""kernels/attention_ref.py against a dense float64 attention over contiguous K/V."""
import math

import pytest
import torch

from kernels.attention_ref import paged_attention_ref, to_cache_dtype, write_kv_ref

DTYPE_TOLS = [
    (torch.float32, 1e-4, 1.3e-6),
    (torch.float16, 1e-2, 1e-3),
    (torch.bfloat16, 1.5e-2, 1e-2),
]


def dense_attention(q, k, v, scale, sliding_window):
    """One sequence: q [q_len, Hq, D] at the last q_len positions of k, v [L, Hkv, D]; float64."""
    q_len, num_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    k_pos = torch.arange(kv_len)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def build_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, gen):
    """seqs: list of (kv_len, q_len). Scatter every sequence's K/V over random blocks of a pool
    (with spare blocks holding garbage) and return the paged inputs plus contiguous copies."""
    blocks_needed = [math.ceil(kv_len / block_size) for kv_len, _ in seqs]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_needed) + 1
    block_table = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    qs, ks, vs, cu = [], [], [], [0]
    used = 0
    for b, (kv_len, q_len) in enumerate(seqs):
        ids = perm[used: used + blocks_needed[b]]
        used += blocks_needed[b]
        block_table[b, : len(ids)] = ids.to(torch.int32)
        k = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = ids[torch.arange(kv_len) // block_size] * block_size + torch.arange(kv_len) % block_size
        write_kv_ref(k, v, k_cache, v_cache, slots)
        qs.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        ks.append(k)
        vs.append(v)
        cu.append(cu[-1] + q_len)
    seq_lens = torch.tensor([kv_len for kv_len, _ in seqs], dtype=torch.int32)
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32)
    return torch.cat(qs), k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, ks, vs


# (kv_len, q_len): whole prompts, later chunks of a cached prompt, and decode rows mixed.
MIXED = [(37, 37), (50, 1), (23, 9), (1, 1), (64, 16), (17, 1)]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPE_TOLS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 5, 1])
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_paged_attention_matches_dense(dtype, atol, rtol, num_heads, num_kv_heads, block_size, sliding_window):
    gen = torch.Generator().manual_seed(0)
    head_dim = 24
    scale = head_dim**-0.5
    q, k_cache, v_cache, block_table, cu, seq_lens, ks, vs = build_batch(
        MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype, gen
    )
    out = paged_attention_ref(q, k_cache, v_cache, block_table, cu, seq_lens, scale, sliding_window)
    assert out.dtype == dtype and out.shape == q.shape
    for b in range(len(MIXED)):
        rows = slice(cu[b].item(), cu[b + 1].item())
        expected = dense_attention(q[rows], ks[b], vs[b], scale, sliding_window)
        torch.testing.assert_close(out[rows].double(), expected, atol=atol, rtol=rtol)


def test_sliding_window_sees_exactly_w_keys():
    """With W = 3, the query at position p averages v at p-2, p-1, p (equal scores)."""
    kv_len, window = 10, 3
    k_cache = torch.zeros(1, kv_len, 1, 1)
    v_cache = torch.arange(kv_len, dtype=torch.float32).view(1, kv_len, 1, 1)
    q = torch.zeros(kv_len, 1, 1)
    out = paged_attention_ref(
        q, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
        torch.tensor([0, kv_len], dtype=torch.int32), torch.tensor([kv_len], dtype=torch.int32),
        1.0, sliding_window=window,
    )
    expected = torch.tensor([0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    torch.testing.assert_close(out.view(-1), expected)


def test_padding_rows_are_zero():
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, block_table, cu, seq_lens, _, _ = build_batch(
        [(9, 3), (4, 1)], 2, 1, 8, 4, torch.float32, gen
    )
    padded = torch.cat([q, torch.randn(3, 2, 8, generator=gen)])
    out = paged_attention_ref(padded, k_cache, v_cache, block_table, cu, seq_lens, 0.3)
    ref = paged_attention_ref(q, k_cache, v_cache, block_table, cu, seq_lens, 0.3)
    torch.testing.assert_close(out[: len(q)], ref, atol=0, rtol=0)
    assert out[len(q):].abs().max() == 0


def test_write_kv_skips_negative_slots():
    gen = torch.Generator().manual_seed(2)
    num_blocks, block_size, num_kv_heads, head_dim = 4, 5, 2, 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(5, num_kv_heads, head_dim, generator=gen)
    slot_mapping = torch.tensor([7, -1, 19, 0, -1])
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    written = {7: 0, 19: 2, 0: 3}
    for slot in range(num_blocks * block_size):
        block, offset = divmod(slot, block_size)
        if slot in written:
            torch.testing.assert_close(k_cache[block, offset], key[written[slot]], atol=0, rtol=0)
            torch.testing.assert_close(v_cache[block, offset], value[written[slot]], atol=0, rtol=0)
        else:
            torch.testing.assert_close(k_cache[block, offset], k_before[block, offset], atol=0, rtol=0)
            torch.testing.assert_close(v_cache[block, offset], v_before[block, offset], atol=0, rtol=0)


def test_write_kv_casts_to_cache_dtype():
    k_cache = torch.zeros(2, 4, 1, 2, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.full((1, 1, 2), 1.5)
    write_kv_ref(key, -key, k_cache, v_cache, torch.tensor([6]))
    assert k_cache[1, 2].float().tolist() == [[1.5, 1.5]]
    assert v_cache[1, 2].float().tolist() == [[-1.5, -1.5]]


def test_fp8_cache_values_clamp_to_448_and_round_to_nearest_even():
    fp8 = torch.float8_e4m3fn
    # e4m3 has 3 mantissa bits: between 256 and 448 its steps are 32 apart; 1 + 1/16 is a tie.
    x = torch.tensor([1000.0, -1e9, 448.0, 300.0, 304.0, 1.0625, 1.1875, -0.0, 2.0 ** -9])
    got = to_cache_dtype(x, fp8).float().tolist()
    assert got == [448.0, -448.0, 448.0, 288.0, 320.0, 1.0, 1.25, -0.0, 2.0 ** -9]
    k_cache = torch.zeros(2, 4, 1, 2, dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    key = torch.tensor([[[500.0, 1.0625]]], dtype=torch.bfloat16)
    write_kv_ref(key, -key, k_cache, v_cache, torch.tensor([6]))
    assert k_cache[1, 2].float().tolist() == [[448.0, 1.0]]
    assert v_cache[1, 2].float().tolist() == [[-448.0, -1.0]]


def test_rejects_bad_shapes():
    q = torch.zeros(3, 3, 8)
    cache = torch.zeros(2, 4, 2, 8)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_attention_ref(q, cache, cache, table, torch.tensor([0, 3]), torch.tensor([3]), 1.0)
    with pytest.raises(ValueError, match="q_len 3"):
        paged_attention_ref(torch.zeros(3, 2, 8), cache, cache, table, torch.tensor([0, 3]), torch.tensor([2]), 1.0)
