"""Per step: which of the runner's rows share a prefix, and whether cascade attention pays.

The runner already holds every request's block table. With prefix caching (or a prefix group's
pinned blocks), requests with the same prefix hold the same physical blocks at the head of their
tables, so equal leading block ids are shared prefixes, offline and served traffic alike, with
nothing sent from the scheduler. `CascadePlanner.plan`:

1. A row may join a group over the blocks wholly before its first query position (a row still
   writing part of a prefix cannot read it as shared); rows with fewer than the rule's
   min_prefix_len of those stay alone, and so do prompt chunks longer than a prefix tile (the
   prefix pass would read the prefix once per tile of their rows: no better than plain).
2. Sort those rows by their leading block ids (numpy, memcmp order) and take the common run of
   each neighbouring pair: the LCP-interval tree over block tables. `choose_groups` picks groups
   by the cost rule's net bytes, so a subset sharing a longer prefix is its own group where
   that saves more, the rest grouped over the shorter one (engine/prefix_groups.py).
3. Split groups over `max_group_rows` query rows (a CUDA graph's capacity), let the cost rule
   keep the groups worth it and say whether the step pays at all, keep at most `max_groups`.
4. In a cascade step a lone decode row over a long context (`split_lone_from` tokens) becomes a
   group of one over its own cached blocks: the own pass has no split-KV, the prefix pass does.
5. A step of few rows whose own parts are long stays plain (`CascadeCostRule.own_pass_fills`).

The plan puts each kept group's members next to each other, first, and every other row after
them in its old order, as kernels/cascade_attention.py needs. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.prefix_groups import choose_groups
from kernels.cascade_cost import CascadeCostRule, PrefixGroup


@dataclass
class CascadePlan:
    order: list[int]            # the step's rows, regrouped: kept groups' members first
    prefix_lens: np.ndarray     # [B] int32 in the new order; 0 for rows outside groups
    cu_group_seqs: np.ndarray   # [num_groups + 1] int32 over the new order
    max_group_rows: int         # query rows of the largest group
    max_prefix_len: int
    num_cascade_rows: int       # query rows that read a shared prefix (groups of two or more)


class CascadePlanner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def plan(self, block_table: np.ndarray, starts: np.ndarray, q_lens: np.ndarray,
             rule: CascadeCostRule, max_group_rows: int | None = None,
             max_groups: int | None = None, split_lone_from: int | None = None
             ) -> CascadePlan | None:
        """block_table [B, W] int32 (entries past a row's blocks are ignored), starts [B] the
        tokens each row had computed before this step, q_lens [B] its new tokens. None: run the
        plain kernel."""
        bs = self.block_size
        min_blocks = max(1, -(-rule.min_prefix_len // bs))
        q_lens = np.asarray(q_lens)
        # Blocks wholly before the first query (and in the table).
        caps = np.minimum(np.asarray(starts) // bs, block_table.shape[1])
        cand = np.flatnonzero((caps >= min_blocks) & (q_lens <= rule.rows_per_prefix_tile))
        if cand.size < 2 or np.unique(block_table[cand, 0]).size == cand.size:
            return None
        width = int(caps[cand].max())
        sub = block_table[cand, :width]
        # Past its cap a row holds values of its own, so no common run can reach beyond it.
        past = np.arange(width)[None, :] >= caps[cand][:, None]
        sub = np.where(past, -1 - np.arange(cand.size, dtype=np.int64)[:, None], sub)
        keys = np.ascontiguousarray(sub, dtype=">i4").view(f"V{4 * width}").ravel()
        order = np.argsort(keys, kind="stable")
        sorted_rows = cand[order].tolist()
        sub = sub[order]
        differ = sub[1:] != sub[:-1]
        lcp = np.where(differ.any(1), differ.argmax(1), width)
        lcp = np.where(lcp >= min_blocks, lcp * bs, 0)
        q_sorted = q_lens[cand[order]].tolist()
        chosen = choose_groups([0] + lcp.tolist(), lambda count, rows, p: rule.net_bytes(
            PrefixGroup(count, p, rows)), sizes=q_sorted)
        groups = []                                      # (members, prefix_len, query rows)
        for items, prefix in chosen:
            groups += _split([sorted_rows[k] for k in items], [q_sorted[k] for k in items],
                             prefix, max_group_rows)
        stats = [PrefixGroup(len(m), p, r) for m, p, r in groups]
        keep = [g for g, k in zip(groups, rule.plan(stats)) if k]
        if not keep:
            return None
        if max_groups is not None and len(keep) > max_groups:
            keep.sort(key=lambda g: -rule.net_bytes(PrefixGroup(len(g[0]), g[1], g[2])))
            keep = sorted(keep[:max_groups], key=lambda g: g[0][0])
        num_cascade_rows = sum(r for _, _, r in keep)
        if split_lone_from is not None:
            grouped = {r for members, _, _ in keep for r in members}
            long_lone = [r for r in np.flatnonzero((q_lens == 1) & (caps * bs >= split_lone_from))
                         .tolist() if r not in grouped]
            room = len(long_lone) if max_groups is None else max_groups - len(keep)
            keep += [([r], int(caps[r]) * bs, 1) for r in long_lone[:max(room, 0)]]
        own_lens = np.asarray(starts) + q_lens                  # a row's keys in the own pass
        for members, prefix, _ in keep:
            own_lens[members] -= prefix
        longest_own = int(own_lens[q_lens > 0].max(initial=0))  # rows with no query read nothing
        if not rule.own_pass_fills(rule.own_tiles(q_lens), longest_own):
            return None
        return _build(keep, len(q_lens), num_cascade_rows)


def _split(members: list[int], q_lens: list[int], prefix: int,
           max_group_rows: int | None) -> list[tuple[list[int], int, int]]:
    """A group as consecutive chunks of at most max_group_rows query rows (chunks of one member,
    or a member alone over the limit, are no group)."""
    total = sum(q_lens)
    if max_group_rows is None or total <= max_group_rows:
        return [(members, prefix, total)]
    out, chunk, chunk_rows = [], [], 0
    for row, n in zip(members, q_lens):
        if chunk and chunk_rows + n > max_group_rows:
            out.append((chunk, prefix, chunk_rows))
            chunk, chunk_rows = [], 0
        if n <= max_group_rows:
            chunk.append(row)
            chunk_rows += n
    if chunk:
        out.append((chunk, prefix, chunk_rows))
    return [g for g in out if len(g[0]) >= 2]


def _build(groups: list[tuple[list[int], int, int]], num_rows: int,
           num_cascade_rows: int) -> CascadePlan:
    order: list[int] = []
    prefix_lens: list[int] = []
    cu = [0]
    for members, prefix, _ in groups:
        order += members
        prefix_lens += [prefix] * len(members)
        cu.append(len(order))
    in_group = set(order)
    rest = [r for r in range(num_rows) if r not in in_group]
    return CascadePlan(
        order=order + rest,
        prefix_lens=np.asarray(prefix_lens + [0] * len(rest), dtype=np.int32),
        cu_group_seqs=np.asarray(cu, dtype=np.int32),
        max_group_rows=max(r for _, _, r in groups),
        max_prefix_len=max(p for _, p, _ in groups),
        num_cascade_rows=num_cascade_rows)
