"""scripts/gpu_deep_decode.py's probe kernel is decode attention: it equals the reference for
every way its items fall to programs (the timing itself needs a GPU: sm_bandwidth.md)."""
import pytest
import torch

from kernels.paged_attention import paged_attention_ref
from scripts.gpu_deep_decode import deep_decode


def batch(num_seqs=3, keys=64, hq=4, hkv=2, d=16, page=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = keys // page
    blocks = num_seqs * pages + 5
    k = torch.randn(blocks, page, hkv, d, generator=gen)
    v = torch.randn(blocks, page, hkv, d, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:num_seqs * pages].view(num_seqs, pages).to(torch.int32)
    q = torch.randn(num_seqs, hq, d, generator=gen)
    return q, k, v, table


@pytest.mark.parametrize("programs,block_n", [(1, 16), (2, 32), (4, 16), (64, 64)])
def test_equals_the_reference_however_items_fall_to_programs(programs, block_n):
    q, k, v, table = batch()
    got = deep_decode(q, k, v, table, 64, 0.3, programs, block_n, warps=4, stages=2)
    cu = torch.arange(4, dtype=torch.int32)
    lens = torch.full((3,), 64, dtype=torch.int32)
    want = paged_attention_ref(q, k, v, table, cu, lens, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_the_first_keys_are_read_and_whole_tiles_are_asked():
    q, k, v, table = batch(keys=64)
    cu, lens = torch.arange(4, dtype=torch.int32), torch.full((3,), 32, dtype=torch.int32)
    got = deep_decode(q, k, v, table, 32, 0.3, 2, 16, warps=4, stages=2)
    torch.testing.assert_close(got, paged_attention_ref(q, k, v, table, cu, lens, 0.3), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of block_n"):
        deep_decode(q, k, v, table, 40, 0.3, 2, 16, warps=4, stages=2)
