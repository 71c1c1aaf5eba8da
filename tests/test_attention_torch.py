"""The batched CPU attention against the reference, on mixed batches."""
import random

import pytest
import torch

from kernels.attention_ref import paged_attention_ref, to_cache_dtype, write_kv_ref
from kernels.attention_torch import paged_attention_torch

TOLS = {torch.float32: (1e-4, 1.3e-6), torch.float16: (1e-2, 1e-3), torch.bfloat16: (1.5e-2, 1e-2)}


def make_batch(q_lens, ctx_lens, hq, hkv, d, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-L // block_size) for L in ctx_lens) + 7
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()    # scattered blocks
    max_blocks = max(-(-L // block_size) for L in ctx_lens)
    table = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
    for b, L in enumerate(ctx_lens):
        n = -(-L // block_size)
        table[b, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table, cu, torch.tensor(ctx_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_reference(dtype, hq, hkv, block_size, window):
    rng = random.Random(hq * 31 + block_size)
    q_lens = [1, 1, 9, 1, 1, 33, 1, 0, 1]
    ctx_lens = [rng.randint(max(n, 1), 90) for n in q_lens]
    args = make_batch(q_lens, ctx_lens, hq, hkv, 16, block_size, dtype, seed=block_size)
    scale = 16 ** -0.5
    got = paged_attention_torch(*args, scale, window)
    ref = paged_attention_ref(*args, scale, window)
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_caches_match_reference(dtype):
    q_lens = [1, 1, 9, 1, 33, 1]
    q, k_cache, v_cache, *rest = make_batch(q_lens, [5, 40, 9, 70, 50, 1], 8, 2, 16, 16, dtype, seed=8)
    fp8 = torch.float8_e4m3fn
    args = (q, to_cache_dtype(k_cache, fp8), to_cache_dtype(v_cache, fp8), *rest)
    atol, rtol = TOLS[dtype]
    torch.testing.assert_close(paged_attention_torch(*args, 0.25, None), paged_attention_ref(*args, 0.25, None),
                               atol=atol, rtol=rtol)


def test_all_decode_and_single_rows():
    for q_lens, ctx in (([1] * 12, list(range(1, 13))), ([1], [40]), ([5], [5])):
        args = make_batch(q_lens, ctx, 4, 2, 8, 4, torch.float32, seed=len(q_lens))
        torch.testing.assert_close(paged_attention_torch(*args, 0.3),
                                   paged_attention_ref(*args, 0.3), atol=1e-5, rtol=1e-5)


def test_a_wrong_cache_entry_changes_the_output():
    args = make_batch([1, 1, 1], [20, 30, 7], 4, 2, 8, 4, torch.float32, seed=3)
    q, k_cache, v_cache, table, cu, lens = args
    before = paged_attention_torch(*args, 0.3)
    v_cache[int(table[1, 2])] += 1.0          # a block sequence 1 reads
    after = paged_attention_torch(q, k_cache, v_cache, table, cu, lens, 0.3)
    assert not torch.allclose(before[1], after[1]) and torch.equal(before[0], after[0])


def test_decode_only_entry_point_matches_reference():
    from kernels.attention_torch import decode_attention_torch
    args = make_batch([1] * 6, [3, 17, 40, 1, 64, 9], 8, 2, 16, 16, torch.float32, seed=9)
    q, k_cache, v_cache, table, cu, lens = args
    ref = paged_attention_ref(*args, 0.25, 5)
    torch.testing.assert_close(decode_attention_torch(q, k_cache, v_cache, table, lens, 0.25, 5),
                               ref, atol=1e-4, rtol=1.3e-6)
    # A max_seqlen_k above every length (as in a padded decode step) changes nothing.
    torch.testing.assert_close(
        decode_attention_torch(q, k_cache, v_cache, table, lens, 0.25, 5, max_seqlen_k=64),
        ref, atol=1e-4, rtol=1.3e-6)
