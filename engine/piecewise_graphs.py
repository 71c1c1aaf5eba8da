"""Steps with prompt chunks (mixed with decode rows or not) replayed from CUDA graphs cut at
attention.

A decode-only step replays one graph (engine/cuda_graphs.py). A step holding prompt chunks ran
eagerly: some 650 kernel launches, 10-18 ms of host time on the H200 machine whatever the batch
(engine/step_timing.py, scripts/profile_step.py), the GPU waiting for the host whenever the
step's own work is shorter. Behind a server nearly every busy step is such a step: requests
arrive one by one, so most steps carry someone's prompt.

Everything in a layer but attention depends on the step only through its token count, so the
forward is captured per padded token count (`token_sizes`) as num_layers + 1 graphs cut where
each layer's attention runs: a piece ends after the layer's KV write and a copy of q into a
buffer of its own, attention runs eagerly (its grid follows the step's sequences and their
lengths), and the next piece starts from attention's output buffer. The cut is made while the
model runs once under capture: each layer's attention backend is swapped for one that ends the
current graph and begins the next, so the model's code knows nothing of it.

A step with shared-prefix groups (engine/cascade_plan.py) runs through the same pieces: its
attention, eager, is cascade attention, into the same output buffer.

Padding tokens (up to the captured size) write no KV (slot -1) and are past cu_seqlens_q[-1],
where attention (plain or cascade) writes zeros; their logits are never read. Without CUDA (or with
`enforce_eager`) there are no pieces: the runner runs such steps eagerly.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.host_copy import copy_into
from engine.models.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def token_sizes(max_tokens: int) -> list[int]:
    """Captured token counts up to max_tokens (EngineConfig.piecewise_graph_max_tokens, at most
    the step budget): every 32 to 512, every 64 after. (Steps over 1,024 tokens used to run
    eagerly, on the thought that their GPU time hid the launches. With shared-prefix groups in
    most steps and arrivals spread, in process on the H200, pieces up to 2,048 tokens gave
    21.9% more tokens a second; served on two H200s, where the steps were GPU-bound, the same
    as before: benchmarks/h200x2/served_shared_prefix.md.)"""
    top = max_tokens
    sizes = [s for s in range(32, min(top, 512) + 1, 32)]
    sizes += [s for s in range(576, top + 1, 64)]
    if not sizes or sizes[-1] < top:
        sizes.append(top)
    return sizes


class PiecewiseGraphs:
    def __init__(self, model, kv_caches, max_tokens: int, device: torch.device,
                 backend: AttentionBackend) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.backend = backend                 # the real one, for the eager attention
        self.sizes = token_sizes(max_tokens)
        cfg = model.config
        top = self.sizes[-1]
        i64 = torch.int64
        self.input_ids = torch.zeros(top, dtype=i64, device=device)
        self.positions = torch.zeros(top, dtype=i64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=i64, device=device)
        dtype = model.embed_tokens.weight.dtype
        shape = (top, cfg.num_attention_heads, cfg.head_dim)
        self.q = torch.zeros(shape, dtype=dtype, device=device)      # a layer's q, after rotary
        self.out = torch.zeros(shape, dtype=dtype, device=device)    # its attention output
        # Per size: the pieces, each layer's (k_cache, v_cache, scale, window), the hidden out.
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.layers: list[tuple] = []
        self.hidden: dict[int, torch.Tensor] = {}
        self._pool = None
        self._capturing: list[torch.cuda.CUDAGraph] | None = None
        self.num_runs = 0
        self.num_cascade_runs = 0              # of them, steps with shared-prefix groups

    def padded_size(self, num_tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= num_tokens), None)

    # ------------------------------------------------------------------ capture
    def _begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._capturing.append(graph)

    def _end_piece(self) -> None:
        self._capturing[-1].capture_end()

    def _cut_backend(self, size: int, record_layers: bool) -> AttentionBackend:
        def cut(q, k_cache, v_cache, attn, scale, sliding_window, out=None):
            self.q[:size].copy_(q)
            self._end_piece()
            if record_layers:
                self.layers.append((k_cache, v_cache, scale, sliding_window))
            self._begin_piece()
            return self.out[:size]
        return AttentionBackend("piecewise-capture", self.backend.write_kv, cut,
                                self.backend.rotary_write_kv)

    def _attention_modules(self):
        return [layer.self_attn.attn for layer in self.model.layers]

    def _static_metadata(self, size: int) -> AttentionMetadata:
        """What the warm-up runs: one sequence of `size` tokens over block 0, writing nothing."""
        dev = self.device
        block_size = self.kv_caches[0][0].shape[1]
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_table=torch.zeros(1, -(-size // block_size), dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, size], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([size], dtype=torch.int32, device=dev),
            max_seqlen_q=size, max_seqlen_k=size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Per size, largest first: one eager warm-up forward (autotuning, lazy init), then the
        forward once more under capture, cut at every attention."""
        self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        modules = self._attention_modules()
        for size in reversed(self.sizes):
            meta = self._static_metadata(size)
            with torch.cuda.stream(stream):
                self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            torch.cuda.synchronize(self.device)
            self._capturing = []
            cut = self._cut_backend(size, record_layers=not self.layers)
            try:
                for m in modules:
                    m.backend = cut
                with torch.cuda.stream(stream):
                    self._begin_piece()
                    hidden = self.model(self.input_ids[:size], self.positions[:size],
                                        self.kv_caches, meta)
                    self._end_piece()
            finally:
                for m in modules:
                    m.backend = self.backend
            self.pieces[size] = self._capturing
            self.hidden[size] = hidden
            self._capturing = None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        assert all(len(p) == len(self.layers) + 1 for p in self.pieces.values())
        logger.info("captured piecewise CUDA graphs for token counts %s", self.sizes)

    # ------------------------------------------------------------------ replay
    @torch.inference_mode()
    def run(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
            meta: AttentionMetadata,
            input_fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's hidden states [T, hidden] (after the final norm). meta: the step's own
        (its sequences, on the device); its slot_mapping is not used (the pieces write KV
        through the padded buffer). input_fill: as DecodeGraphs.run's."""
        n = len(input_ids)
        size = self.padded_size(n)
        copy_into(self.input_ids[:n], input_ids)
        if input_fill is not None:
            self.input_ids.index_copy_(0, *input_fill)
        copy_into(self.positions[:n], positions)
        copy_into(self.slot_mapping[:n], slot_mapping)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.positions[n:size].fill_(0)
        pieces = self.pieces[size]
        q, out = self.q[:size], self.out[:size]
        for piece, (k_cache, v_cache, scale, window) in zip(pieces, self.layers):
            piece.replay()
            self.backend.paged_attention(q, k_cache, v_cache, meta, scale, window, out=out)
        pieces[-1].replay()
        self.num_runs += 1
        self.num_cascade_runs += meta.is_cascade
        return self.hidden[size][:n]
