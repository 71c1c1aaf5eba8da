"""Decode-only steps replayed from CUDA graphs captured at fixed batch sizes.

At small batches a decode step is a few hundred small kernels; launching them one by one costs
more than running them. A graph per batch size (1, 2, 4, 8, then multiples of 8) is captured
once at start-up over persistent input buffers; a step copies its inputs into the buffers
(padded to the next captured size) and replays. Padding rows write no KV (slot -1) and attend
to one position of block 0, so they cost little and touch nothing.

Without CUDA (or with `enforce_eager`) the same buffers and padding run eagerly: that is how the
padding logic is tested on CPU.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks_per_seq: int,
                 max_seqlen_k: int, device: torch.device, use_graphs: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self.max_seqlen_k = max_seqlen_k
        self.device = device
        self.use_graphs = use_graphs
        self.sizes = graph_batch_sizes(max_batch)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)
        self.positions = torch.zeros(max_batch, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=i64, device=device)
        self.block_table = torch.zeros(max_batch, max_blocks_per_seq, dtype=i32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=i32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def _metadata(self, batch: int, max_seqlen_k: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], block_table=self.block_table[:batch],
            cu_seqlens_q=self.cu_seqlens_q[:batch + 1], seq_lens=self.seq_lens[:batch],
            max_seqlen_q=1, max_seqlen_k=max_seqlen_k)

    def _forward(self, batch: int, max_seqlen_k: int | None = None) -> torch.Tensor:
        """A graph must hold for any length, so it is captured for max_model_len; an eager run
        can use the step's own longest sequence."""
        meta = self._metadata(batch, max_seqlen_k or self.max_seqlen_k)
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per batch size, largest first so smaller ones reuse its memory."""
        if not self.use_graphs:
            return
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # The persistent buffers and the KV cache were filled by kernels queued on the current
        # stream; the side stream must not read them before those ran. Without this wait the
        # warm-up read a block table still holding whatever the caching allocator's block held
        # (a previous engine's data): "index out of bounds" in the embedding/KV gathers.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for batch in reversed(self.sizes):
            with torch.cuda.stream(stream):
                for _ in range(2):                 # warm up: autotuning, lazy init
                    self._forward(batch)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                logits = self._forward(batch)
            self.graphs[batch] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    @torch.inference_mode()
    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            block_table: np.ndarray, seq_lens: np.ndarray) -> torch.Tensor:
        """One decode row per request (batch B); returns logits [B, V]."""
        batch = len(input_ids)
        size = next(s for s in self.sizes if s >= batch)
        width = block_table.shape[1]
        self.input_ids[:batch].copy_(torch.from_numpy(input_ids), non_blocking=True)
        self.positions[:batch].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:batch].copy_(torch.from_numpy(slot_mapping), non_blocking=True)
        self.block_table[:batch, :width].copy_(torch.from_numpy(block_table), non_blocking=True)
        self.seq_lens[:batch].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        if size > batch:                           # padding rows: write nothing, read little
            self.slot_mapping[batch:size].fill_(-1)
            self.seq_lens[batch:size].fill_(1)
            self.block_table[batch:size, 0].fill_(0)
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:batch]
        return self._forward(size, int(seq_lens.max()))[:batch]
