"""scripts/gpu_page_size.py lays the same tokens out at every page size (the timing itself needs a
GPU: its results are in benchmarks/h200/page_size.md)."""
import pytest
import torch

from kernels.paged_attention import paged_attention, paged_attention_ref
from scripts.gpu_page_size import page_layout

PADDED = [256, 128, 384]          # three sequences, whole 128-token pages


def logical_pool(hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(PADDED)
    return torch.randn(total, hkv, d, generator=gen), torch.randn(total, hkv, d, generator=gen), gen


@pytest.mark.parametrize("page", [16, 32, 64, 128])
def test_each_table_reads_back_its_sequence_and_every_block_is_used_once(page):
    k_log, v_log, gen = logical_pool()
    k, v, table = page_layout(k_log, v_log, PADDED, page, gen)
    assert k.shape == (sum(PADDED) // page, page, 2, 16) and table.dtype == torch.int32
    start = 0
    for b, p in enumerate(PADDED):
        ids = table[b, :p // page].long()
        torch.testing.assert_close(k[ids].reshape(p, 2, 16), k_log[start:start + p], rtol=0, atol=0)
        torch.testing.assert_close(v[ids].reshape(p, 2, 16), v_log[start:start + p], rtol=0, atol=0)
        assert not table[b, p // page:].any()             # the row's tail: block 0, never read
        start += p
    used = torch.cat([table[b, :p // page] for b, p in enumerate(PADDED)])
    assert sorted(used.tolist()) == list(range(sum(PADDED) // page))
    assert used.tolist() != sorted(used.tolist())         # scattered, as a free list leaves them


def test_the_kernel_gives_the_same_bits_at_every_page_size_and_matches_the_reference():
    k_log, v_log, gen = logical_pool(seed=1)
    ctx = [250, 100, 300]                                  # keys a sequence, within its padded pages
    q = torch.randn(3, 4, 16, generator=gen)               # one decode row a sequence, 4 q heads
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    lens = torch.tensor(ctx, dtype=torch.int32)
    outs = []
    for page in (16, 64):
        k, v, table = page_layout(k_log, v_log, PADDED, page, gen)
        args = (q, k, v, table, cu, lens, 0.25)
        out = paged_attention(*args, max_seqlen_q=1, max_seqlen_k=max(ctx), num_kv_splits=2, merge_in_kernel=True)
        torch.testing.assert_close(out, paged_attention_ref(*args), rtol=1e-5, atol=1e-5)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
