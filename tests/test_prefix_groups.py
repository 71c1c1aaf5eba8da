"""Finding shared-prefix groups among prompts (engine/prefix_groups.py)."""
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


def reference_groups(prompts, block_size, min_len):
    """group_prompts spelt out on lists: sorted as tuples, each neighbour pair's shared blocks
    counted id by id."""
    share = [shareable_len(len(p), block_size) for p in prompts]
    order = sorted((i for i in range(len(prompts)) if share[i] >= min_len),
                   key=lambda i: tuple(prompts[i][:share[i]]))
    lcp = [0] * len(order)
    for k in range(1, len(order)):
        a, b = prompts[order[k - 1]][:share[order[k - 1]]], prompts[order[k]][:share[order[k]]]
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shared = same // block_size * block_size
        lcp[k] = shared if shared >= min_len else 0
    return sorted((prefix, tuple(sorted(order[k] for k in items)))
                  for items, prefix in choose_groups(lcp, lambda n, _, prefix: (n - 1) * prefix))


@pytest.mark.parametrize("seed", range(20))
def test_groups_match_the_reference_on_near_miss_prefixes(seed):
    # Prefixes that part at every offset, ids from a tiny vocabulary and around 2**16 (the sort
    # keys are four bytes an id: ids alike in their low bytes must still part).
    rng = random.Random(seed)
    vocab = rng.choice([(0, 3), (65_530, 65_542), (1, 200_000)])
    base = [rng.randint(*vocab) for _ in range(8 * BS)]
    prompts = []
    for _ in range(rng.randint(2, 40)):
        cut = rng.randint(0, len(base))
        tail = [rng.randint(*vocab) for _ in range(rng.randint(1, 3 * BS))]
        prompts.append(base[:cut] + tail)
    min_len = rng.choice([BS, 2 * BS, 5 * BS])
    groups = group_prompts(prompts, BS, min_prefix_len=min_len)
    check_groups(prompts, [g for g in groups if g.prefix_len >= min_len or g.prefix_len == 0])
    got = sorted((g.prefix_len, g.members) for g in groups if len(g.members) >= 2)
    assert got == [g for g in reference_groups(prompts, BS, min_len) if len(g[1]) >= 2]


def test_int64_arrays_group_as_lists():
    # LLM.generate hands over its checked int64 arrays: the same groups as from the lists.
    import numpy as np
    rng = random.Random(7)
    prefixes = [rand_tokens(rng, 3 * BS) for _ in range(3)]
    prompts = [prefixes[i % 3] + rand_tokens(rng, rng.randint(1, 2 * BS)) for i in range(12)]
    prompts.append([70_000] * (2 * BS) + [1])
    prompts.append([70_000] * (2 * BS) + [2])
    arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    assert group_prompts(arrays, BS) == group_prompts(prompts, BS)
    assert group_prompts(arrays[:5] + prompts[5:], BS) == group_prompts(prompts, BS)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


def group_value(value, lcp, sizes, g):
    prefix = min(lcp[min(g) + 1:max(g) + 1]) if len(g) >= 2 else 0
    return max(value(len(g), sum(sizes[i] for i in g), prefix), 0.0) if prefix > 0 else 0.0


def best_partition(lcp, value, sizes, nodes_only=False):
    """The best total over every way to put the items into disjoint groups, each at the longest
    prefix its members share (the least lcp over the sorted span they cover); nodes_only: groups
    must be whole nodes of the LCP-interval tree (contiguous runs wider than their edges)."""
    best = 0.0
    for part in set_partitions(list(range(len(lcp)))):
        groups = [sorted(g) for g in part if len(g) >= 2]
        if nodes_only and not all(
                g == list(range(g[0], g[-1] + 1))
                and min(lcp[g[0] + 1:g[-1] + 1]) > max(lcp[g[0]] if g[0] > 0 else 0,
                                                      lcp[g[-1] + 1] if g[-1] + 1 < len(lcp) else 0)
                for g in groups):
            continue
        best = max(best, sum(group_value(value, lcp, sizes, g) for g in groups))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_choose_groups_against_brute_force(seed):
    """At least the best choice of whole tree nodes (leftover groups only add options), at most
    the best of all partitions (a leftover never joins an ancestor's group: not searched)."""
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    lcp = [0] + [rng.choice([0, 1, 2, 3, 5]) for _ in range(n - 1)]
    sizes = [rng.choice([1, 1, 1, 4]) for _ in range(n)]
    for value in (lambda count, size, p: (count - 1) * p,
                  lambda count, size, p: (count - 1) * p - 2.5 - 0.3 * size):
        chosen = choose_groups(lcp, value, sizes)
        seen = [i for items, _ in chosen for i in items]
        assert len(seen) == len(set(seen))
        for items, p in chosen:
            assert len(items) >= 2 and 0 < p <= min(lcp[min(items) + 1:max(items) + 1])
        total = sum(value(len(items), sum(sizes[i] for i in items), p) for items, p in chosen)
        assert best_partition(lcp, value, sizes, nodes_only=True) - 1e-9 <= total
        assert total <= best_partition(lcp, value, sizes) + 1e-9


def test_a_system_prompt_for_all_and_documents_for_some():
    # Items 0-2 share a long document, 3-5 only the system prompt (lcp 1 between all).
    lcp = [0, 9, 9, 1, 1, 1]
    chosen = choose_groups(lcp, lambda count, size, p: (count - 1) * p)
    assert chosen == [([0, 1, 2], 9), ([3, 4, 5], 1)]


def test_thousands_of_long_prompts_group_fast():
    import time
    rng = random.Random(3)
    prefixes = [rand_tokens(rng, 2000) for _ in range(100)]
    prompts = [prefixes[i % 100] + rand_tokens(rng, 200) for i in range(1600)]
    t0 = time.perf_counter()
    groups = group_prompts(prompts, BS)
    assert time.perf_counter() - t0 < 20          # ~0.3 s on a 2-core CI machine
    assert sorted(len(g.members) for g in groups) == [16] * 100
