"""Shared-prefix groups: which requests share a prefix worth reading (and computing) once.

Offline (`LLM.generate`, all prompts known up front, as in BatchLLM): `group_prompts` sorts the
prompts, so that prompts sharing a prefix sit next to each other, and takes the longest common
prefix (LCP) of each neighbouring pair. Those LCPs are the LCP-interval tree of the set: a node is a
run of sorted prompts that all share its prefix, its children are sub-runs sharing longer ones.
`choose_groups` then picks groups bottom-up: a node is a group with its own (longest shared)
prefix, or gives way to its children with their longer prefixes where those save more ("enlarge
the prefix where that pays"), the prompts they leave over grouped at the node's prefix. A group
of n over a prefix of L tokens saves (n - 1) * L token computations, and as many prefix reads per
decode step.

Online, the model runner builds the same tree over the block tables of one step's requests
(engine/cascade_plan.py): prefix caching already gave requests with equal prefixes the same
physical blocks.

Prefixes are whole KV blocks, and each request keeps at least one token of its own (the last
prompt token's hidden state is sampled from). No torch here.
"""
from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PromptGroup", "choose_groups", "group_prompts", "shareable_len"]


@dataclass(frozen=True)
class PromptGroup:
    prefix_len: int                  # tokens, a multiple of the block size; 0 for a lone prompt
    members: tuple[int, ...]         # indices into the prompts, ascending


class _Node:
    __slots__ = ("prefix", "lo", "hi", "children", "best", "whole", "leftover", "covered",
                 "covered_size")

    def __init__(self, prefix: int, lo: int, children: list) -> None:
        self.prefix, self.lo, self.hi, self.children = prefix, lo, lo, children
        self.best, self.whole, self.leftover = 0.0, False, False
        self.covered = self.covered_size = 0       # items (and their sizes) in chosen groups


def choose_groups(lcp: Sequence[int], value: Callable[[int, int, int], float],
                  sizes: Sequence[int] | None = None) -> list[tuple[list[int], int]]:
    """Disjoint groups over items in sorted order, where lcp[i] (i >= 1) is what items i - 1 and
    i share (lcp[0] is ignored; 0 = nothing worth sharing). Returns (item indices, prefix) pairs
    with the largest sum of value(num_items, sum of their sizes, prefix) (sizes default to 1)
    among the groupings below.

    Bottom-up over the LCP-interval tree: a node is one group of all its items at its prefix,
    or its children's best choices plus, if worth it, one more group of the items those leave
    over, at the node's prefix (a system prompt shared by all, documents by some: groups per
    document and one for the rest). Ties go to the larger group. O(len(lcp)) nodes. Groups are
    only these: of three items sharing one prefix, where all three do not pay, two of them
    alone are not weighed (a review found such a pair worth it in 574 of 3,000 random cases)."""
    n = len(lcp)
    if n < 2:
        return []
    cum = [0, *itertools.accumulate(sizes)] if sizes is not None else list(range(n + 1))

    def close(node: _Node, hi: int) -> None:
        node.hi = hi
        count, size = hi - node.lo, cum[hi] - cum[node.lo]
        kids = sum(c.best for c in node.children)
        covered = sum(c.covered for c in node.children)
        covered_size = sum(c.covered_size for c in node.children)
        if node.prefix <= 0:
            node.best, node.covered, node.covered_size = kids, covered, covered_size
            return
        whole = value(count, size, node.prefix)
        left = count - covered
        rest = value(left, size - covered_size, node.prefix) if left >= 2 else 0.0
        node.leftover = rest > 0
        split = kids + max(rest, 0.0)
        node.whole = whole > 0 and whole >= split
        node.best = whole if node.whole else split
        if node.whole or node.leftover:
            node.covered, node.covered_size = count, size
        else:
            node.covered, node.covered_size = covered, covered_size

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
    return _collect(root)


def _collect(root: _Node) -> list[tuple[list[int], int]]:
    """The chosen groups, top-down without recursion (trees can be deep)."""
    chosen: list[tuple[list[int], int]] = []
    todo = [root]
    while todo:
        node = todo.pop()
        if node.whole:
            chosen.append((list(range(node.lo, node.hi)), node.prefix))
            continue
        if node.leftover:
            taken = set()
            inner = list(node.children)
            while inner:                         # what the children's chosen groups hold
                child = inner.pop()
                if child.whole or child.leftover:
                    taken.update(range(child.lo, child.hi))
                else:
                    inner.extend(child.children)
            chosen.append(([i for i in range(node.lo, node.hi) if i not in taken],
                           node.prefix))
        todo.extend(node.children)
    return sorted(chosen, key=lambda g: g[0][0])


def shareable_len(num_tokens: int, block_size: int) -> int:
    """The longest prefix of a prompt that may be shared: whole blocks, one token left over."""
    return (num_tokens - 1) // block_size * block_size


# A prompt's first n ids as 4-byte unsigned ints, in the machine's byte order. Sorted as byte
# strings (memcmp, much faster than comparing lists of ints), prompts that share a prefix of ids
# share a prefix of bytes and so sit next to each other, which is all the grouping needs (the
# order among unrelated prompts does not matter). `array` makes a key in one pass over the
# Python ints; NumPy's conversion and byte-order cast took three, and with the ints scattered over
# memory, as a big job's shuffled prompts leave them, each pass is cache misses: 1.4 s of the
# intake for issue 12's 6,400 x 2,200 ids on the H200 host.
_ID_BYTES = 4
assert array.array("I").itemsize == _ID_BYTES


def _sort_key(prompt: Sequence[int] | np.ndarray, n: int) -> bytes:
    if isinstance(prompt, np.ndarray):      # an int64 array (LLM.generate's): converted in C
        return prompt[:n].astype(np.uint32).tobytes()
    return array.array("I", prompt[:n]).tobytes()


def _shared_blocks(a: bytes, b: bytes, block_size: int) -> int:
    """Whole blocks two sort keys start with alike: a binary search of prefix compares (memcmp)."""
    step = block_size * _ID_BYTES
    lo, hi = 0, min(len(a), len(b)) // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * step] == b[:mid * step]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def group_prompts(prompts: Sequence[Sequence[int] | np.ndarray], block_size: int,
                  min_prefix_len: int | None = None) -> list[PromptGroup]:
    """Every prompt in exactly one group, groups ordered by their first member (so the input
    order is kept as far as grouping allows); a lone prompt is a group of one with prefix 0.
    A group's prefix is the longest its members share, in whole blocks, and at least
    min_prefix_len tokens (default: one block). Token ids must be in [0, 2**32)."""
    min_len = max(block_size if min_prefix_len is None else min_prefix_len, 1)
    n = len(prompts)
    shareable = [shareable_len(len(p), block_size) for p in prompts]
    candidates = [i for i in range(n) if shareable[i] >= min_len]
    keys = {i: _sort_key(prompts[i], shareable[i]) for i in candidates}
    order = sorted(candidates, key=keys.__getitem__)
    lcp = [0] * len(order)
    for k in range(1, len(order)):
        shared = _shared_blocks(keys[order[k - 1]], keys[order[k]], block_size) * block_size
        lcp[k] = shared if shared >= min_len else 0
    chosen = choose_groups(lcp, lambda count, _, prefix: (count - 1) * prefix)
    groups = [PromptGroup(prefix, tuple(sorted(order[k] for k in items)))
              for items, prefix in chosen]
    grouped = {i for g in groups for i in g.members}
    groups += [PromptGroup(0, (i,)) for i in range(n) if i not in grouped]
    return sorted(groups, key=lambda g: g.members[0])
