"""Continuous batching: which requests run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests go first, in arrival order: a decode needs one token, a
prompt being prefilled in chunks takes what the budget leaves. When the pool is short, the
newest running request is preempted (its blocks freed, recomputed later). Waiting requests
are admitted FCFS while budget, seats and blocks last; a long prompt is split over steps.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NewRequestData:
    """Sent to the runner the first time a request is scheduled (and again after preemption)."""
    request_id: int | str            # the core process uses integer indices
    token_ids: list[int]              # prompt + any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int          # prefix-cache hit


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, column-wise: only what changed. Most steps add no
    block to most requests, so `new_block_ids[i]` is usually empty. The runner advances each
    request's computed tokens itself, by its scheduled tokens."""
    request_ids: list[int | str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids)


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_request_ids: set[str]    # runner drops their state (finished, aborted, preempted)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced: a token for each request that reached its last known token."""
    request_ids: list[str]
    sampled_token_ids: list[int]
    # Per row, when asked: (token ids, logprobs) with the sampled token first, and its rank.
    logprobs: list[tuple[list[int], list[float], int] | None] | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: int | str
    new_token_ids: list[int]
    finish_reason: str | None = None           # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_prompt_tokens: int = 0                 # prompt tokens of admitted requests
    num_computed_prompt_tokens: int = 0        # prompt tokens actually run through the model
    num_cached_prompt_tokens: int = 0          # prompt tokens served by the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()   # to tell the runner at the next step
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        outs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            self._free(req)
            outs.append(EngineCoreOutput(rid, [], "abort"))
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.add(req.request_id)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                new_block_ids = self.kv.allocate_slots(req, num_new)
                if new_block_ids is not None:
                    break
                victim = self.running.pop()       # newest first
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_block_ids is None:
                break
            cached_reqs.request_ids.append(req.request_id)
            cached_reqs.new_block_ids.append(new_block_ids)
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            self._advance(req, num_new)
            i += 1

        # Admitting new work while evicting running work would just thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            block_ids = self.kv.allocate_slots(req, num_new, computed_blocks)
            if block_ids is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:     # first admission, not a resume
                req.num_cached_tokens = num_cached
                self.stats.num_prompt_tokens += req.num_prompt_tokens
                self.stats.num_cached_prompt_tokens += min(num_cached, req.num_prompt_tokens)
            new_reqs.append(NewRequestData(req.request_id, list(req.all_token_ids),
                                           req.num_prompt_tokens, req.sampling_params,
                                           block_ids, num_cached))
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            self._advance(req, num_new)

        self.stats.num_steps += 1
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                               self.max_num_batched_tokens - budget, finished)

    def _advance(self, req: Request, num_new: int) -> None:
        """The scheduled tokens count as computed from now on: the runner executes this step
        before the scheduler plans the next."""
        if req.num_computed_tokens < req.num_prompt_tokens:
            self.stats.num_computed_prompt_tokens += (
                min(req.num_computed_tokens + num_new, req.num_prompt_tokens)
                - req.num_computed_tokens)
        req.num_computed_tokens += num_new

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        self._finished_ids.add(req.request_id)
        logger.debug("preempted %s", req.request_id)

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for row, (rid, token_id) in enumerate(zip(out.request_ids, out.sampled_token_ids)):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue                       # aborted after it was scheduled
            done = req.append_token(token_id, self.max_model_len)
            self.stats.num_generated_tokens += 1
            lp = out.logprobs[row] if out.logprobs is not None else None
            outputs.append(EngineCoreOutput(
                rid, [token_id],
                req.finish_reason if done else None,
                req.stop_reason if done else None,
                [lp] if lp is not None else None))
            if done:
                self.running.remove(req)
                self._free(req)
        return outputs
