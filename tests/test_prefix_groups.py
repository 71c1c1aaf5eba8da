"""Finding shared-prefix groups among prompts (engine/prefix_groups.py)."""
import itertools
import random

import pytest

from engine.prefix_groups import PromptGroup, choose_groups, group_prompts, shareable_len

BS = 16


def rand_tokens(rng, n):
    return [rng.randrange(1, 50_000) for _ in range(n)]


def check_groups(prompts, groups, block_size=BS):
    """Every prompt once; members share the prefix, which is whole blocks, leaves each member a
    token, and is the longest they all share."""
    members = sorted(i for g in groups for i in g.members)
    assert members == list(range(len(prompts)))
    assert [g.members[0] for g in groups] == sorted(g.members[0] for g in groups)
    for g in groups:
        assert list(g.members) == sorted(g.members)
        if g.prefix_len == 0:
            assert len(g.members) == 1
            continue
        assert len(g.members) >= 2 and g.prefix_len % block_size == 0
        first = prompts[g.members[0]]
        for i in g.members:
            assert prompts[i][:g.prefix_len] == first[:g.prefix_len]
            assert len(prompts[i]) > g.prefix_len
        longer = g.prefix_len + block_size
        assert not all(len(prompts[i]) > longer and prompts[i][:longer] == first[:longer]
                       for i in g.members), "the prefix could be a block longer"


def test_shuffled_groups_are_found():
    rng = random.Random(0)
    prefixes = [rand_tokens(rng, n) for n in (2000, 500, 40)]
    prompts = [p + rand_tokens(rng, rng.randint(1, 200)) for p in prefixes for _ in range(16)]
    prompts += [rand_tokens(rng, rng.randint(1, 300)) for _ in range(10)]
    rng.shuffle(prompts)
    groups = group_prompts(prompts, BS)
    check_groups(prompts, groups)
    shared = sorted((g.prefix_len, len(g.members)) for g in groups if g.prefix_len)
    # 40 shared tokens are 2 whole blocks (32); a random own part may add a block by chance.
    assert [n for _, n in shared] == [16, 16, 16]
    assert [p // BS for p, _ in shared] == [2, 500 // BS, 2000 // BS]


def test_a_longer_prefix_for_a_subgroup_where_that_saves_more():
    rng = random.Random(1)
    system = rand_tokens(rng, 64)                      # all share a short system prompt...
    docs = [rand_tokens(rng, 800) for _ in range(3)]   # ...and groups of 8 a long document
    prompts = [system + d + rand_tokens(rng, 30) for d in docs for _ in range(8)]
    groups = group_prompts(prompts, BS)
    check_groups(prompts, groups)
    assert sorted((g.prefix_len, len(g.members)) for g in groups) == [(864, 8)] * 3
    # One long document shared by all, and pairs that share 32 more tokens: the big group wins
    # ((24 - 1) * 800 tokens against 12 * 832).
    doc = rand_tokens(rng, 800)
    prompts = [doc + tail + rand_tokens(rng, 5) for tail in
               (rand_tokens(rng, 32) for _ in range(12)) for _ in range(2)]
    groups = group_prompts(prompts, BS)
    check_groups(prompts, groups)
    assert [(g.prefix_len, len(g.members)) for g in groups] == [(800, 24)]


def test_whole_blocks_and_a_token_of_their_own():
    same = list(range(100, 164))                      # 64 tokens: 4 whole blocks
    groups = group_prompts([same, same, same + [7]], BS)
    # Identical 64-token prompts keep their last block to compute: 48 shared.
    assert groups == [PromptGroup(48, (0, 1, 2))]
    assert shareable_len(64, 16) == 48 and shareable_len(65, 16) == 64 and shareable_len(1, 16) == 0
    assert group_prompts([same[:20], same[:20]], BS) == [PromptGroup(16, (0, 1))]
    # Under one block in common: nothing to share.
    assert group_prompts([same[:15] + [1], same[:15] + [2]], BS) == [PromptGroup(0, (0,)),
                                                                     PromptGroup(0, (1,))]
    assert group_prompts([], BS) == []
    assert group_prompts([[5]], BS) == [PromptGroup(0, (0,))]


def test_min_prefix_len():
    rng = random.Random(2)
    short, long_ = rand_tokens(rng, 64), rand_tokens(rng, 256)
    prompts = [short + [1, 2], short + [3], long_ + [4], long_ + [5]]
    groups = group_prompts(prompts, BS, min_prefix_len=128)
    assert [(g.prefix_len, g.members) for g in groups] == [(0, (0,)), (0, (1,)), (256, (2, 3))]


def test_ids_beyond_16_bits_sort_correctly():
    a, b = [70_000, 1] * 16, [1, 70_000] * 16
    prompts = [a + [1], b + [1], a + [2], b + [2]]
    groups = group_prompts(prompts, BS)
    assert [(g.prefix_len, g.members) for g in groups] == [(32, (0, 2)), (32, (1, 3))]


def brute_force_best(lcp, value):
    """The best total over all sets of disjoint tree nodes, enumerating runs directly: a run
    [lo, hi) of 2+ items is a node iff min(lcp[lo+1:hi]) > max(lcp[lo], lcp[hi]) (its edges)."""
    n = len(lcp)
    nodes = []
    for lo, hi in itertools.combinations(range(n + 1), 2):
        if hi - lo < 2:
            continue
        inner = min(lcp[lo + 1:hi])
        edge = max(lcp[lo] if lo > 0 else 0, lcp[hi] if hi < n else 0)
        if inner > edge:
            nodes.append((lo, hi, inner))
    best = 0
    for k in range(len(nodes) + 1):
        for pick in itertools.combinations(nodes, k):
            spans = sorted((lo, hi) for lo, hi, _ in pick)
            if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
                continue
            best = max(best, sum(value(*node) for node in pick))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_choose_groups_is_optimal_on_small_trees(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 8)
    lcp = [0] + [rng.choice([0, 1, 2, 3, 5]) for _ in range(n - 1)]
    weights = [rng.random() for _ in range(n)]
    value = lambda lo, hi, p: (sum(weights[lo:hi]) - max(weights[lo:hi])) * p  # noqa: E731
    chosen = choose_groups(lcp, value)
    spans = [(lo, hi) for lo, hi, _ in chosen]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for lo, hi, p in chosen:
        assert p == min(lcp[lo + 1:hi]) > 0
    assert sum(value(*c) for c in chosen) == pytest.approx(brute_force_best(lcp, value))


def test_thousands_of_long_prompts_group_fast():
    import time
    rng = random.Random(3)
    prefixes = [rand_tokens(rng, 2000) for _ in range(100)]
    prompts = [prefixes[i % 100] + rand_tokens(rng, 200) for i in range(1600)]
    t0 = time.perf_counter()
    groups = group_prompts(prompts, BS)
    assert time.perf_counter() - t0 < 20          # ~0.3 s on a 2-core CI machine
    assert sorted(len(g.members) for g in groups) == [16] * 100
