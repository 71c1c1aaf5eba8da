"""Decode-only steps replayed from CUDA graphs captured at fixed batch sizes.

At small batches a decode step is a few hundred small kernels; launching them one by one costs
more than running them. A graph per batch size (1, 2, 4, 8, then multiples of 8) is captured
once at start-up over persistent input buffers; a step copies its inputs into the buffers
(padded to the next captured size) and replays. Padding rows write no KV (slot -1) and attend
to one position of block 0, so they cost little and touch nothing.

Without CUDA (or with `enforce_eager`) the same buffers and padding run eagerly: that is how the
padding logic is tested on CPU.

Cascade attention (shared-prefix groups, engine/cascade_plan.py) has more graphs per batch size
(2 and up), captured over fixed capacities: up to size // 2 groups (a group has two members or
more) of up to CASCADE_GROUP_ROWS rows each (one 64-row prefix tile in bf16 GQA-4: the tile size
measured for groups of 16; larger groups are split), one graph per prefix split count the
runner may pick for that size (few groups want their prefixes cut in more programs than many
do). Unused group slots repeat the last boundary (empty groups), padding rows have prefix 0.
The runner plans each decode step within the capacity of the size it will replay and picks the
plain graph or a cascade one by the cost rule.

Split-KV: at small batches attention cuts each sequence's keys into pieces to fill the SMs
(kernels/paged_attention.py), and a graph fixes how many. Captured for max_model_len alone, a
lone 300-token sequence ran 32 splits and a merge in every layer (5.13 ms/token at
max_model_len 8192 against 4.72 at 320 on the H200). So a size gets a plain graph per split
count that the context lengths in KV_SPLIT_CONTEXTS (and max_model_len) call for, and a step
replays the one its longest sequence calls for (`decode_kv_splits`). With kv_merge_in_kernel
(EngineConfig.fuse_kv_split_merge, the default) the splits merge inside the attention kernel
and `choose_fused_kv_splits` counts them: about two programs per SM, one 64-key step a split
at least, 16 at most (8 KV heads: batch 1 replays 8 splits up to 511 keys and 16 beyond, batch 4
8 or 9, batch 16 three, from 33 rows one). Without it `choose_num_kv_splits` does, for the
separate merge kernel: one split under 512 keys, from about 33 rows every length one split.

PDL (EngineConfig.decode_pdl, kernels/pdl.py): graphs of up to PDL_MAX_ROWS rows launch the
model's Triton kernels with programmatic dependent launch (each placed while the one ahead
still runs) and run every projection as the skinny GEMM (a cuBLAS kernel would break the chain).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.host_copy import copy_into
from engine.models.attention import AttentionMetadata
from kernels.paged_attention import choose_fused_kv_splits, choose_num_kv_splits
from kernels.skinny_gemm import MAX_ROWS as PDL_MAX_ROWS

logger = logging.getLogger(__name__)


CASCADE_GROUP_ROWS = 16
_WHOLE_TABLE_ROWS_BYTES = 64 << 10     # block-table rows a decode step copies whole, at most
# Longest contexts of each plain-graph variant: one under 512 * 2^k, the most keys for which
# choose_num_kv_splits (256 keys a split at least) still picks the smaller count.
KV_SPLIT_CONTEXTS = tuple(512 * 2**k - 1 for k in range(7))       # 511 ... 32767


def split_contexts(max_seqlen_k: int) -> list[int]:
    """The context bounds plain decode graphs are captured for, under max_seqlen_k."""
    return [c for c in KV_SPLIT_CONTEXTS if c < max_seqlen_k] + [max_seqlen_k]


def decode_kv_splits(size: int, num_kv_heads: int, context: int, merge_in_kernel: bool) -> int:
    """The split-KV count of the plain graph for `size` rows whose longest sequence has up to
    `context` keys (one of split_contexts)."""
    if merge_in_kernel:
        return choose_fused_kv_splits(size, num_kv_heads, context)
    return choose_num_kv_splits(size, num_kv_heads, context)


def cascade_max_groups(size: int) -> int:
    return max(1, size // 2)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks_per_seq: int,
                 max_seqlen_k: int, device: torch.device, use_graphs: bool,
                 cascade_splits: dict[int, tuple[int, ...]] | None = None,
                 kv_merge_in_kernel: bool = False, pdl: bool = False) -> None:
        """cascade_splits: per batch size, the prefix split counts to capture cascade graphs
        for; None: no cascade graphs. kv_merge_in_kernel: plain graphs merge attention's
        splits inside its kernel (and count them by that rule). pdl: sizes up to PDL_MAX_ROWS
        launch with programmatic dependent launch (the caller checks the GPU has it)."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self.max_seqlen_k = max_seqlen_k
        self.device = device
        self.use_graphs = use_graphs
        self.sizes = graph_batch_sizes(max_batch)
        i32, i64 = torch.int32, torch.int64
        # Input ids, positions and slots are rows of one buffer: a step fills them (padding
        # included) with one copy (`run`).
        self._rows = torch.zeros(3, max_batch, dtype=i64, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._rows.unbind()
        self.slot_mapping.fill_(-1)
        self.block_table = torch.zeros(max_batch, max_blocks_per_seq, dtype=i32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=i32, device=device)
        # (size, KV splits) -> graph and its logits
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_kv_heads = model.config.num_key_value_heads
        self.kv_merge_in_kernel = kv_merge_in_kernel
        self.pdl = pdl
        self.contexts = split_contexts(max_seqlen_k)
        self._pool = None
        self.cascade_splits = {b: s for b, s in (cascade_splits or {}).items()
                               if b in self.sizes and b >= 2}
        self.prefix_lens = torch.zeros(max_batch, dtype=i32, device=device)
        self.cu_group_seqs = torch.zeros(cascade_max_groups(max_batch) + 1, dtype=i32,
                                         device=device)
        self.cascade_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_cascade_runs = 0
        # Every graph writes its logits here (made at capture). A graph's own output would stay
        # allocated in the pool for as long as the graph: one [size, vocab] float32 tensor per
        # captured size, 8.5 GiB at max_num_seqs 512 and 34 GiB at 1024 for a 128k vocabulary,
        # memory the KV cache had been given (the capture ran out of memory). It holds them in
        # the model's dtype: the sampler converts them to float32 only where its math needs it
        # (greedy rows with no penalty or logprobs take the argmax as they are), so a step of 256
        # rows and a 128k vocabulary writes and reads 66 MB of logits, not 66 + 131 + 131.
        self.logits: torch.Tensor | None = None

    def kv_splits(self, size: int, max_seqlen_k: int) -> int:
        """The split-KV count of the plain graph a step of `size` rows replays when its longest
        sequence has max_seqlen_k keys: what the next captured context length calls for."""
        context = next(c for c in self.contexts if c >= max_seqlen_k)
        return decode_kv_splits(size, self.num_kv_heads, context, self.kv_merge_in_kernel)

    def kv_split_variants(self, size: int) -> list[int]:
        """The split-KV counts captured for a size, largest first."""
        return sorted({self.kv_splits(size, c) for c in self.contexts}, reverse=True)

    def _metadata(self, batch: int, max_seqlen_k: int, splits: int | None,
                  kv_splits: int | None = None) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], block_table=self.block_table[:batch],
            cu_seqlens_q=self.cu_seqlens_q[:batch + 1], seq_lens=self.seq_lens[:batch],
            max_seqlen_q=1, max_seqlen_k=max_seqlen_k, num_kv_splits=kv_splits,
            kv_merge_in_kernel=self.kv_merge_in_kernel and splits is None,
            launch_pdl=self.pdl and batch <= PDL_MAX_ROWS)
        if splits is not None:
            meta.prefix_lens = self.prefix_lens[:batch]
            meta.cu_group_seqs = self.cu_group_seqs[:cascade_max_groups(batch) + 1]
            meta.max_group_rows = min(CASCADE_GROUP_ROWS, batch)
            meta.max_prefix_len = self.max_seqlen_k
            meta.num_prefix_splits = splits
        return meta

    def _forward(self, batch: int, max_seqlen_k: int | None = None,
                 splits: int | None = None, kv_splits: int | None = None) -> torch.Tensor:
        """A graph must hold for any length, so it is captured for max_model_len; an eager run
        can use the step's own longest sequence. splits: cascade with that many prefix splits;
        kv_splits: a plain graph's split-KV count (None: the kernel picks)."""
        meta = self._metadata(batch, max_seqlen_k or self.max_seqlen_k, splits, kv_splits)
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
        return self.model.compute_logits(
            hidden, out=None if self.logits is None else self.logits[:batch], pdl=meta.launch_pdl)

    def padded_size(self, batch: int) -> int:
        return next(s for s in self.sizes if s >= batch)

    def cascade_capacity(self, batch: int) -> tuple[int, int, tuple[int, ...]] | None:
        """(max groups, max rows per group, prefix split counts) of the cascade graphs a decode
        step of `batch` rows may replay; None: no cascade graph for it."""
        size = self.padded_size(batch)
        if size not in self.cascade_splits:
            return None
        return cascade_max_groups(size), min(CASCADE_GROUP_ROWS, size), self.cascade_splits[size]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per batch size, largest first so smaller ones reuse its memory."""
        if not self.use_graphs:
            return
        self._pool = torch.cuda.graph_pool_handle()
        self.logits = torch.empty(self.max_batch, self.model.config.vocab_size,
                                  dtype=self.model.embed_tokens.weight.dtype, device=self.device)
        stream = torch.cuda.Stream(self.device)
        # The persistent buffers and the KV cache were filled by kernels queued on the current
        # stream; the side stream must not read them before those ran. Without this wait the
        # warm-up read a block table still holding whatever the caching allocator's block held
        # (a previous engine's data): "index out of bounds" in the embedding/KV gathers.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        todo = [(b, None, k) for b in reversed(self.sizes) for k in self.kv_split_variants(b)]
        todo += [(b, s, None) for b in reversed(self.sizes)
                 for s in self.cascade_splits.get(b, ())]
        for batch, splits, kv_splits in todo:
            with torch.cuda.stream(stream):
                for _ in range(2):                 # warm up: autotuning, lazy init
                    self._forward(batch, splits=splits, kv_splits=kv_splits)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                logits = self._forward(batch, splits=splits, kv_splits=kv_splits)
            if splits is None:
                self.graphs[batch, kv_splits] = (graph, logits)
            else:
                self.cascade_graphs[batch, splits] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s (split-KV variants %s), "
                    "cascade for %s", self.sizes,
                    {b: v for b in self.sizes if len(v := self.kv_split_variants(b)) > 1},
                    sorted(self.cascade_graphs))

    def _copy_inputs(self, batch: int, size: int, input_ids: np.ndarray, positions: np.ndarray,
                     slot_mapping: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """The step's rows into the persistent buffers, padding rows (batch..size: token 0 at
        position 0, no KV write, one key of block 0) included, in as few copies as the shapes
        allow: at small batches each copy costs the GPU a few microseconds of a step of a few
        milliseconds. Every row of _rows and seq_lens is copied (bytes per row); the block
        table's whole rows where they are few (a copy into a narrower, strided region of it is a
        copy and a kernel), else its first `width` columns and a fill of the padding rows."""
        rows = np.zeros((3, self.max_batch), dtype=np.int64)
        rows[2] = -1
        rows[0, :batch], rows[1, :batch], rows[2, :batch] = input_ids, positions, slot_mapping
        copy_into(self._rows, rows)
        lens = np.ones(self.max_batch, dtype=np.int32)
        lens[:batch] = seq_lens
        copy_into(self.seq_lens, lens)
        width = block_table.shape[1]
        if size * self.block_table.stride(0) * 4 <= _WHOLE_TABLE_ROWS_BYTES:
            table = np.zeros((size, self.block_table.shape[1]), dtype=np.int32)
            table[:batch, :width] = block_table
            copy_into(self.block_table[:size], table)
        else:
            copy_into(self.block_table[:batch, :width], block_table)
            if size > batch:
                self.block_table[batch:size, 0].fill_(0)

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    @torch.inference_mode()
    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            block_table: np.ndarray, seq_lens: np.ndarray,
            cascade: tuple[np.ndarray, np.ndarray, int] | None = None,
            input_fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One decode row per request (batch B); returns logits [B, V]. cascade: the rows'
        prefix_lens [B], cu_group_seqs [G + 1] and the prefix splits, within
        `cascade_capacity(B)`. input_fill: (rows, token ids) on the device, input ids the host
        does not have yet (tokens the previous step sampled: async scheduling)."""
        batch = len(input_ids)
        size = self.padded_size(batch)
        self._copy_inputs(batch, size, input_ids, positions, slot_mapping, block_table, seq_lens)
        if input_fill is not None:
            self.input_ids.index_copy_(0, *input_fill)
        max_len = int(seq_lens.max())
        kv_splits = self.kv_splits(size, max_len)
        graph_key, graphs, splits = (size, kv_splits), self.graphs, None
        if cascade is not None:
            prefix_lens, cu_groups, splits = cascade
            capacity = cascade_max_groups(size)
            assert len(cu_groups) - 1 <= capacity, (len(cu_groups), capacity)
            cu = np.full(capacity + 1, cu_groups[-1], dtype=np.int32)   # empty groups after
            cu[:len(cu_groups)] = cu_groups
            copy_into(self.cu_group_seqs[:capacity + 1], cu)
            copy_into(self.prefix_lens[:batch], prefix_lens)
            self.prefix_lens[batch:size].fill_(0)
            graph_key, graphs = (size, splits), self.cascade_graphs
            self.num_cascade_runs += 1
        if graph_key in graphs:
            graph, logits = graphs[graph_key]
            graph.replay()
            return logits[:batch]
        return self._forward(size, max_len, splits, kv_splits if splits is None else None)[:batch]
