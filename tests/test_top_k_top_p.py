"""kernels/top_k_top_p.py: the sort-free top-k / top-p against its reference (the sort), under
TRITON_INTERPRET=1 on the CPU (and compiled on a GPU where there is one), bitwise: ties kept
lowest id first, -0.0 equal to +0.0, -inf values (min-p, min_tokens), k past V, top_p 1."""
import random

import pytest
import torch

import kernels.top_k_top_p as tkp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_BLOCK = 64            # several chunks a row at these small vocabularies


def rows(seed, num_rows, vocab, scale, ties, neg_inf, zeros):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=gen) * scale
    if ties:
        x = (x * 2).round() / 2                 # a few dozen distinct values: ties everywhere
    if neg_inf:
        x[0, 3] = float("-inf")
        x[-1, : vocab // 2] = float("-inf")
    if zeros:
        x[0, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    return x


CASES = [  # (seed, rows, vocab, scale, ties, -inf, zeros)
    (0, 4, 300, 2.0, True, False, True),
    (1, 3, 777, 6.0, False, True, False),
    (2, 3, 129, 0.5, True, True, True),
    (3, 2, 5, 1.0, False, False, False),
]


@pytest.mark.parametrize("case", CASES)
def test_equals_the_sort_bitwise(case):
    seed, num_rows, vocab, *rest = case
    x = rows(seed, num_rows, vocab, *rest)
    rng = random.Random(seed)
    top_k = torch.tensor([rng.choice([0, 1, 3, vocab, vocab + 4, rng.randrange(1, vocab + 1)])
                          for _ in range(num_rows)])
    top_p = torch.tensor([rng.choice([1.0, 0.5, 0.9, 0.1, rng.random()]) for _ in range(num_rows)],
                         dtype=torch.float32)
    for k, p in ((top_k, top_p), (top_k, None), (None, top_p)):
        want = tkp.top_k_top_p_ref(x, k, p)
        got = tkp.top_k_top_p(x.to(DEVICE), None if k is None else k.to(DEVICE),
                              None if p is None else p.to(DEVICE), block=SMALL_BLOCK).cpu()
        assert torch.equal(got, want), (k, p, (got != want).nonzero()[:8].tolist())


def test_ties_at_the_cut_keep_the_lowest_ids():
    # Four equal logits (mass ~.25 each): top-k 2 keeps ids 1 and 2, and so does top-p 0.4
    # (.25 before the second, ~.5 before the third).
    x = torch.tensor([[-9.0, 1.0, 1.0, 1.0, 1.0, -9.0]])
    got = tkp.top_k_top_p(x.to(DEVICE), torch.tensor([2]).to(DEVICE), None, block=SMALL_BLOCK).cpu()
    assert torch.isfinite(got).nonzero()[:, 1].tolist() == [1, 2]
    got = tkp.top_k_top_p(x.to(DEVICE), None, torch.tensor([0.4]).to(DEVICE), block=SMALL_BLOCK).cpu()
    assert torch.isfinite(got).nonzero()[:, 1].tolist() == [1, 2]


def test_rejects_what_it_does_not_take():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="fp32"):
        tkp.top_k_top_p(x.half(), None, None)
    with pytest.raises(ValueError, match="top_k"):
        tkp.top_k_top_p(x, torch.zeros(3, dtype=torch.int64, device=DEVICE), None)
    with pytest.raises(ValueError, match="top_p"):
        tkp.top_k_top_p(x, None, torch.ones(2, dtype=torch.float64, device=DEVICE))
