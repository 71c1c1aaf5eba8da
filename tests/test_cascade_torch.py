"""The PyTorch cascade attention (the engine's CPU path) against the eager reference, on the same
batches as the Triton kernel's tests."""
import pytest
import torch

from kernels.attention_ref import cascade_attention_ref, to_cache_dtype
from kernels.cascade_torch import cascade_attention_torch
from tests.test_cascade_attention import MIXED_GROUPS, MIXED_LONE, make_batch


def check(args, atol=1e-5, rtol=1e-5):
    q = args[0]
    got = cascade_attention_torch(*args, q.shape[-1] ** -0.5)
    torch.testing.assert_close(got, cascade_attention_ref(*args, q.shape[-1] ** -0.5),
                               atol=atol, rtol=rtol)
    return got


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 32), (4, 4, 16), (4, 1, 16)])
def test_mixed_groups(hq, hkv, d):
    check(make_batch(MIXED_GROUPS, MIXED_LONE, hq, hkv, d, torch.float32, seed=hq + d)[0])


def test_fp8_caches():
    (q, k_cache, v_cache, *rest), _ = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, torch.float32, seed=5)
    fp8 = torch.float8_e4m3fn
    check((q, to_cache_dtype(k_cache, fp8), to_cache_dtype(v_cache, fp8), *rest))


def test_capacity_padding_lone_first_and_padding_rows():
    args, _ = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 16, torch.float32, seed=21,
                         empty_groups=4, lone_first=True, pad_rows=5)
    got = check(args)
    assert torch.equal(got[-5:], torch.zeros_like(got[-5:]))


def test_decode_only_groups_of_many():
    groups = [(48, [(1, 1 + i % 7) for i in range(20)]), (16, [(1, 3)] * 3)]
    check(make_batch(groups, [(1, 9), (1, 30)], 8, 2, 16, torch.float32, seed=12)[0])


def test_only_lone_requests_is_plain_attention():
    from kernels.attention_ref import paged_attention_ref
    args, _ = make_batch([], MIXED_LONE, 4, 2, 16, torch.float32, seed=4)
    got = check(args)
    torch.testing.assert_close(got, paged_attention_ref(*args[:6], 0.25), atol=1e-5, rtol=1e-5)


def test_the_prefix_is_read_through_the_first_member():
    groups = [(32, [(1, 3), (1, 9)]), (32, [(1, 5)])]
    args, _ = make_batch(groups, [(1, 20)], 4, 2, 16, torch.float32, seed=3)
    before = cascade_attention_torch(*args, 0.25)
    table = args[3]
    table[1, 0] = table[2, 0]      # the second member's own table now points elsewhere: unread
    after = cascade_attention_torch(*args, 0.25)
    assert torch.equal(before, after)


def test_half_precision_in_and_out():
    args, _ = make_batch(MIXED_GROUPS, MIXED_LONE, 8, 2, 32, torch.float16, seed=8)
    got = check(args, atol=1e-2, rtol=1e-3)
    assert got.dtype == torch.float16
