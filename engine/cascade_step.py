"""The model runner's side of cascade attention: this model's cost rule, the launch parameters
(prefix splits, tile sizes) that keep the set of compiled kernel variants small and fixed, and a
step's plan (engine/cascade_plan.py) turned into attention metadata.

Kernel variants: a step that replays a CUDA graph uses that graph's capacity (engine/cuda_graphs.py:
groups of up to 16 rows; split counts 1 and 4 from 32 rows up, where a step may hold many
groups (one program per group and kv head fills the GPU) or few (a 2000-token prefix is best cut
in 3-5, benchmarks/h200/cascade_attention.txt); 4 below). An eager step (prompt chunks beside
decodes) passes max_group_rows 16 when every group has at most 16 rows and 128 or more
otherwise (one tile size each), and a split count of 1, 2 or 4. The runner's warm-up compiles
each of those eager variants at start, so none compiles mid-serving.

On CPU (the PyTorch path: tests, the bundled tiny model) the rule's H200 byte counts mean
nothing, and a tiny model never reaches them: there every prefix of a block or more shared by
two rows or more is a group, so served CPU traffic shows cascade rows too. Tests may replace
`rule`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from engine.cascade_plan import CascadePlanner
from engine.cuda_graphs import CASCADE_GROUP_ROWS, graph_batch_sizes
from engine.host_copy import to_device
from kernels.cascade_cost import CascadeCostRule

SPLITS = (1, 2, 4)                  # prefix split counts used, so their variants are compiled
GRAPH_SPLITS = (1, 4)               # cascade graphs per batch size from 32 rows (4 below)
LARGE_GROUP_ROWS = 128              # max_group_rows of eager steps with a group over 16 rows
# In a cascade step, a lone decode row over this many cached tokens is split through the prefix
# pass (a group of one): the own pass has one program per kv head for it, no split-KV. At ~36
# GB/s per SM, 2048 tokens of Llama-8B K/V per head take ~14 us, a sixth of a 256-row own pass.
SPLIT_LONE_FROM = 2048


def own_rows(q_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(rows of one query token, rows of more) as int32 arrays, when a step has both; else None."""
    decodes = np.flatnonzero(q_lens == 1).astype(np.int32)
    prompts = np.flatnonzero(q_lens > 1).astype(np.int32)
    return (decodes, prompts) if len(decodes) and len(prompts) else None


@dataclass
class CascadeStep:
    """One step's groups, over the rows in `order`, as the kernel takes them."""
    order: list[int]
    prefix_lens: np.ndarray         # [B] int32
    cu_group_seqs: np.ndarray       # [G + 1] int32
    max_group_rows: int             # the kernel's launch parameter (>= every group's rows)
    max_prefix_len: int
    num_prefix_splits: int
    num_cascade_rows: int
    # A step of one-row sequences beside prompt chunks: the own pass runs each kind apart, in its
    # own tiles (kernels/cascade_attention.py); their positions in `order`. None otherwise.
    own_rows: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def prompt_prefixes(self) -> bool:
        """Whether a sequence of the prompt rows (own_rows[1]) reads a group's prefix. The
        planner keeps prompt chunks longer than a prefix tile alone, so mostly not, and then
        their own pass runs without the partials' fold (kernels/cascade_attention.py)."""
        return self.own_rows is None or bool(self.prefix_lens[self.own_rows[1]].any())

    def fill_metadata(self, meta, device: torch.device) -> None:
        meta.prefix_lens = to_device(self.prefix_lens, device)
        meta.cu_group_seqs = to_device(self.cu_group_seqs, device)
        meta.max_group_rows = self.max_group_rows
        meta.max_prefix_len = self.max_prefix_len
        meta.num_prefix_splits = self.num_prefix_splits
        if self.own_rows is not None:
            meta.own_decode_seqs, meta.own_prompt_seqs = (to_device(r, device) for r in self.own_rows)
            meta.prompt_prefixes = self.prompt_prefixes

    def graph_inputs(self) -> tuple[np.ndarray, np.ndarray, int]:
        return self.prefix_lens, self.cu_group_seqs, self.num_prefix_splits


class CascadeSteps:
    def __init__(self, model_config, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int,
                 device: torch.device, enabled: bool) -> None:
        # A sliding window may not reach a prefix: such models keep the plain kernel.
        windowed = model_config.sliding_window is not None and model_config.sliding_window_layers
        self.enabled = bool(enabled) and not windowed
        self.on_gpu = device.type == "cuda"
        self.block_size = block_size
        self.dtype = dtype
        self.num_q_heads = model_config.num_attention_heads
        self.num_kv_heads = model_config.num_key_value_heads
        self.head_dim = model_config.head_dim
        self.planner = CascadePlanner(block_size)
        # The rule for this model; a test may replace it (launch details are filled in per step).
        self.rule = CascadeCostRule(self.num_q_heads, self.num_kv_heads, self.head_dim,
                                    kv_dtype_bytes=torch.empty((), dtype=kv_dtype).element_size())
        if not self.on_gpu:
            self.rule = dataclasses.replace(self.rule, min_prefix_len=block_size,
                                            min_saved_bytes=0, per_group_bytes=0)
        self._rules: dict[tuple, CascadeCostRule] = {}
        self.num_eager_steps = 0            # eager steps planned with groups (tests, GPU checks)

    # ------------------------------------------------------------------ launch parameters
    def _rows_per_tile(self, max_group_rows: int) -> int:
        if not self.on_gpu:
            return 1 << 30                  # the PyTorch path: one read per group
        from kernels.cascade_attention import prefix_rows_per_tile
        return prefix_rows_per_tile(max_group_rows, self.num_q_heads, self.num_kv_heads,
                                    self.head_dim, self.dtype)

    def _splits(self, num_groups: int, num_tiles: int, max_prefix_len: int,
                options: tuple[int, ...] = SPLITS) -> int:
        if not self.on_gpu:
            return options[0]
        from kernels.cascade_attention import choose_num_prefix_splits
        want = choose_num_prefix_splits(num_groups, num_tiles, self.num_kv_heads, max_prefix_len)
        return min(options, key=lambda s: (abs(s - want), -s))     # the nearest; ties go up

    def _rule_for(self, max_group_rows: int, splits: int) -> CascadeCostRule:
        key = (self.rule, max_group_rows, splits)
        if key not in self._rules:
            self._rules[key] = dataclasses.replace(
                self.rule, rows_per_prefix_tile=self._rows_per_tile(max_group_rows),
                num_prefix_splits=splits)
        return self._rules[key]

    def graph_splits(self, max_batch: int) -> dict[int, tuple[int, ...]] | None:
        """The prefix split counts to capture cascade graphs for, per batch size; None when
        cascade is off. On CPU (no graphs, the padded path runs eagerly) one, unused."""
        if not self.enabled:
            return None
        if not self.on_gpu:
            return {b: (1,) for b in graph_batch_sizes(max_batch) if b >= 2}
        return {b: GRAPH_SPLITS if b >= 32 else (GRAPH_SPLITS[-1],)
                for b in graph_batch_sizes(max_batch) if b >= 2}

    # ------------------------------------------------------------------ per step
    def plan(self, block_table: np.ndarray, states, counts: list[int],
             capacity: tuple[int, int, int] | None) -> CascadeStep | None:
        """states: the rows' runner states (num_computed_tokens before this step); capacity:
        the cascade graph's (max groups, rows per group, splits) for a graph step, else None."""
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, len(states))
        q_lens = np.asarray(counts, dtype=np.int32)
        if capacity is not None:
            max_groups, rows_cap, options = capacity
            # Planned at the most splits (the most partials), launched at the count that suits
            # the groups found.
            plan = self.planner.plan(block_table, starts, q_lens,
                                     self._rule_for(rows_cap, max(options)), rows_cap,
                                     max_groups, SPLIT_LONE_FROM)
            if plan is None:
                return None
            kernel_rows = rows_cap
            splits = self._splits(len(plan.cu_group_seqs) - 1, 1, plan.max_prefix_len, options)
        else:
            plan = self.planner.plan(block_table, starts, q_lens,
                                     self._rule_for(LARGE_GROUP_ROWS, 1),
                                     split_lone_from=SPLIT_LONE_FROM)
            if plan is None:
                return None
            kernel_rows = (CASCADE_GROUP_ROWS if plan.max_group_rows <= CASCADE_GROUP_ROWS
                           else max(plan.max_group_rows, LARGE_GROUP_ROWS))
            tiles = -(-plan.max_group_rows // self._rows_per_tile(kernel_rows))
            splits = self._splits(len(plan.cu_group_seqs) - 1, tiles, plan.max_prefix_len)
            self.num_eager_steps += 1
        if plan is None:
            return None
        return CascadeStep(plan.order, plan.prefix_lens, plan.cu_group_seqs, kernel_rows,
                           plan.max_prefix_len, splits, plan.num_cascade_rows,
                           own_rows(q_lens[np.asarray(plan.order)]))

    def warm_up_steps(self):
        """(q_lens, seq_lens, CascadeStep) of fake eager steps, one per kernel variant an eager
        cascade step may launch (GPU only). Their rows read block 0 and write nothing."""
        if not (self.enabled and self.on_gpu):
            return
        prefix = 2 * self.block_size
        for splits in SPLITS:
            # Decode rows, a group of 3 (16-row tile) and a lone row; a 40-token prompt chunk in a
            # group with two decodes (a 128-row tile; the own pass in decode and prompt tiles
            # apart); a lone prompt chunk beside a group of two decodes (the prompt tiles without
            # the partials' fold); prompt chunks alone (the own pass in one launch of prompt
            # tiles).
            for q_lens, kernel_rows, members in (([1, 1, 1, 1], CASCADE_GROUP_ROWS, 3),
                                                 ([1, 40, 1], LARGE_GROUP_ROWS, 3),
                                                 ([1, 1, 40], CASCADE_GROUP_ROWS, 2),
                                                 ([2, 40, 3], LARGE_GROUP_ROWS, 3)):
                n = len(q_lens)
                seq_lens = np.asarray([prefix + 8 + q for q in q_lens], dtype=np.int32)
                step = CascadeStep(
                    list(range(n)),
                    np.asarray([prefix] * members + [0] * (n - members), dtype=np.int32),
                    np.asarray([0, members], dtype=np.int32), kernel_rows, prefix, splits,
                    sum(q_lens[:members]), own_rows(np.asarray(q_lens)))
                yield np.asarray(q_lens, dtype=np.int32), seq_lens, step

