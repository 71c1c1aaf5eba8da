"""kernels/race_sample.py against its reference (the stable sort, softmax and race): the same
token for every row and draw, with ties at both cuts (top-k keeps its ties, top-p the lowest ids
first), -0.0 beside +0.0, -inf values (min-p, min_tokens), k past V, top_p 1, and winners of the
whole race that the cuts reject (the kernel's loop).

Without CUDA the kernel runs under Triton's interpreter on CPU at small block sizes, with CUDA on
the GPU at the real block and a 128k vocabulary too.
"""
import random

import pytest
import torch

from tests.kernel_support import DEVICE, ON_GPU, load_kernels, require_runnable

rs = load_kernels("kernels.race_sample")


@pytest.fixture(autouse=True)
def kernels_can_run_here():
    require_runnable(rs)


def logit_rows(seed, num_rows, vocab, scale, ties, neg_inf, zeros):
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


def noise_like(x, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(x.shape).exponential_(generator=gen).clamp_min_(torch.finfo(torch.float32).tiny)


def sample(x, q, top_k, top_p, block):
    to = (lambda t: None if t is None else t.to(DEVICE))
    max_top_k = int(top_k.max()) if top_k is not None else 0
    return rs.race_sample(x.to(DEVICE), q.to(DEVICE), to(top_k), to(top_p), max_top_k, block=block).cpu()


CASES = [  # (seed, rows, vocab, scale, ties, -inf, zeros, block)
    (0, 4, 300, 2.0, True, False, True, 64),
    (1, 3, 777, 6.0, False, True, False, 128),
    (2, 3, 129, 0.5, True, True, True, 32),
    (3, 2, 5, 1.0, False, False, False, 16),
    (4, 4, 2000, 0.3, False, False, False, 256),     # flat: the cuts reject most winners
]
if ON_GPU:
    CASES += [(5, 256, 128256, 2.5, False, True, False, rs.config_for(256)[0]),
              (6, 64, 128256, 1.0, True, False, True, rs.config_for(64)[0])]


@pytest.mark.parametrize("case", CASES)
def test_equals_the_sort_for_every_draw(case):
    seed, num_rows, vocab, *rest, block = case
    x = logit_rows(seed, num_rows, vocab, *rest)
    rng = random.Random(seed)
    top_k = torch.tensor([rng.choice([0, 1, 3, 50, vocab, vocab + 4, rng.randrange(1, vocab + 1)])
                          for _ in range(num_rows)])
    top_p = torch.tensor([rng.choice([1.0, 0.5, 0.9, 0.95, 0.1, rng.random() or 1.0])
                          for _ in range(num_rows)], dtype=torch.float32)
    rejected = 0
    for draw in range(3):
        q = noise_like(x, seed * 10 + draw)
        whole_race = rs.race_sample_ref(x, q, None, None)
        for k, p in ((top_k, top_p), (top_k, None), (None, top_p), (None, None)):
            want = rs.race_sample_ref(x, q, k, p)
            got = sample(x, q, k, p, block)
            assert torch.equal(got, want), (draw, k, p, (got != want).nonzero().flatten().tolist())
            rejected += int((want != whole_race).sum())
    assert rejected > 0, "no draw made the kernel reject the whole race's winner"


def test_flat_rows_with_a_small_top_p_reject_many_times():
    """Top-p 0.05 over 4,000 nearly equal logits keeps ~200: the whole race's winner is rejected in
    ~95% of rows, and each next race over what is ahead of it is rejected often too."""
    x = logit_rows(7, 8, 4000, 0.05, False, False, False)
    top_p = torch.full((8,), 0.05)
    for draw in range(2):
        q = noise_like(x, 70 + draw)
        want = rs.race_sample_ref(x, q, None, top_p)
        assert (want != rs.race_sample_ref(x, q, None, None)).sum() >= 6
        assert torch.equal(sample(x, q, None, top_p, 512), want)


@pytest.mark.parametrize("top_p", [1e-50, 0.0])
def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(top_p):
    """A top_p of 1e-50 passes validation (> 0) and reaches the kernel as fp32 0: nothing may be
    ahead of a kept token then, and the first always is (the reference's rule, and vLLM's)."""
    x = logit_rows(3, 4, 200, 3.0, False, False, False)
    x[:, 0] = -20.0                                   # id 0: what a rejected row gave
    p = torch.tensor([top_p] * 4, dtype=torch.float32)
    q = noise_like(x, 5)
    want = x.argmax(dim=1)
    assert torch.equal(rs.race_sample_ref(x, q, None, p), want)
    assert torch.equal(sample(x, q, None, p, 64), want)
    assert torch.equal(sample(x, q, torch.tensor([3] * 4), p, 64), want)


def test_top_k_keeps_the_ties_at_its_cut_and_top_p_the_lowest_ids():
    """Top-k keeps every value tied with the k-th, as vLLM (`logits < kth` masked) and HF's
    TopKLogitsWarper do: it kept exactly k, lowest ids first, so a tied token with a higher id
    was never sampled. Top-p cuts by position (vLLM's too), ties lowest id first.

    Four equal logits; the noise favours id 4, then 3, then 2, then 1. Top-k 1, 2 or 3 keeps all
    four (4 wins), and top-k 4 does not reach the lower values (5 does). Top-p 0.4 keeps ids 1 and 2
    (mass .25 before id 2, .5 before id 3: 2 wins); top-k 3 with top-p 0.6 keeps the four,
    quarters: .5 before id 3, .75 before id 4 (3 wins)."""
    x = torch.tensor([[-9.0, 1.0, 1.0, 1.0, 1.0, -9.0]])
    q = torch.tensor([[1.0, 4.0, 3.0, 2.0, 1.0, 1.0]])
    for k in (1, 2, 3):
        assert sample(x, q, torch.tensor([k]), None, 16).tolist() == [4], k
        assert rs.race_sample_ref(x, q, torch.tensor([k]), None).tolist() == [4], k
    assert sample(x, q, None, torch.tensor([0.4]), 16).tolist() == [2]
    assert sample(x, q, torch.tensor([3]), torch.tensor([0.6]), 16).tolist() == [3]
    assert rs.race_sample_ref(x, q, torch.tensor([3]), torch.tensor([0.6])).tolist() == [3]
    assert sample(x, q, None, None, 16).tolist() == [4]
    q = torch.tensor([[1e-6, 4.0, 3.0, 2.0, 1.0, 1.0]])         # id 0 would win the race if kept
    assert sample(x, q, torch.tensor([4]), None, 16).tolist() == [4]
    assert sample(x, q, torch.tensor([5]), None, 16).tolist() == [0]


def test_ties_at_the_cut_in_other_blocks():
    """Ten equal top logits spread over 13 blocks of 16, the noise favouring the higher ids:
    top-p 0.03 (each holds ~0.0125 of the mass) keeps ids 5, 37 and 70, and 70 wins, which needs
    the ties ahead of each winner counted in every block; top-k 3 keeps all ten (199 wins)."""
    ids = [5, 37, 70, 101, 133, 150, 170, 185, 190, 199]
    x = torch.zeros(1, 200)
    x[0, ids] = 1.0
    q = torch.ones(1, 200)
    q[0, ids] = torch.linspace(1.0, 0.1, len(ids))
    assert sample(x, q, torch.tensor([3]), None, 16).tolist() == [199]
    assert sample(x, q, None, torch.tensor([0.03]), 16).tolist() == [70]
    assert rs.race_sample_ref(x, q, torch.tensor([3]), None).tolist() == [199]
    assert rs.race_sample_ref(x, q, None, torch.tensor([0.03])).tolist() == [70]


def test_rows_without_numbers_end_with_a_valid_id():
    """NaN and +inf logits (a broken model's) leave the race without a candidate; the kernel must
    still end and give an id inside the vocabulary (0 for a row with no finite value), never the
    sentinel V, which would index past the embedding."""
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    x[0] = float("nan")
    x[1, 7] = float("nan")
    x[2] = float("inf")
    x[3, [5, 9]] = float("inf")
    q = noise_like(x, 5)
    for k, p in ((torch.tensor([1, 1, 1, 1]), torch.tensor([0.5] * 4)), (None, torch.tensor([0.9] * 4)),
                 (torch.tensor([3] * 4), None), (None, None)):
        got = sample(x, q, k, p, 16)
        assert ((got >= 0) & (got < 100)).all(), (k, p, got)


def test_few_rows_without_a_cut_take_the_softmax_and_warm_up_the_kernel(monkeypatch):
    """Under 64 rows with neither cut race_sample runs the reference's softmax and argmax (faster
    there); warm_up must still launch the kernel itself, in each config."""
    x = logit_rows(8, 3, 300, 2.0, False, False, False)
    q = noise_like(x, 80)
    assert torch.equal(sample(x, q, None, None, 64), rs.race_sample_ref(x, q, None, None))
    launched = []
    monkeypatch.setattr(rs, "argmax_rows", lambda *a: pytest.fail("warm_up took the softmax path"))
    monkeypatch.setattr(rs, "config_for", lambda n: launched.append(n) or (64, 4))
    rs.warm_up(64, DEVICE)
    assert launched == [1, 128]


def test_top_k_cuts_at_the_kth_value_of_any_sign():
    """The k-th largest value negative, zero (-0.0 beside +0.0), positive or -inf (k past the
    finite values), with noise that favours the last id, so the winner is the highest id whose
    value is >= the k-th (the first of them by id among its ties)."""
    x = torch.tensor([[3.0, -0.0, -2.5, 0.0, -2.5, 7.25, -1e-30, float("-inf"), -2.5, 1e-30]])
    q = torch.linspace(1.0, 0.05, x.shape[1]).unsqueeze(0)
    for k in range(1, 11):
        want = rs.race_sample_ref(x, q, torch.tensor([k]), None)
        assert sample(x, q, torch.tensor([k]), None, 16).tolist() == want.tolist(), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]] + CASES[5:])
def test_logits_as_they_come_divided_by_the_temperature(case, dtype):
    """Logits in the model's dtype (a decode graph's buffer) and a temperature a row: the kernel
    reads them as they are and divides as it goes; the result is the reference's on the fp32
    logits divided by torch (the same rounding), ties at the cuts included (bf16 has many)."""
    seed, num_rows, vocab, *rest, block = case
    x = logit_rows(seed, num_rows, vocab, *rest).to(dtype)
    rng = random.Random(seed + 7)
    temperature = torch.tensor([rng.choice([1.0, 0.7, 0.3, 1.9, rng.uniform(0.05, 2.0)])
                                for _ in range(num_rows)], dtype=torch.float32)
    top_k = torch.tensor([rng.choice([0, 1, 7, 50, vocab + 1]) for _ in range(num_rows)])
    top_p = torch.tensor([rng.choice([1.0, 0.5, 0.9, 0.99]) for _ in range(num_rows)], dtype=torch.float32)
    to = (lambda t: None if t is None else t.to(DEVICE))
    for draw in range(2):
        q = noise_like(x, seed * 10 + draw + 100)
        for k, p in ((top_k, top_p), (top_k, None), (None, top_p), (None, None)):
            want = rs.race_sample_ref(x.float() / temperature.unsqueeze(1), q, k, p)
            got = rs.race_sample(x.to(DEVICE), q.to(DEVICE), to(k), to(p), int(top_k.max()), block=block,
                                 temperature=temperature.to(DEVICE)).cpu()
            assert torch.equal(got, want), (draw, k, p, (got != want).nonzero().flatten().tolist())


def test_rejects_what_it_does_not_take():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="logits must be"):
        rs.race_sample(x.double(), x, None, None)
    with pytest.raises(ValueError, match="noise must be .*float32"):
        rs.race_sample(x, x.half(), None, None)
    with pytest.raises(ValueError, match="temperature"):
        rs.race_sample(x, x, None, None, temperature=torch.ones(3, device=DEVICE))
    with pytest.raises(ValueError, match="noise must be shaped"):
        rs.race_sample(x, x[:, :4], None, None)
    with pytest.raises(ValueError, match="top_k"):
        rs.race_sample(x, x, torch.zeros(3, dtype=torch.int64, device=DEVICE), None, 1)
    with pytest.raises(ValueError, match="top_p"):
        rs.race_sample(x, x, None, torch.ones(2, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="max_top_k"):
        rs.race_sample(x, x, torch.ones(2, dtype=torch.int64, device=DEVICE), None)
    # A column of a [B, 2] tensor of settings: read as if contiguous, other rows' values.
    two = torch.ones(2, 2, device=DEVICE)
    for name, args, kwargs in (("top_k", (two.long()[:, 0], None, 1), {}),
                               ("top_p", (None, two[:, 0]), {}),
                               ("temperature", (None, None), {"temperature": two[:, 0]})):
        with pytest.raises(ValueError, match=f"{name} must be a contiguous"):
            rs.race_sample(x, x, *args, **kwargs)
