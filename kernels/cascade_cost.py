"""When cascade attention pays: a cost rule on host ints, no torch (the torch-free engine uses it).

`kernels/cascade_attention.py` reads a group's shared prefix once per prefix tile instead of once
per member, at the price of a second launch (the prefix pass), fp32 partials written and read back
per query row, and an own pass that is slower per byte than the plain kernel (no split-KV, a merge).
The rule weighs the bytes one attention layer saves against those costs, per step.

Calibration: H200, Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, bf16), 256 decode rows with 200 own
tokens each, groups of 2/4/16/64 over prefixes of 128/496/2000/8000 tokens, both kernels replayed
from CUDA graphs (`scripts/gpu_check_cascade.py`, benchmarks/h200/cascade_attention.txt). Per layer,
plain minus cascade time fits `a * saved - b` with a = 0.08-0.14 us/MiB (more for larger groups:
the plain kernel already finds a pair's shared blocks in L2) and b = 7 us plus ~0.08 us per group
(the prefix pass's programs each load a query tile and store partials). In bytes:

  min_saved_bytes = 64 MiB   the fixed cost (b's 7 us at the conservative 0.08-0.11 us/MiB)
  per_group_bytes = 1 MiB    each group's own share (0.08 us/group at 0.08 us/MiB)

These put every measured point on its faster side: cascade lost only for pairs and quads over a
128-token prefix (0.90x, 0.98x; rule: -72 and +24 MiB, plain), and won from groups of 16 or 64
over 128 tokens (1.08x, 1.06x; +96, +112 MiB) and pairs over 496 (1.02x; +112 MiB) up to 4.8x
(tests/test_cascade_cost.py holds the table). min_prefix_len 128: no shorter prefix was measured.
Other batch sizes were not measured; the rule's inputs scale with rows, so it carries over as an
estimate, save one thing bytes do not show: the own pass has no split-KV. One program per
(sequence, kv head) walks that sequence's own keys, so a step of few rows with long own parts
leaves SMs idle while the plain kernel splits the same keys over them. H200, decode rows in groups
of 8-16 over 2000-4000 prefix tokens (scripts/gpu_cascade_own_parts.py, benchmarks/h200/
cascade_decode_passes.md, tests/test_cascade_cost.py):
at 8-32 rows (64-256 programs, two per SM is 264) cascade ran 0.42-0.91x the plain kernel with own
parts of 2000-8000 tokens, and 1.16-1.22x with 500-1000; from 64 rows it won at every own length
measured (1.06x at 4000 behind a 992-token prefix, 1.31-3.04x otherwise). So a step runs cascade
only when it has min_own_programs (rows x kv heads) or no own part of long_own_len tokens or more
(`own_pass_fills`). Those kernel timings ran the plain kernel with its separate merge; in the
engine, steps of 16-32 rows replay the splits-merged-in-the-kernel form, and there the engine's
own steps (scripts/gpu_cascade_own_check.py, benchmarks/h200/decode_attention_stages.md) put plain
ahead at all ten points measured, 16-32 rows with 2000-8000 own tokens (0.66-0.96x for cascade).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["CascadeCostRule", "PrefixGroup"]


class PrefixGroup(NamedTuple):
    num_members: int        # sequences sharing the prefix this step
    prefix_len: int         # tokens, whole blocks, before every member's first query
    num_query_rows: int     # the members' query rows this step (decode: one each)


@dataclass(frozen=True)
class CascadeCostRule:
    """Whether reading a group's prefix once (cascade) beats reading it once per member (plain).

    Everything is HBM bytes of one attention layer in one step (every layer has the same ratio):

      kv_bytes_per_token = 2 * num_kv_heads * head_dim * kv_dtype_bytes         (K and V)
      plain reads the prefix once per member (the least it does; a long prefill chunk re-reads
      it per 128-row tile, which only makes cascade look better than counted here)
      cascade reads it once per prefix tile: tiles = cdiv(num_query_rows, rows_per_prefix_tile)
      cascade adds partials: each query row writes, and the own pass reads back, num_prefix_splits
      x num_q_heads x (head_dim + 2) fp32 values

      saved(group) = (num_members - tiles) * prefix_len * kv_bytes_per_token
                     - 2 * num_prefix_splits * num_query_rows * num_q_heads * (head_dim + 2) * 4

    A group keeps its prefix when it has two members or more, prefix_len >= min_prefix_len and
    saved > per_group_bytes. The step runs the cascade kernel when the kept groups' saved -
    per_group_bytes add up to min_saved_bytes; otherwise the plain kernel. The constants come
    from H200 measurements (module docstring). rows_per_prefix_tile: query rows one prefix program
    holds (its tile's rows / padded query heads per kv head), which depends on the launch.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2
    min_prefix_len: int = 128
    min_saved_bytes: int = 64 << 20
    per_group_bytes: int = 1 << 20
    rows_per_prefix_tile: int = 32
    num_prefix_splits: int = 1
    min_own_programs: int = 264         # two per SM of an H200's 132
    long_own_len: int = 1024
    own_prompt_tile_rows: int = 32      # query positions of an own-pass prompt tile (128 rows / 4 heads)

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "kv_dtype_bytes", "rows_per_prefix_tile",
                     "num_prefix_splits", "min_own_programs", "long_own_len", "own_prompt_tile_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        for name in ("min_prefix_len", "min_saved_bytes", "per_group_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    def saved_bytes(self, group: PrefixGroup) -> int:
        """HBM bytes one layer saves by running `group` through cascade (negative: costs)."""
        tiles = -(-group.num_query_rows // self.rows_per_prefix_tile)
        reads_saved = (group.num_members - tiles) * group.prefix_len * self.kv_bytes_per_token
        partials = (2 * self.num_prefix_splits * group.num_query_rows * self.num_q_heads
                    * (self.head_dim + 2) * 4)
        return reads_saved - partials

    def net_bytes(self, group: PrefixGroup) -> int:
        """What keeping `group` is worth after its own overhead; <= 0: not worth it alone."""
        if group.num_members < 2 or group.prefix_len < max(self.min_prefix_len, 1):
            return 0
        return self.saved_bytes(group) - self.per_group_bytes

    def plan(self, groups: Sequence[PrefixGroup]) -> list[bool]:
        """Per group: keep its prefix (True) or run its members alone with prefix_len 0 (False).
        All False: run the plain paged-attention kernel this step."""
        net = [self.net_bytes(g) for g in groups]
        keep = [n > 0 for n in net]
        total = sum(n for n in net if n > 0)
        return keep if total >= self.min_saved_bytes and any(keep) else [False] * len(groups)

    def use_cascade(self, groups: Sequence[PrefixGroup]) -> bool:
        return any(self.plan(groups))

    def own_tiles(self, q_lens: Sequence[int]) -> int:
        """The own pass's query tiles for sequences of these query lengths: cdiv(q_len,
        own_prompt_tile_rows) each, so one per decode row."""
        return int((-(-np.asarray(q_lens, dtype=np.int64) // self.own_prompt_tile_rows)).sum())

    def own_pass_fills(self, num_own_tiles: int, longest_own_len: int) -> bool:
        """Whether a cascade step's own pass keeps the GPU busy: at least min_own_programs
        programs (own_tiles x kv heads), or no sequence reads long_own_len own keys or more
        (module docstring). longest_own_len: the most keys a sequence reads in the own pass (a
        member's context past its prefix, a lone sequence's whole context)."""
        return (num_own_tiles * self.num_kv_heads >= self.min_own_programs
                or longest_own_len < self.long_own_len)
