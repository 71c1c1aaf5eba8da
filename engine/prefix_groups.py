"""Shared-prefix groups: which requests share a prefix worth reading (and computing) once.

Offline (`LLM.generate`, all prompts known up front, as in BatchLLM): `group_prompts` sorts the
prompts, so that prompts sharing a prefix sit next to each other, and takes the longest common
prefix (LCP) of each neighbouring pair. Those LCPs are the LCP-interval tree of the set: a node is a
run of sorted prompts that all share its prefix, its children are sub-runs sharing longer ones.
`choose_groups` then picks disjoint nodes: a node is a group with its own (longest shared)
prefix, or gives way to its children with their longer prefixes where those save more ("enlarge
the prefix where that pays"). A group of n over a prefix of L tokens saves (n - 1) * L token
computations, and as many prefix reads per decode step.

Online, the model runner builds the same tree over the block tables of one step's requests
(engine/cascade_plan.py): prefix caching already gave requests with equal prefixes the same
physical blocks.

Prefixes are whole KV blocks, and each request keeps at least one token of its own (the last
prompt token's hidden state is sampled from). No torch here.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PromptGroup", "choose_groups", "group_prompts", "shareable_len"]


@dataclass(frozen=True)
class PromptGroup:
    prefix_len: int                  # tokens, a multiple of the block size; 0 for a lone prompt
    members: tuple[int, ...]         # indices into the prompts, ascending


class _Node:
    __slots__ = ("prefix", "lo", "hi", "children", "best", "take")

    def __init__(self, prefix: int, lo: int, children: list) -> None:
        self.prefix, self.lo, self.hi, self.children = prefix, lo, lo, children
        self.best, self.take = 0.0, False


def choose_groups(lcp: Sequence[int], value: Callable[[int, int, int], float]
                  ) -> list[tuple[int, int, int]]:
    """Disjoint groups over items in sorted order, where lcp[i] (i >= 1) is what items i - 1 and i
    share (lcp[0] is ignored; 0 = nothing worth sharing). Returns (lo, hi, prefix) for runs
    [lo, hi) of the LCP-interval tree, chosen bottom-up to maximize the sum of
    value(lo, hi, prefix): a node is taken when its value is positive and at least what its
    children's best choices add up to (ties go to the larger group). O(len(lcp))."""
    n = len(lcp)
    if n < 2:
        return []

    def close(node: _Node, hi: int) -> None:
        node.hi = hi
        kids = sum(c.best for c in node.children)
        own = value(node.lo, hi, node.prefix) if node.prefix > 0 else 0.0
        node.take = own > 0 and own >= kids
        node.best = own if node.take else kids

    # Bottom-up traversal of the LCP intervals (Abouelhoda, Kurtz, Ohlebusch 2004).
    stack = [_Node(0, 0, [])]
    for i in range(1, n + 1):
        cur = lcp[i] if i < n else 0
        lo = i - 1
        last = None
        while cur < stack[-1].prefix:
            last = stack.pop()
            close(last, i)
            lo = last.lo
            if cur <= stack[-1].prefix:
                stack[-1].children.append(last)
                last = None
        if cur > stack[-1].prefix:
            stack.append(_Node(cur, lo, [last] if last is not None else []))
    root = stack[0]
    close(root, n)
    chosen, todo = [], [root]
    while todo:
        node = todo.pop()
        if node.take:
            chosen.append((node.lo, node.hi, node.prefix))
        else:
            todo.extend(node.children)
    return sorted(chosen)


def shareable_len(num_tokens: int, block_size: int) -> int:
    """The longest prefix of a prompt that may be shared: whole blocks, one token left over."""
    return (num_tokens - 1) // block_size * block_size


def group_prompts(prompts: Sequence[Sequence[int]], block_size: int,
                  min_prefix_len: int | None = None) -> list[PromptGroup]:
    """Every prompt in exactly one group, groups ordered by their first member (so the input
    order is kept as far as grouping allows); a lone prompt is a group of one with prefix 0.
    A group's prefix is the longest its members share, in whole blocks, and at least
    min_prefix_len tokens (default: one block). Token ids must be in [0, 2**31)."""
    min_len = max(block_size if min_prefix_len is None else min_prefix_len, 1)
    n = len(prompts)
    shareable = [shareable_len(len(p), block_size) for p in prompts]
    candidates = [i for i in range(n) if shareable[i] >= min_len]
    arrays = {i: np.asarray(prompts[i][:shareable[i]], dtype=np.int64) for i in candidates}
    # Big-endian bytes sort like the id sequences (memcmp), much faster than lists of ints.
    keys = {i: arrays[i].astype(">u4").tobytes() for i in candidates}
    order = sorted(candidates, key=keys.__getitem__)
    lcp = [0] * len(order)
    for k in range(1, len(order)):
        a, b = arrays[order[k - 1]], arrays[order[k]]
        m = min(len(a), len(b))
        differ = np.flatnonzero(a[:m] != b[:m])
        shared = (int(differ[0]) if differ.size else m) // block_size * block_size
        lcp[k] = shared if shared >= min_len else 0
    chosen = choose_groups(lcp, lambda lo, hi, prefix: (hi - lo - 1) * prefix)
    groups = [PromptGroup(prefix, tuple(sorted(order[lo:hi]))) for lo, hi, prefix in chosen]
    grouped = {i for g in groups for i in g.members}
    groups += [PromptGroup(0, (i,)) for i in range(n) if i not in grouped]
    return sorted(groups, key=lambda g: g.members[0])
