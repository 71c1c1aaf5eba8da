"""Continuous batching: which requests run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests go first, in arrival order: a decode needs one token, a
prompt being prefilled in chunks takes what the budget leaves. When the pool is short, the
newest running request is preempted (its blocks freed, recomputed later). Waiting requests
are admitted FCFS while budget, seats and blocks last; a long prompt is split over steps.

Capacity policy (TensorRT-LLM's names): `max_utilization` (the default, as vLLM) admits while
the blocks for what is computed now last, and preempts when running requests outgrow the pool;
`guaranteed_no_evict` admits a request only if the pool also keeps room for every running
request, and this one, to reach its max_tokens (or max_model_len): nothing is ever preempted,
at the price of fewer requests running while outputs are still short. Where outputs run to
their max_tokens (benchmarks with ignore_eos, long generations) and max_num_seqs is larger
than the pool holds at full length, max_utilization preempts and recomputes over and over.

Prefill hold (`prefill_hold_steps`, off by default): a step that would run decode rows alone
may keep new prompts waiting, so that prompts arriving one by one share fewer, fuller steps. A
step carrying a prompt runs outside the decode CUDA graph and costs more than its tokens: on the
H200 (8B, ~230 rows) ~9 ms over the decode step's ~10.5, plus ~0.018 ms a prompt token (served
two-GPU step logs, benchmarks/h200x2/served_shared_prefix.md). Prompts are held while the tokens
they would compute (after prefix-cache hits) leave the step's budget unfilled and the oldest of
them came in fewer than `prefill_hold_steps` steps ago; never when nothing else runs.

Prefix groups (`add_group`, from LLM.generate): requests known to share a prefix of whole blocks.
The first member is admitted like any request and computes the prefix; the others are held back
until it has been scheduled through the prefix. Then the group pins the prefix's blocks (its own
reference: they are never evicted and recomputed, whatever the order of the other traffic) and
its held members go to a ready queue admitted before any other waiting request, so members run
together and take the prefix as computed. The pin is dropped when the last member is done. If
pinned prefixes ever leave no room to admit anything while nothing runs, or to grow the
oldest running request once every newer one is preempted, they are released (their groups
dissolve into plain requests): slower, never stuck.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from engine.config import CAPACITY_POLICIES
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
    num_cascade_rows: int = 0     # query rows this step that read a shared prefix once per group
    graph: bool = False           # the step ran as CUDA graphs (whole, or cut at attention)


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: int | str
    new_token_ids: list[int]
    finish_reason: str | None = None           # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # On a request's first output token only: its prompt tokens the prefix cache held when it
    # was first admitted (a group member's shared prefix, a repeated prompt's blocks).
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_steps: int = 0                         # steps that scheduled something
    num_prompt_tokens: int = 0                 # prompt tokens of admitted requests
    num_computed_prompt_tokens: int = 0        # prompt tokens actually run through the model
    num_cached_prompt_tokens: int = 0          # prompt tokens served by the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_cascade_rows: int = 0                  # query rows that read a shared prefix once per group


class _Group:
    """A prefix group: the leader computes the prefix; the rest wait in `pending` until then."""
    __slots__ = ("prefix_len", "leader", "pending", "blocks", "num_unfinished")

    def __init__(self, prefix_len: int, leader: Request, pending: deque[Request]) -> None:
        self.prefix_len = prefix_len
        self.leader: Request | None = leader     # until the prefix is pinned
        self.pending = pending
        self.blocks = None                       # the pinned prefix blocks
        self.num_unfinished = 1 + len(pending)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, capacity_policy: str = "max_utilization",
                 prefill_hold_steps: int = 0) -> None:
        if capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_policy must be one of {CAPACITY_POLICIES}, "
                             f"got {capacity_policy!r}")
        self.prefill_hold_steps = prefill_hold_steps
        self.no_evict = capacity_policy == "guaranteed_no_evict"
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()   # to tell the runner at the next step
        # Ended requests' ids -> their tokens still in flight (async scheduling): the id may be
        # used again before the step carrying them is collected, and they are not the new one's.
        self._draining: dict[int | str, int] = {}
        self.stats = SchedulerStats()
        # Prefix groups: members whose prefix is pinned go before `waiting`.
        self._ready: deque[Request] = deque()
        self._group_of: dict[str, _Group] = {}
        self._leaders: dict[str, _Group] = {}    # leaders whose prefix is not pinned yet
        self._num_held = 0                        # members in some group's `pending`

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.arrival_step = self.stats.num_steps
        self.waiting.append(request)

    def add_group(self, requests: list[Request], prefix_len: int) -> None:
        """Requests whose first `prefix_len` tokens (whole blocks, short of every member's
        length) are the same: the prefix is computed once and stays resident until the last
        member is done. A group of one or with no prefix is just its requests."""
        if len(requests) < 2 or prefix_len <= 0:
            for req in requests:
                self.add_request(req)
            return
        leader = requests[0]
        prefix = leader.all_token_ids[:prefix_len]
        if prefix_len % self.kv.block_size:
            raise ValueError(f"prefix_len {prefix_len} must be a multiple of the block size "
                             f"{self.kv.block_size}")
        ids = {req.request_id for req in requests}
        if len(ids) < len(requests) or any(rid in self.requests for rid in ids):
            raise ValueError("a group's request ids must be new and distinct")
        for req in requests:
            if req.num_tokens <= prefix_len or req.all_token_ids[:prefix_len] != prefix:
                raise ValueError(f"request {req.request_id!r} does not start with the group's "
                                 f"{prefix_len}-token prefix and a token after it")
        group = _Group(prefix_len, leader, deque(requests[1:]))
        for req in requests:
            self.requests[req.request_id] = req
            self._group_of[req.request_id] = group
            req.arrival_step = self.stats.num_steps
        self._leaders[leader.request_id] = group
        self._num_held += len(requests) - 1
        self.waiting.append(leader)

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        """Ends the requests named (unknown ids are skipped). The queues are filtered once for
        all of them, not searched once each: a dropped peer or an interrupted `LLM.generate`
        aborts thousands of waiting requests at once (20,000 took ~2 s one search each)."""
        reqs = {}
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                reqs[rid] = req
        if not reqs:
            return []
        gone = set(reqs)
        num_running = sum(r.status == RequestStatus.RUNNING for r in reqs.values())
        if num_running:
            self.running = [r for r in self.running if r.request_id not in gone]
        if num_running < len(reqs):
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
            self._ready = deque(r for r in self._ready if r.request_id not in gone)
            # Out of their groups' pending queues before any leader leaves, so that none of
            # them is made a leader.
            groups = {id(g): g for g in map(self._group_of.get, gone) if g is not None}
            for group in groups.values():
                kept = deque(r for r in group.pending if r.request_id not in gone)
                self._num_held -= len(group.pending) - len(kept)
                group.pending = kept
        for rid, req in reqs.items():
            req.status = RequestStatus.FINISHED_ABORTED
            self._free(req)
        return [EngineCoreOutput(rid, [], "abort") for rid in reqs]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._ready) + self._num_held

    def _remove_waiting(self, req: Request) -> None:
        group = self._group_of.get(req.request_id)
        if group is not None and req in group.pending:
            group.pending.remove(req)
            self._num_held -= 1
        elif req in self._ready:
            self._ready.remove(req)
        else:
            self.waiting.remove(req)

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]
        if req.num_output_placeholders > 0:
            self._draining[req.request_id] = req.num_output_placeholders
        self._finished_ids.add(req.request_id)
        group = self._group_of.pop(req.request_id, None)
        if group is not None:
            self._leave(group, req)

    def _leave(self, group: _Group, req: Request) -> None:
        """A member is done (finished or aborted)."""
        group.num_unfinished -= 1
        if group.leader is req:                   # aborted before the prefix was scheduled
            del self._leaders[req.request_id]
            group.leader = None
            if group.pending:                     # the next member computes it instead
                group.leader = group.pending.popleft()
                self._num_held -= 1
                self._leaders[group.leader.request_id] = group
                self.waiting.appendleft(group.leader)
        if group.num_unfinished == 0 and group.blocks is not None:
            self.kv.unpin(group.blocks)
            group.blocks = None

    def _pin_if_computed(self, req: Request) -> None:
        """Once a leader is scheduled through its group's prefix, the prefix's blocks (written
        by the end of this step) are the group's and its members may come, this step too: a
        step writes all its tokens' KV before any attention reads it."""
        group = self._leaders.get(req.request_id)
        if group is None or req.num_computed_tokens < group.prefix_len:
            return
        del self._leaders[req.request_id]
        group.leader = None
        group.blocks = self.kv.pin_prefix(req, group.prefix_len // self.kv.block_size)
        self._ready.extend(group.pending)
        self._num_held -= len(group.pending)
        group.pending.clear()

    def _release_pins(self) -> bool:
        """Dissolves every pinned group (its members carry on as plain requests); returns
        whether any block was released."""
        pinned = {id(g): g for g in self._group_of.values() if g.blocks is not None}
        for group in pinned.values():
            self.kv.unpin(group.blocks)
            group.blocks = None
        for rid in [rid for rid, g in self._group_of.items() if id(g) in pinned]:
            del self._group_of[rid]
        if pinned:
            logger.debug("released %d pinned prefixes to make room", len(pinned))
        return bool(pinned)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        preempted = False
        if self.kv.sliding_window is not None:
            # Every running request's blocks behind its window go back before any request
            # asks for room: an older request's growth must not preempt one that holds them.
            # (A group's pin then holds what of its prefix its leader still held.)
            for req in self.running:
                self.kv.free_behind_window(req)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_placeholders - req.num_computed_tokens, budget)
            if num_new <= 0 or req.reaches_limit(self.max_model_len):
                i += 1                    # its token in flight ends it: nothing to compute
                continue
            while True:
                new_block_ids = self.kv.allocate_slots(req, num_new)
                if new_block_ids is not None:
                    break
                if i == 0 and self.running[-1] is req and self._release_pins():
                    # Only pinned prefixes stand in the way of the oldest request: preempting
                    # it would readmit it, a pinned member, ahead of the groups whose pins hold
                    # the pool, and round again forever (a prompt longer than the budget comes
                    # back chunk by chunk, so the release below never sees an empty step).
                    continue
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
            if self._leaders:
                self._pin_if_computed(req)
            i += 1

        # Admitting new work while evicting running work would just thrash.
        if not preempted and not self._hold_prompts(budget, len(num_scheduled)):
            budget = self._admit(budget, num_scheduled, new_reqs)
            if not num_scheduled and not self.running and self._release_pins():
                budget = self._admit(budget, num_scheduled, new_reqs)

        self.stats.num_steps += bool(num_scheduled)   # not async scheduling's empty last collect
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                               self.max_num_batched_tokens - budget, finished)

    def _hold_prompts(self, budget: int, num_decodes: int) -> bool:
        """Whether this step keeps the waiting prompts back (prefill_hold_steps): it runs
        decode rows alone so far (one token each), the oldest waiting prompt came in fewer
        than prefill_hold_steps steps ago, and the waiting prompts' tokens to compute would
        not fill the budget left."""
        if not self.prefill_hold_steps:
            return False
        queue = self._ready or self.waiting
        if (not queue or not num_decodes or budget != self.max_num_batched_tokens - num_decodes
                or self.stats.num_steps - queue[0].arrival_step >= self.prefill_hold_steps):
            return False
        to_compute = 0
        for req in itertools.chain(self._ready, self.waiting):
            to_compute += req.num_tokens - self._computed_blocks(req)[1]
            if to_compute >= budget:
                return False
        return True

    def _computed_blocks(self, req: Request) -> tuple[list, int]:
        """The request's blocks found computed (its group's pinned prefix, then the prefix
        cache) and their tokens."""
        group = self._group_of.get(req.request_id) if self._group_of else None
        prefix = group.blocks if group is not None and group.blocks is not None else ()
        if group is not None and group.leader is req and self.kv.sliding_window is not None:
            # A windowed hit past the prefix would leave None where the members' windows
            # read: a leader's hit stops at its group's prefix, which it pins at once.
            return self.kv.get_computed_blocks(req, max_blocks=group.prefix_len
                                               // self.kv.block_size)
        return self.kv.get_computed_blocks(req, prefix)

    def _admit(self, budget: int, num_scheduled: dict[str, int],
               new_reqs: list[NewRequestData]) -> int:
        """Admits ready group members, then waiting requests, FCFS while budget, seats and
        blocks last; returns the budget left."""
        reserved = None     # guaranteed_no_evict: blocks the running requests may still take
        while budget > 0 and len(self.running) < self.max_num_seqs:
            queue = self._ready or self.waiting
            if not queue:
                break
            req = queue[0]
            # A request preempted while its token was sampled is back only after the token.
            assert not req.num_output_placeholders, req.request_id
            computed_blocks, num_cached = self._computed_blocks(req)
            if self.no_evict:
                if reserved is None:    # summed once a request is in line, not every step
                    reserved = sum(map(self._blocks_to_finish, self.running))
                # Hits held by other requests cost nothing, nor hits behind a sliding window
                # (None: never taken); free cached ones leave the pool.
                need = self._final_blocks(req) - sum(b is None or b.ref_cnt > 0
                                                     for b in computed_blocks)
                if need > self.kv.num_free_blocks - reserved:
                    break
            num_new = min(req.num_tokens - num_cached, budget)
            block_ids = self.kv.allocate_slots(req, num_new, computed_blocks)
            if block_ids is None:
                break
            if self.no_evict:
                reserved += self._blocks_to_finish(req)
            queue.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:     # first admission, not a resume
                req.num_cached_tokens = num_cached
                self.stats.num_prompt_tokens += req.num_prompt_tokens
                self.stats.num_cached_prompt_tokens += req.num_cached_prompt_tokens
            new_reqs.append(NewRequestData(req.request_id, list(req.all_token_ids),
                                           req.num_prompt_tokens, req.sampling_params,
                                           block_ids, num_cached))
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            self._advance(req, num_new)
            if self._leaders:
                self._pin_if_computed(req)
        return budget

    def _final_blocks(self, req: Request) -> int:
        """The blocks `req` holds once it has run to max_tokens (or max_model_len)."""
        max_tokens = req.sampling_params.max_tokens
        final_len = (self.max_model_len if max_tokens is None
                     else min(req.num_prompt_tokens + max_tokens, self.max_model_len))
        return -(-final_len // self.kv.block_size)

    def _blocks_to_finish(self, req: Request) -> int:
        return max(0, self._final_blocks(req) - self.kv.num_blocks_allocated(req.request_id))

    def _advance(self, req: Request, num_new: int) -> None:
        """The scheduled tokens count as computed from now on: the runner executes this step
        before it executes the next. A step through the last token samples one more: an output
        placeholder until `update_from_output` appends it."""
        if req.num_computed_tokens < req.num_prompt_tokens:
            self.stats.num_computed_prompt_tokens += (
                min(req.num_computed_tokens + num_new, req.num_prompt_tokens)
                - req.num_computed_tokens)
        req.num_computed_tokens += num_new
        if req.num_computed_tokens == req.num_tokens_with_placeholders:
            req.num_output_placeholders += 1

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        group = self._group_of.get(req.request_id) if self._group_of else None
        # A member of a pinned group comes back with its group, before other waiting work.
        (self._ready if group is not None and group.blocks is not None else self.waiting
         ).appendleft(req)
        self._finished_ids.add(req.request_id)
        logger.debug("preempted %s", req.request_id)

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        self.stats.num_cascade_rows += out.num_cascade_rows
        draining = self._draining
        for row, (rid, token_id) in enumerate(zip(out.request_ids, out.sampled_token_ids)):
            if draining and rid in draining:
                # Finished or aborted after the step was scheduled (a new request may hold
                # its id by now).
                if draining[rid] == 1:
                    del draining[rid]
                else:
                    draining[rid] -= 1
                continue
            req = self.requests[rid]
            req.num_output_placeholders -= 1
            # Preempted by the next step's plan while this token was sampled (async
            # scheduling): the token stands, the request resumes with it.
            running = req.status == RequestStatus.RUNNING
            done = req.append_token(token_id, self.max_model_len)
            self.stats.num_generated_tokens += 1
            lp = out.logprobs[row] if out.logprobs is not None else None
            outputs.append(EngineCoreOutput(
                rid, [token_id],
                req.finish_reason if done else None,
                req.stop_reason if done else None,
                [lp] if lp is not None else None,
                num_cached_tokens=(req.num_cached_prompt_tokens
                                   if req.num_output_tokens == 1 else None)))
            if done:
                if running:
                    self.running.remove(req)
                else:
                    self._remove_waiting(req)
                self._free(req)
        return outputs
