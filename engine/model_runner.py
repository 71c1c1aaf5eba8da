"""Turns a SchedulerOutput into one forward pass and a sampled token per finished-prefill row.

The runner keeps each request's state (token ids, block table) between steps, so the
scheduler only sends what changed. Start-up is named steps: load the model, size the KV
cache, allocate it.

A step is `launch` (inputs built and handed to the GPU, sampled tokens copied back
asynchronously) then `collect` (wait for them, append them). With async scheduling the engine
core launches step N+1 before it collects step N: a row whose input is the token step N is
still sampling takes it on the GPU from step N's sampled tensor (`input_fill`), and nothing in
a launch waits for the GPU (engine/host_copy.py).

Rows whose block tables start with the same blocks share a prefix: each step the runner may
regroup its rows so that such groups are consecutive and run cascade attention over them
(engine/cascade_step.py decides, by the cost rule); the sampled tokens go back in the
scheduler's row order.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.cascade_step import CascadeStep, CascadeSteps
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.gemm_tuning import tune_skinny_gemms
from engine.host_copy import list_to_device, to_device, to_host
from engine.piecewise_graphs import PiecewiseGraphs
from engine.models.attention import TORCH_BACKEND, AttentionMetadata, triton_backend
from engine.models.loader import load_model
from engine.penalty_rows import SINK as PENALTY_SINK, PenaltyRows
from engine.sampler import RowControls, Sampler, SamplingMetadata, bad_word_bans
from engine.sampling_params import SamplingParams
from engine.scheduler import ModelRunnerOutput, SchedulerOutput
from engine.step_timing import StepTimes
from kernels.pdl import supported as pdl_supported
from kernels.race_sample import warm_up as race_sample_warm_up

logger = logging.getLogger(__name__)


@dataclass
class _StepInputs:
    """One step's inputs on the host: T tokens of B requests."""
    input_ids: np.ndarray       # [T] int64
    positions: np.ndarray       # [T] int64
    slot_mapping: np.ndarray    # [T] int64
    q_lens: np.ndarray          # [B] int32, new tokens per request
    seq_lens: np.ndarray        # [B] int32, context length including them
    block_table: np.ndarray     # [B, max_blocks] int32
    sampled_rows: list[int]     # requests that get a new token this step
    sampled_ids: list[str]
    cascade: CascadeStep | None = None     # shared-prefix groups over the rows (in this order)
    # Rows reordered (cascade groups, or decode rows first): sampled row k was the scheduler's
    # sampled_positions[k]-th row.
    sampled_positions: list[int] | None = None
    num_decodes: int = 0        # leading rows with one query token each
    # Input tokens the host does not have yet (sampled by the step in flight): input_ids
    # index -> row of that step's sampled tensor.
    fill_at: list[int] | None = None
    fill_from: list[int] | None = None


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not been collected (ModelRunner.collect)."""
    states: list["_RunnerRequest"]      # the sampled rows' states, in sampled-tensor order
    x: _StepInputs
    tokens: torch.Tensor | None         # host copy of the sampled ids (filled once `done`)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None   # host copies too
    done: torch.cuda.Event | None       # recorded after the copies; None on CPU
    events: tuple | None                # (start, end) CUDA events when timing the GPU
    prev_events: tuple | None           # the step before's (start, end), if timed
    num_cascade_rows: int
    graph: bool                         # CUDA graphs: the decode graph or the cut ones
    piecewise: bool = False             # the cut ones (prompt chunks in the step)
    output: ModelRunnerOutput | None = None


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    table_row: int = 0          # its row in the runner's _BlockTables
    num_pending: int = 0        # sampled tokens not collected yet (at most one step's)
    pending_row: int = 0        # this request's row in the last sampled tensor
    penalty_row: int = PENALTY_SINK     # its row in the runner's PenaltyRows (penalties only)
    controls: RowControls | None = None     # logit_bias / allowed_token_ids on the device

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


class _BlockTables:
    """The block ids of every request the runner holds, a numpy row each, kept between steps:
    a step gathers its rows in one call instead of filling a new table row by row (3 ms a step
    at 1024 rows of 125 blocks on the CPU machine). Past a request's blocks a row holds 0, as
    a new table did. Rows and columns grow as needed."""

    def __init__(self) -> None:
        self.table = np.zeros((16, 64), dtype=np.int32)
        self.free = list(range(15, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        if not self.free:
            n = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        row = self.free.pop()
        self.put(row, 0, block_ids)
        return row

    def put(self, row: int, start: int, block_ids: list[int]) -> None:
        """table[row, start:start + len(block_ids)] = block_ids."""
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            width = max(end, 2 * self.table.shape[1])
            grown = np.zeros((len(self.table), width), dtype=np.int32)
            grown[:, :self.table.shape[1]] = self.table
            self.table = grown
        self.table[row, start:end] = block_ids

    def remove(self, row: int, num_blocks: int) -> None:
        self.table[row, :num_blocks] = 0
        self.free.append(row)

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        return self.table[rows, :width]


def _require_capability(setting: str, value, minimum: tuple[int, int], device: torch.device,
                        instead: str) -> None:
    """A setting that runs on a GPU only from compute capability `minimum` (and on CPU)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < minimum:
        raise ValueError(f"{setting} {value!r} needs a GPU of compute capability {minimum[0]}.{minimum[1]} or "
                         f"higher, {torch.cuda.get_device_name(device)} has "
                         f"{torch.cuda.get_device_capability(device)}; use {instead}")


def kv_cache_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type for EngineConfig.kv_cache_dtype: the model's, or FP8 e4m3
    (on a GPU only from compute capability 8.9, where Triton has the type)."""
    if setting == "auto":
        return model_dtype
    _require_capability("kv_cache_dtype", setting, (8, 9), device, "'auto'")
    return torch.float8_e4m3fn


def check_quantization(setting: str | None, device: torch.device) -> str | None:
    """EngineConfig.quantization where it can run: FP8 weights on a GPU only from compute
    capability 9.0 (torch._scaled_mm's row-wise scales)."""
    if setting is not None:
        _require_capability("quantization", setting, (9, 0), device, "None")
    return setting


# Of the GPU, what a setting that an error names leaves free beside the KV cache: room for
# the CUDA graphs captured after it.
SUGGESTION_HEADROOM = 0.02


def kv_cache_blocks(total: int, free: int, reserved: int, allocated: int, peak: int,
                    utilization: float, block_bytes: int) -> int:
    """The KV cache's blocks on a GPU of `total` bytes, as vLLM V1 sizes it:
    `gpu_memory_utilization` is the share of the GPU this engine may use, for its weights and
    activations (`peak`, PyTorch's peak allocation in the profiling pass, the weights in it)
    and its KV cache. Other processes' use does not count against it, so two engines on one
    GPU (each its own process, as Triton's instances are) at 0.45 each both fit. The memory
    must be there: what is free, and what PyTorch holds for this process unallocated
    (`reserved` - `allocated`); where other processes hold the rest, the error names the most
    the setting can be (leaving SUGGESTION_HEADROOM free), or that none leaves room. (The CUDA
    context and the CUDA graphs captured afterwards come out of the share left over, as in
    vLLM.)"""
    gib = 2 ** 30
    budget = int(total * utilization) - peak
    if budget < block_bytes:
        raise RuntimeError(
            f"no memory left for the KV cache: gpu_memory_utilization {utilization:g} gives "
            f"this engine {total * utilization / gib:.2f} GiB of the GPU's {total / gib:.2f}, "
            f"and its weights and activations take {peak / gib:.2f}: raise "
            f"gpu_memory_utilization or lower max_num_batched_tokens")
    available = free + reserved - allocated
    if budget > available:
        others = total - free - reserved
        most = int(100 * (available + peak - SUGGESTION_HEADROOM * total) / total) / 100
        if int(total * most) - peak >= block_bytes:
            advice = f"lower gpu_memory_utilization to at most {most:.2f}, or set num_kv_blocks"
        else:
            advice = ("no gpu_memory_utilization leaves this engine room for a KV cache beside "
                      "them: free the GPU of other processes")
        raise RuntimeError(
            f"gpu_memory_utilization {utilization:g} leaves this engine's KV cache "
            f"{budget / gib:.2f} GiB, but only {available / gib:.2f} GiB of the GPU's "
            f"{total / gib:.2f} is free ({others / gib:.2f} GiB is held by other processes "
            f"and this one's CUDA context): {advice}")
    return budget // block_bytes


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 eos_token_ids: list[int]) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, device)
        self.block_size = config.block_size
        self.times = StepTimes()        # the engine core shares it (engine/step_timing.py)
        self.eos_token_ids = list(eos_token_ids)
        # CUDA: Triton kernels for attention and the small layers; CPU: PyTorch.
        on_gpu = device.type == "cuda"
        self.model, self.model_config = load_model(
            config.model, dtype, device, config.load_format,
            attention_backend=triton_backend() if on_gpu else TORCH_BACKEND,
            fused_kernels=on_gpu, fuse_rope_kv_write=config.fuse_rope_kv_write,
            quantization=check_quantization(config.quantization, device))
        # Decode-sized projections run cuBLAS or the Triton skinny GEMM, whichever a start-up
        # timing found faster for their shape and row count (before any graph is captured).
        self.model.late_merge = config.decode_late_merge    # (the timing times the chain's form)
        self.gemm_report: list[dict] = []
        if on_gpu and config.skinny_gemm == "auto":
            self.gemm_report = tune_skinny_gemms(self.model, device)
        self.sampler = Sampler(seed=config.seed)
        self.requests: dict[str, _RunnerRequest] = {}
        self.block_tables = _BlockTables()
        self.penalties: PenaltyRows | None = None       # made for the first request with penalties
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None     # steps with prompt chunks (CUDA only)
        self.cascade = CascadeSteps(self.model_config, dtype, self.kv_dtype, self.block_size, device,
                                    enabled=config.enable_cascade_attention)
        self._last_sampled: torch.Tensor | None = None   # the last step's sampled ids (device)
        self._uncollected: _InFlight | None = None       # the last launched step, if pending
        self._last_events = None                         # its (start, end) (GPU timing)

    # ------------------------------------------------------------------ start-up
    @property
    def block_bytes(self) -> int:
        mc = self.model_config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * elem

    def determine_num_blocks(self) -> int:
        """Blocks that fit in the memory left for KV: on GPU, what `gpu_memory_utilization`
        leaves after a profiling forward pass at full batch (kv_cache_blocks); on CPU,
        `cpu_kv_cache_gb`."""
        if self.device.type != "cuda":
            return max(1, int(self.config.cpu_kv_cache_gb * 2**30) // self.block_bytes)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        num_blocks = kv_cache_blocks(total_bytes, free_bytes, reserved,
                                     torch.cuda.memory_allocated(self.device), peak,
                                     self.config.gpu_memory_utilization, self.block_bytes)
        logger.info("KV cache: %.2f GiB for %d blocks (weights and peak activation %.2f GiB)",
                    num_blocks * self.block_bytes / 2**30, num_blocks, peak / 2**30)
        return num_blocks

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """A forward pass of `max_num_batched_tokens` prompt tokens, to measure peak memory."""
        num_tokens = self.config.max_num_batched_tokens
        num_blocks = -(-num_tokens // self.block_size)
        caches = self._new_caches(num_blocks)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_table=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            max_seqlen_q=num_tokens, max_seqlen_k=num_tokens)
        # Positions past the model's rotary tables (a step budget above its context length)
        # would be read out of bounds by the rotary kernels; their values do not change the
        # memory measured.
        positions = torch.arange(num_tokens, device=self.device) % (
            self.model_config.max_context_len)
        hidden = self.model(ids, positions, caches, meta)
        rows = min(self.config.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[:rows])
        del caches, hidden

    def _new_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.model_config
        shape = (num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        return [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                for _ in range(mc.num_hidden_layers)]

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.num_blocks = num_blocks
        try:
            self.kv_caches = self._new_caches(num_blocks)
        except torch.OutOfMemoryError as e:     # another engine on this GPU took it since
            raise RuntimeError(
                f"the KV cache ({num_blocks} blocks, {num_blocks * self.block_bytes / 2**30:.2f}"
                f" GiB) does not fit in the GPU's free memory: other processes on this GPU "
                f"took memory since it was sized; lower gpu_memory_utilization (the settings "
                f"of the engines on one GPU must leave room for each other) or set "
                f"num_kv_blocks") from e
        if not self.config.enforce_eager:
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, self.config.max_num_seqs,
                -(-max_model_len // self.block_size), max_model_len, self.device,
                use_graphs=self.device.type == "cuda",
                cascade_splits=self.cascade.graph_splits(self.config.max_num_seqs),
                kv_merge_in_kernel=self.config.fuse_kv_split_merge,
                pdl=self.config.decode_pdl and pdl_supported(self.device))
            self.decode_graphs.capture()
            piecewise_tokens = min(self.config.max_num_batched_tokens,
                                   self.config.piecewise_graph_max_tokens)
            if self.device.type == "cuda" and piecewise_tokens > 0:
                self.piecewise = PiecewiseGraphs(
                    self.model, self.kv_caches, piecewise_tokens, self.device,
                    self.model.layers[0].self_attn.attn.backend)
                self.piecewise.capture()
        if self.device.type == "cuda":
            self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Runs, once, what the first traffic would otherwise compile or initialize in the
        middle of serving: an eager step holding prompt chunks and a decode row (the mixed
        steps of chunked prefill; decode-only steps replay the graphs captured above), and the
        sampler's greedy and random paths (top-k/p, penalties, seeded rows). It writes no
        KV (slot -1) and reads block 0, as graph padding does."""
        # Ordered as _prepare_inputs orders a mixed step: the decode row first, run apart from
        # the prompt chunks (AttentionMetadata.num_decodes).
        q_lens = np.array([1, 17, 40], dtype=np.int32)
        seq_lens = np.array([6, 17, 40], dtype=np.int32)
        positions = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
        x = _StepInputs(np.zeros(len(positions), dtype=np.int64), positions.astype(np.int64),
                        np.full(len(positions), -1, dtype=np.int64), q_lens, seq_lens,
                        np.zeros((3, 4), dtype=np.int32), [0, 1, 2], ["a", "b", "c"],
                        num_decodes=1)
        logits = self._forward_eager(x)
        params = [SamplingParams(temperature=0.0),
                  SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1,
                                 repetition_penalty=1.1, presence_penalty=0.1,
                                 frequency_penalty=0.1),
                  SamplingParams(temperature=1.0, logprobs=2)]
        rows = PenaltyRows(self.model_config.vocab_size, self.device, capacity=2)   # as launch runs them
        counts, seen, index = rows.rows_for([PENALTY_SINK, rows.add([1, 2], [3]), PENALTY_SINK])
        meta = SamplingMetadata.from_params(params, [[]] * 3, None, self.eos_token_ids, self.device, [1] * 3,
                                            output_counts=counts, prompt_seen=seen)
        rows.record(index, self.sampler(logits, meta).sampled_token_ids)
        # Decode graphs hand over logits in the model's dtype; greedy rows take their argmax so.
        greedy = SamplingMetadata.from_params(params[:1], [[1, 2]], [[3]], self.eos_token_ids,
                                              self.device)
        self.sampler(logits[:1].to(self.dtype), greedy)
        # The race's other config, and the model's dtype (decode graphs' logits) beside fp32.
        race_sample_warm_up(logits.shape[1], self.device, (torch.float32, self.dtype))
        for q_lens, seq_lens, step in self.cascade.warm_up_steps():   # eager cascade variants
            positions = np.concatenate([np.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
            n = len(q_lens)
            self._forward_eager(_StepInputs(
                np.zeros(len(positions), dtype=np.int64), positions.astype(np.int64),
                np.full(len(positions), -1, dtype=np.int64), q_lens, seq_lens,
                np.zeros((n, -(-int(seq_lens.max()) // self.block_size)), dtype=np.int32),
                list(range(n)), [str(i) for i in range(n)], step))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ the step
    def _update_states(self, sched: SchedulerOutput) -> None:
        tables = self.block_tables
        for rid in sched.finished_request_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self._drop_rows(state)
        for new in sched.new_requests:
            old = self.requests.get(new.request_id)
            if old is not None:             # not told it ended: its rows go all the same
                self._drop_rows(old)
            state = self.requests[new.request_id] = _RunnerRequest(
                list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                list(new.block_ids), new.num_computed_tokens, tables.add(new.block_ids))
            state.controls = RowControls.of(new.sampling_params, self.device)
            if _has_penalties(new.sampling_params):
                if self.penalties is None:
                    self.penalties = PenaltyRows(self.model_config.vocab_size, self.device)
                state.penalty_row = self.penalties.add(state.token_ids[:state.num_prompt_tokens],
                                                       state.token_ids[state.num_prompt_tokens:])
        cached = sched.cached_requests
        for rid, new_block_ids in zip(cached.request_ids, cached.new_block_ids):
            if new_block_ids:
                state = self.requests[rid]
                tables.put(state.table_row, len(state.block_ids), new_block_ids)
                state.block_ids.extend(new_block_ids)

    def drop_requests(self) -> None:
        """Forgets every request and any step not collected (EngineCore.reset_after_lost_step:
        the scheduler starts again empty)."""
        self.requests.clear()
        self.block_tables = _BlockTables()
        self.penalties = None
        self._last_sampled = None
        self._uncollected = None

    def _drop_rows(self, state: _RunnerRequest) -> None:
        self.block_tables.remove(state.table_row, len(state.block_ids))
        if state.penalty_row != PENALTY_SINK:
            self.penalties.remove(state.penalty_row)

    def _prepare_inputs(self, sched: SchedulerOutput) -> "_StepInputs":
        bs = self.block_size
        num_rows = len(sched.num_scheduled_tokens)
        states = [self.requests[rid] for rid in sched.num_scheduled_tokens]
        counts = list(sched.num_scheduled_tokens.values())
        block_table = self.block_tables.gather([s.table_row for s in states],
                                               max(len(s.block_ids) for s in states))
        cascade = None
        if self.cascade.enabled and num_rows >= 2:
            decode_only = all(n == 1 for n in counts) and all(
                s.num_computed_tokens + 1 == s.num_tokens for s in states)
            graphs = self.decode_graphs
            capacity = (graphs.cascade_capacity(num_rows) if decode_only and graphs is not None
                        and graphs.can_run(num_rows) else None)
            cascade = self.cascade.plan(block_table, states, counts, capacity)
        order = range(num_rows)
        num_decodes = 0                     # leading rows of one query token (cascade: unused)
        if cascade is not None:
            order = cascade.order
        else:
            # Decode rows first: attention then runs them apart from the prompt chunks, each
            # with its own tiling (engine/models/attention.py, AttentionMetadata.num_decodes).
            decodes = [i for i, n in enumerate(counts) if n == 1]
            num_decodes = len(decodes)
            if 0 < num_decodes < num_rows and decodes[-1] != num_decodes - 1:
                order = decodes + [i for i, n in enumerate(counts) if n != 1]
        reordered = not isinstance(order, range)
        rids = list(sched.num_scheduled_tokens)

        num_tokens = sched.total_num_scheduled_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        q_lens = np.empty(num_rows, dtype=np.int32)
        seq_lens = np.empty(num_rows, dtype=np.int32)
        sampled_rows: list[int] = []
        sampled_ids: list[str] = []
        sampled_positions: list[int] = []
        fill_at: list[int] = []
        fill_from: list[int] = []
        at = 0
        for row, i in enumerate(order):
            state, n = states[i], counts[i]
            start = state.num_computed_tokens
            end = start + n
            table = state.block_ids
            if n == 1:                          # decode, the bulk of a busy step: no numpy call
                if start < len(state.token_ids):
                    input_ids[at] = state.token_ids[start]
                else:                           # sampled by the step in flight
                    input_ids[at] = 0
                    fill_at.append(at)
                    fill_from.append(state.pending_row)
                positions[at] = start
                slots[at] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, end, dtype=np.int64)
                input_ids[at:at + n] = state.token_ids[start:end]
                positions[at:at + n] = pos
                slots[at:at + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            at += n
            q_lens[row] = n
            seq_lens[row] = end
            state.num_computed_tokens = end
            if end == state.num_tokens:         # last token: sample the next one
                sampled_rows.append(row)
                sampled_ids.append(rids[i])
                sampled_positions.append(i)
        if reordered:
            block_table = block_table[order]
        return _StepInputs(input_ids, positions, slots, q_lens, seq_lens, block_table,
                           sampled_rows, sampled_ids, cascade,
                           sampled_positions if reordered else None, num_decodes,
                           fill_at or None, fill_from or None)

    def _input_fill(self, x: "_StepInputs") -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input_ids rows, token ids) on the device for the inputs sampled by the step in
        flight: gathered from its sampled tensor, never through the host."""
        if x.fill_at is None:
            return None
        dev = self.device
        rows = to_device(np.asarray(x.fill_from, dtype=np.int64), dev)
        return (to_device(np.asarray(x.fill_at, dtype=np.int64), dev),
                self._last_sampled.index_select(0, rows))

    def _forward_eager(self, x: "_StepInputs", piecewise: bool = False) -> torch.Tensor:
        """Any batch: prompt chunks and decode rows together. Returns the sampled rows' logits.
        piecewise: through the CUDA graphs cut at attention (engine/piecewise_graphs.py)."""
        dev = self.device
        cu = np.zeros(len(x.q_lens) + 1, dtype=np.int32)
        np.cumsum(x.q_lens, out=cu[1:])
        meta = AttentionMetadata(
            # The pieces write KV through their own padded slot buffer.
            slot_mapping=None if piecewise else to_device(x.slot_mapping, dev),
            block_table=to_device(x.block_table, dev),
            cu_seqlens_q=to_device(cu, dev),
            seq_lens=to_device(x.seq_lens, dev),
            max_seqlen_q=int(x.q_lens.max()), max_seqlen_k=int(x.seq_lens.max()),
            num_decodes=x.num_decodes)
        nd = x.num_decodes
        if x.cascade is None and 0 < nd < len(x.q_lens) and meta.max_seqlen_q > 1:
            meta.chunk_block_table = to_device(np.ascontiguousarray(x.block_table[nd:]), dev)
            meta.chunk_cu_seqlens_q = to_device(cu[nd:], dev)
            meta.chunk_seq_lens = to_device(x.seq_lens[nd:], dev)
        if x.cascade is not None:
            x.cascade.fill_metadata(meta, dev)
        fill = self._input_fill(x)
        if piecewise:
            hidden = self.piecewise.run(x.input_ids, x.positions, x.slot_mapping, meta, fill)
        else:
            input_ids = to_device(x.input_ids, dev)
            if fill is not None:
                input_ids = input_ids.index_copy(0, *fill)
            hidden = self.model(input_ids, to_device(x.positions, dev), self.kv_caches, meta)
        index = to_device(cu[1:][x.sampled_rows] - 1, dev)
        return self.model.compute_logits(hidden[index])

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to end (the engine core's synchronous mode, and tests)."""
        if self._uncollected is not None:
            self.collect(self._uncollected)
        handle = self.launch(sched)
        return self.collect(handle) if handle is not None else ModelRunnerOutput([], [])

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> _InFlight | None:
        """Hands the step to the GPU and returns without waiting for it; None: nothing to
        run. The step before may still be in flight (collected or not)."""
        times = self.times
        t0 = time.perf_counter()
        self._update_states(sched)
        if sched.is_empty:
            return None
        x = self._prepare_inputs(sched)
        t1 = time.perf_counter()
        times.prepare += t1 - t0
        num_cascade_rows = x.cascade.num_cascade_rows if x.cascade is not None else 0
        events = self._gpu_events()
        if events:
            events[0].record()
        batch = len(x.q_lens)
        decode_only = len(x.input_ids) == batch and len(x.sampled_rows) == batch
        graph = (decode_only and self.decode_graphs is not None
                 and self.decode_graphs.can_run(batch))
        # The graphs cut at attention take the steps the decode graph does not: a decode step
        # that fits both replays the decode graph and is timed as one.
        piecewise = (not graph and self.piecewise is not None
                     and self.piecewise.padded_size(len(x.input_ids)) is not None)
        states = [self.requests[rid] for rid in x.sampled_ids]
        if not states:
            self._forward_eager(x, piecewise)   # prompt chunks only: nothing to sample
            tokens = logprobs = None
        else:
            if graph:
                logits = self.decode_graphs.run(
                    x.input_ids, x.positions, x.slot_mapping, x.block_table, x.seq_lens,
                    x.cascade.graph_inputs() if x.cascade is not None else None,
                    self._input_fill(x))
            else:
                logits = self._forward_eager(x, piecewise)
            params = [s.sampling_params for s in states]
            # The penalties read their rows kept on the device (engine/penalty_rows.py): no
            # prompts or outputs copied, no wait for the step in flight. The rest of the sampler
            # needs how many tokens each row has generated, the one in flight included.
            counts = seen = penalty_index = None
            if any(s.penalty_row != PENALTY_SINK for s in states):
                counts, seen, penalty_index = self.penalties.rows_for(
                    [s.penalty_row for s in states], prompts=any(p.repetition_penalty != 1.0 for p in params))
            bans, pending = self._bad_word_bans(states)
            meta_s = SamplingMetadata.from_params(
                params, [[]] * len(states), None, self.eos_token_ids, self.device,
                [len(s.token_ids) - s.num_prompt_tokens + s.num_pending for s in states],
                output_counts=counts, prompt_seen=seen, vocab_size=self.model_config.vocab_size,
                controls=[s.controls for s in states], bans=bans, pending_tokens=pending)
            out = self.sampler(logits, meta_s)
            if penalty_index is not None:
                self.penalties.record(penalty_index, out.sampled_token_ids)
            self._last_sampled = out.sampled_token_ids
            for k, s in enumerate(states):
                s.num_pending += 1
                s.pending_row = k
            tokens = to_host(out.sampled_token_ids)
            logprobs = None if out.logprobs is None else (
                to_host(out.logprob_token_ids), to_host(out.logprobs),
                to_host(out.sampled_token_ranks))
        if events:
            events[1].record()
        done = None
        if self.device.type == "cuda":      # after the end event: waiting on it covers both
            done = torch.cuda.Event()
            done.record()
        handle = _InFlight(states, x, tokens, logprobs, done, events, self._last_events,
                           num_cascade_rows,
                           # On CPU the decode path pads and runs the same code without
                           # capturing: not a graph.
                           (graph and self.decode_graphs.use_graphs) or piecewise, piecewise)
        self._last_events = events
        self._uncollected = handle
        times.launch += time.perf_counter() - t1
        return handle

    def _bad_word_bans(self, states: list[_RunnerRequest]
                       ) -> tuple[list[list[tuple[int, int]]] | None, torch.Tensor | None]:
        """The rows' bad_word_bans, matched on the output the host knows; where a word's
        prefix ends in a row's token still in flight, the ban waits on that token on the device
        (the step's pending tokens, gathered from the last sampled tensor: no wait)."""
        if not any(s.sampling_params.bad_words_token_ids for s in states):
            return None, None
        bans = []
        for s in states:
            words = s.sampling_params.bad_words_token_ids or []
            longest = max((len(w) for w in words), default=1)
            tail = s.token_ids[max(s.num_prompt_tokens, len(s.token_ids) - longest):]
            bans.append(bad_word_bans(words, tail, s.num_pending > 0))
        pending = None
        if any(needs >= 0 for row in bans for _, needs in row):
            rows = [s.pending_row if s.num_pending else 0 for s in states]
            pending = self._last_sampled.index_select(
                0, list_to_device(rows, torch.int64, self.device))
        return bans, pending

    def collect(self, handle: _InFlight) -> ModelRunnerOutput:
        """Waits for a launched step's sampled tokens and appends them to the requests'
        states. Steps are collected in launch order; collecting one twice returns the same."""
        if handle.output is not None:
            return handle.output
        times = self.times
        t0 = time.perf_counter()
        if handle.done is not None and (handle.tokens is not None or handle.events):
            handle.done.synchronize()
        t1 = time.perf_counter()
        times.wait += t1 - t0
        if handle.events:
            gpu = self._gpu_time(handle)
            times.gpu += gpu
            if handle.graph:
                times.graph_gpu += gpu
            if handle.piecewise:
                times.piecewise_gpu += gpu
        times.piecewise_steps += handle.piecewise
        if self._uncollected is handle:
            self._uncollected = None
        x, states = handle.x, handle.states
        if handle.tokens is None:
            handle.output = ModelRunnerOutput([], [], None, handle.num_cascade_rows,
                                              handle.graph)
            return handle.output
        tokens = handle.tokens.tolist()
        for state, tok in zip(states, tokens):
            state.token_ids.append(tok)
            state.num_pending -= 1
        ids, logprobs = x.sampled_ids, self._logprobs(states, handle.logprobs)
        if x.sampled_positions is not None:        # back to the scheduler's row order
            back = sorted(range(len(ids)), key=x.sampled_positions.__getitem__)
            ids, tokens = [ids[k] for k in back], [tokens[k] for k in back]
            logprobs = None if logprobs is None else [logprobs[k] for k in back]
        times.post += time.perf_counter() - t1
        handle.output = ModelRunnerOutput(ids, tokens, logprobs, handle.num_cascade_rows,
                                          handle.graph)
        return handle.output

    def _gpu_events(self):
        """(start, end) CUDA events of a step if the GPU's time is wanted
        (StepTimes.gpu_events)."""
        if not (self.times.gpu_events and self.device.type == "cuda"):
            return None
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    @staticmethod
    def _gpu_time(handle: _InFlight) -> float:
        """Seconds the GPU spent on a collected step: from its start, or from the end of the
        step before when that one still ran when it was launched, to its end. Times are taken
        from the step before's start (always earlier, and near: float32 milliseconds)."""
        start, end = handle.events
        if handle.prev_events is None:
            return start.elapsed_time(end) / 1e3
        ref, prev_end = handle.prev_events
        begin = max(ref.elapsed_time(start), ref.elapsed_time(prev_end))
        return max(0.0, ref.elapsed_time(end) - begin) / 1e3

    @staticmethod
    def _logprobs(states: list[_RunnerRequest], host) -> list | None:
        if host is None:
            return None
        ids, lps, ranks = (t.tolist() for t in host)
        result = []
        for i, s in enumerate(states):
            n = s.sampling_params.logprobs
            result.append(None if n is None else (ids[i][:n + 1], lps[i][:n + 1], ranks[i]))
        return result
