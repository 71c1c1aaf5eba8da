"""The busy loop's body: schedule, execute, update. Works on token ids only."""
from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats
from engine.request import Request, check_request
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput, Scheduler
from engine.step_timing import StepTimes

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but no CUDA device is available")
        if device.index is None:          # memory queries need an index
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _blocks_for_one_sequence(config: EngineConfig, max_model_len: int,
                             sliding_window: int | None) -> tuple[int, str]:
    """The fewest blocks that let one sequence of max_model_len run alone, and what they hold.
    With a sliding window in every layer (and blocks given back behind it) that is its window
    and a step's tokens, as vLLM sizes it, plus a block of alignment each side; not under
    guaranteed_no_evict, which admits a request only when its whole final length fits."""
    bs = config.block_size
    whole = -(-max_model_len // bs)
    if sliding_window is not None and config.capacity_scheduler_policy == "max_utilization":
        windowed = -(-(sliding_window - 1 + config.max_num_batched_tokens) // bs) + 2
        if windowed < whole:
            return windowed, (f"one sequence's sliding window ({sliding_window} tokens) and a "
                              f"step's max_num_batched_tokens={config.max_num_batched_tokens}")
    return whole, f"one sequence of max_model_len={max_model_len}"


def _kv_size_setting(config: EngineConfig, device: torch.device) -> str:
    """The setting that sized the KV cache."""
    if config.num_kv_blocks:
        return "num_kv_blocks"
    return "gpu_memory_utilization" if device.type == "cuda" else "cpu_kv_cache_gb"


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: list[int] | None = None) -> None:
        from engine.models.config import ModelConfig

        self.config = config
        model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.torch_dtype)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if config.cpu_threads is not None:
            # Small models gain nothing from intra-op threads and lose a lot when the cores
            # are busy with other work (the server, the tokenizer thread, clients); on a GPU
            # the host's torch work is staging copies (engine/core_process.default_cpu_threads).
            torch.set_num_threads(config.cpu_threads)

        limit = model_config.max_context_len
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be <= the model's "
                             f"context length ({limit}: max_position_embeddings "
                             f"{model_config.max_position_embeddings}"
                             + (f" x linear RoPE factor {model_config.rope_scaling['factor']:g})"
                                if limit != model_config.max_position_embeddings else ")"))
        self.eos_token_ids = list(model_config.eos_token_ids or eos_token_ids or [])
        # The tokenizer's EOS, where the model's ids hold it, first: the primary one (vLLM's).
        primary = next((t for t in eos_token_ids or [] if t in self.eos_token_ids), None)
        if primary is not None:
            self.eos_token_ids.remove(primary)
            self.eos_token_ids.insert(0, primary)
        self.vocab_size = model_config.vocab_size
        # Blocks behind a sliding window are given back only where every layer has the window.
        self.kv_sliding_window = (
            model_config.sliding_window
            if len(model_config.sliding_window_layers) == model_config.num_hidden_layers else None)

        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.device, self.dtype, self.eos_token_ids)
        num_blocks = config.num_kv_blocks or self.runner.determine_num_blocks()
        needed, what = _blocks_for_one_sequence(config, self.max_model_len, self.kv_sliding_window)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold "
                f"{what} ({needed} blocks): raise "
                f"{_kv_size_setting(config, self.device)} or lower max_model_len")
        self.runner.allocate_kv_cache(num_blocks, self.max_model_len)
        self._new_scheduler(num_blocks)
        self._in_flight = None       # (SchedulerOutput, launched step): async scheduling
        self._step_lost = False      # an exception escaped step(): see reset_after_lost_step
        # Start-up objects live forever; keeping them out of the collector's scans keeps
        # collections short while the step loop allocates.
        gc.collect()
        gc.freeze()
        on = f"{self.device}, {torch.get_num_threads()} threads"
        logger.info("engine ready: %s on %s (%s), %d KV blocks of %d (%s), max_model_len %d",
                    config.model, on, self.dtype, num_blocks, config.block_size,
                    self.runner.kv_dtype, self.max_model_len)

    def _new_scheduler(self, num_blocks: int) -> None:
        config = self.config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 self.kv_sliding_window)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.capacity_scheduler_policy,
                                   config.prefill_hold_steps)

    def make_request(self, request_id: int | str, prompt_token_ids: list[int],
                     params: SamplingParams, ids_array: np.ndarray | None = None) -> Request:
        """Checks a request against this engine's limits; raises ValueError naming the field.
        ids_array: the same ids as an int64 array, where the caller has one (the check then
        converts nothing)."""
        check_request(prompt_token_ids if ids_array is None else ids_array, params,
                      self.max_model_len, self.vocab_size)
        return Request(request_id, prompt_token_ids, params, self.eos_token_ids)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def add_group(self, requests: list[Request], prefix_len: int) -> None:
        """Requests sharing their first prefix_len tokens (see Scheduler.add_group)."""
        self.scheduler.add_group(requests, prefix_len)

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block (vLLM's reset_prefix_cache: e.g. to time cold prompts
        again). Only while no request holds blocks; False, and nothing done, otherwise."""
        if self.has_unfinished_requests() or self.kv.num_free_blocks != self.kv.num_blocks:
            return False
        self.kv.pool.reset_prefix_cache()
        return True

    @property
    def times(self) -> StepTimes:
        """Where the steps' time went, since start (engine/step_timing.py)."""
        return self.runner.times

    def step(self) -> list[EngineCoreOutput]:
        """Schedules and runs a step; returns what finished steps produced. With async
        scheduling the step is launched and the one before it collected: the host plans and
        prepares step N+1 while the GPU runs step N, and step N's tokens come back from this
        call (one step after they were launched)."""
        try:
            return self._step()
        except BaseException:
            self._step_lost = True
            raise

    def _step(self) -> list[EngineCoreOutput]:
        times = self.runner.times
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        times.schedule += t1 - t0
        times.steps += not sched.is_empty
        if not self.config.async_scheduling:
            done = (sched, self.runner.execute_model(sched))
        else:
            handle = self.runner.launch(sched)
            done, self._in_flight = self._in_flight, (
                (sched, handle) if handle is not None else None)
            if done is not None:
                done = (done[0], self.runner.collect(done[1]))
        if done is None:
            return []
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(*done)
        times.update += time.perf_counter() - t2
        times.graph_steps += done[1].graph
        return outputs

    def reset_after_lost_step(self) -> bool:
        """After an exception escaped `step` (Ctrl-C in the forward pass, an out-of-memory
        error; LLM.generate carries on after them), the scheduler holds a step it planned but
        never saw run: tokens counted as computed, outputs awaited that never come, and blocks
        registered in the prefix cache whose KV was never written (a later hit on them would
        read garbage). Nothing of it can be trusted, so every request left is aborted and the
        scheduler and the KV cache start again empty, the prefix cache with them; the counters
        carry on. Returns whether a step was lost (else nothing changes)."""
        if not self._step_lost:
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)      # nothing launched still writes the cache
        stats = self.scheduler.stats
        self._new_scheduler(self.kv.num_blocks)
        self.scheduler.stats = stats
        self.runner.drop_requests()
        self._in_flight = None
        self._step_lost = False
        return True

    def shutdown(self) -> None:
        """Drops the model and the KV cache and hands their memory back."""
        self.runner = None
        self._in_flight = None
        gc.unfreeze()              # frozen at start-up: cycles among them would never go
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def get_stats(self) -> EngineStats:
        s = self.scheduler.stats
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=self.kv.num_blocks, num_free_kv_blocks=self.kv.num_free_blocks,
            num_cached_kv_blocks=self.kv.pool.num_cached_blocks, num_steps=s.num_steps,
            num_prompt_tokens=s.num_prompt_tokens,
            num_computed_prompt_tokens=s.num_computed_prompt_tokens,
            num_cached_prompt_tokens=s.num_cached_prompt_tokens,
            num_generated_tokens=s.num_generated_tokens, num_preemptions=s.num_preemptions,
            num_cascade_rows=s.num_cascade_rows, num_graph_steps=self.runner.times.graph_steps)
