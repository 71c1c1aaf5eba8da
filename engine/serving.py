"""Serves requests given as numpy tensors on an AsyncEngine: what the Triton `llm` model calls.

The model passes each request's tensors (or a function that reads them), a
`send(tensors, error, final)` callback (its response sender) and an `is_cancelled` callback,
and returns at once. No Triton imports here, so this is tested without a server too.

Where the work happens, so that a response costs what the server takes and nothing more:
- submit() only queues the request: Triton holds up the model's next request until execute
  returns, so execute must not wait for anything, the GIL included; a waker thread hands the
  queue to the loop;
- the event loop (a thread of its own) admits requests: parses them, has them tokenized and
  hands them to the engine; it never sends;
- the engine's reader thread puts each step's tokens into the request's stream in the outbox
  (engine/outbox.py): it never waits; the text is decoded by the sender, once per response
  (AsyncEngine.submit's pull mode), except for requests with stop strings, whose text the
  reader must see step by step;
- the outbox's sender threads send: when one is free a step goes out at once, when all are
  busy a stream's steps pile up and leave as one response (text, ids and logprobs of them all);
- a housekeeping thread asks the server which requests were cancelled (a bounded number per
  round: each question is a round trip) and publishes the metrics (counted locally,
  engine/metrics.py) twice a second;
- with several instances of the model (one per GPU), each keeps its count of open requests on
  the instances' shared board (engine/instance_board.py), which the model's execute uses to
  steer requests to the least-loaded instance, and an abort for a request this instance does
  not hold is passed on to the others there.

A request with n completions (`n` in its sampling parameters, above 1) runs as n engine
requests, the k-th seeded seed + k (vLLM's rule), which share the prompt's KV blocks; each of its
responses has an entry per completion (Triton's vLLM backend's layout), and it ends when every
completion has.

A request whose only input is `abort_request_id` aborts the request the caller started with
that id (how llm_bls passes on a cancellation) and gets an empty answer.

Every request ends with exactly one final send, however it ends: answered, refused, failed, or
cut short by `stop_serving` (the server is going away) or `shutdown` (their error then names
why). `shutdown` leaves nothing running: once it returns, no thread of ours sends, asks the
server anything, publishes a metric or calls `on_dead` (in Triton's stub such a call while the
stub exits can leave a lock in shared memory held by a dead process, and the server aborts:
README, Stopping).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.instance_board import InstanceBoard
from engine.metrics import ServingMetrics
from engine.output_processor import PullOutput, RequestFailed
from engine.outbox import Outbox, Stream
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from engine.prefix_routing import PrefixRouter, core_address
from engine.protocol import (BLS_REQUEST_ID_PREFIX, Completion, GenerateRequest, ServingError,
                             make_response, make_response_n, parse_request)
from engine.serving_trace import RequestTrace
from engine.tokenize import PromptDropped

logger = logging.getLogger(__name__)

# send(tensors or None, error message or None, final); the message is a ServingError
SendFn = Callable[[dict[str, np.ndarray] | None, str | None, bool], None]


def _unavailable(message: str) -> ServingError:
    return ServingError(message, ServingError.UNAVAILABLE)


def _output_error(e: BaseException) -> ServingError:
    """A request's stream ended by an exception: its own output failed (INTERNAL), or the
    engine is gone or stopping (UNAVAILABLE)."""
    if isinstance(e, RequestFailed):
        return ServingError(f"internal error: {e}", ServingError.INTERNAL)
    return _unavailable(str(e))


def _submission_error(e: Exception, rid: str) -> ServingError:
    """The error of a request the engine did not take: its own fault (ValueError, e.g. a prompt
    too long), the engine's end (EngineDeadError), or a fault of ours (logged). Call within
    the except clause."""
    if isinstance(e, ValueError):
        return ServingError(str(e), ServingError.INVALID)
    if isinstance(e, EngineDeadError):
        return _unavailable(str(e))
    logger.exception("request %s failed", rid)
    return ServingError(f"internal error: {e}", ServingError.INTERNAL)


_CANCELLED = ServingError("request cancelled", ServingError.CANCELLED)
# A request's tensors by name, or a function giving them (called once, on the loop)
Inputs = dict[str, np.ndarray] | Callable[[], dict[str, np.ndarray]]

HOUSEKEEPING_S = 0.1
CANCEL_CHECKS_PER_ROUND = 64    # is_cancelled() is a server round trip: bounded per round
LAG_PROBE_S = 0.01
STATS_POLL_S = 0.5
PENDING_ABORT_S = 10.0      # an abort that came before its request is kept this long
STOP_WAIT_S = 10.0          # shutdown: for the answers to go out and the threads to end
ON_DEAD_WAIT_S = 5.0        # shutdown: for an on_dead call under way to return


class _Admission(NamedTuple):
    """A request submitted and not yet started on the loop: _serve's arguments."""
    rid: str
    inputs: Inputs
    send: SendFn
    is_cancelled: Callable[[], bool]
    client_id: str | None
    submitted: float                    # time.monotonic() when submit() took it


@dataclass
class _Failure:
    message: ServingError


_EMPTY = object()         # an empty final answer (to an abort request)


@dataclass
class _Part:
    """One of the completions of a request with n above 1: what it has had and not yet sent."""
    rid: str                            # its engine request id
    finished: bool = False
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    text: str = ""                      # pending: not yet in a response
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    num_cached_tokens: int | None = None    # its prompt tokens the prefix cache held

    def reason_or(self, default: str | None) -> str | None:
        """Its own finish reason once it has finished, else `default`."""
        return self.finish_reason if self.finished and self.finish_reason else default


@dataclass
class _Request:
    rid: str
    req: GenerateRequest | None = None
    is_cancelled: Callable[[], bool] = lambda: False
    client_id: str | None = None
    start: float = field(default_factory=time.monotonic)     # its latencies count from here
    last_sent: float | None = None      # when its last response with tokens went out
    submitted: float = 0.0              # when submit() took it (Triton's execute)
    # traced (LLM_SERVING_TRACE, engine/serving_trace.py):
    serving: float = field(default_factory=time.monotonic)   # when the loop took it
    in_engine: float | None = None      # when the engine had it (tokenized, sent to the core)
    first_output: float | None = None   # when its first step's output came back
    first_sent: float | None = None     # when its first tokens went to the server
    final_output: float | None = None   # when its last step's output came back
    final_sent: float | None = None     # when its final response went to the server
    core_key: tuple[int, int] | None = None     # its core's pid and its index there
    num_out: int = 0                    # its tokens in the responses so far
    num_prompt: int = 0                 # its prompt tokens, once it has had an output
    counted: bool = False               # counted finished in the metrics
    in_engine_now: bool = False         # the engine took it (a completion of it, for n > 1)
    cancelled: bool = False
    check_failed: bool = False          # its is_cancelled() raised (logged once)
    stream: Stream | None = None        # its way back
    parts: list[_Part] | None = None    # n above 1: its completions, in index order
    aborted: bool = False               # aborted (n above 1: its completions still arriving)
    last_out: RequestOutput | None = None   # n above 1: the latest output of any completion
    engine_slot: int | None = None      # prefix routing: the board slot of the engine it runs on
    engine_address: str | None = None   # and where that engine takes it (None: ours)
    num_placed: int = 0                 # its completions placed there so far
    placement_closed: bool = False      # answered for good: nothing more counts there

    def abort(self, engine: AsyncEngine) -> None:
        """Ends its engine request(s), from any thread."""
        self.aborted = True             # before the loop: _serve checks it after submit
        if self.parts is None:
            engine.abort_nowait(self.rid)
            return
        for p in self.parts:
            engine.abort_nowait(p.rid)


class ServingEngine:
    def __init__(self, config: EngineConfig, publisher=None,
                 on_dead: Callable[[str], None] | None = None,
                 num_senders: int | None = None, board: InstanceBoard | None = None) -> None:
        """Builds the engine (raises if it cannot start) and starts the threads. `publisher`
        (e.g. engine.metrics.TritonMetrics) gets the metrics twice a second. `on_dead(reason)`
        runs once if the engine core process dies, after every request has its error.
        `num_senders` (default: config.response_senders) threads send the responses. `board`:
        the board shared with the model's other instances (its owner closes it)."""
        # The loop, reader, sender and tokenizer threads share one GIL; by default a thread
        # that wants it waits up to 5 ms, so each hand-off would cost milliseconds.
        sys.setswitchinterval(config.gil_switch_interval_us * 1e-6)
        self.metrics = ServingMetrics()
        self._trace = RequestTrace.from_env()             # LLM_SERVING_TRACE
        self._publisher = publisher
        self._on_dead = on_dead
        self._board = board
        self._open_lock = threading.Lock()
        self._num_open = 0                  # submitted and not yet answered for good
        self._more_completions = 0          # of those, completions beyond each one's first
        self._lock = threading.Lock()
        self._inflight: dict[str, _Request] = {}
        self._client_ids: dict[str, str] = {}     # caller's request id -> engine request id
        self._early_aborts: dict[str, float] = {}  # caller's ids aborted before they arrived
        self._idle = threading.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._stop_reason: str | None = None        # set: requests end with it, new are refused
        self._stopping = threading.Event()          # the housekeeper's signal to finish
        self._dead_lock = threading.Lock()          # held while on_dead runs
        self._closing = False
        self._max_lag = 0.0
        self._admit_lock = threading.Lock()
        self._admissions: list[_Admission] = []     # submitted, not yet started on the loop
        self._admit_scheduled = False           # a call of _admit is on its way to the loop
        self._admissions_closed = False         # shutdown: submit() refuses
        self._wakeups: queue.SimpleQueue = queue.SimpleQueue()     # True: wake; False: end
        self.outbox = Outbox(num_senders or config.response_senders, "llm-send")
        routing = board is not None and config.prefix_routing and config.enable_prefix_caching
        self._router: PrefixRouter | None = None
        try:
            self.engine = AsyncEngine(
                config, on_dead=self._engine_died, sink_batch=self.outbox.batch,
                peer_address=core_address(board, os.getpid(), board.slot) if routing else None)
            if routing:
                self._router = PrefixRouter(board, self.engine, config.block_size,
                                            config.max_num_seqs, self.engine.info.max_model_len,
                                            config.prefix_routing_slack)
        except BaseException:
            if hasattr(self, "engine"):     # its core and tokenizer process run: stop them
                self.engine.shutdown()
            self.outbox.close()
            if self._trace is not None:
                self._trace.close()
            raise
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="serving-loop", daemon=True)
        self._thread.start()
        self._housekeeper = threading.Thread(target=self._housekeep, name="serving-house",
                                             daemon=True)
        self._housekeeper.start()
        self._waker = threading.Thread(target=self._wake_loop, name="serving-waker", daemon=True)
        self._waker.start()
        if self._router is not None:
            self._router.start()

    # ------------------------------------------------------------------ any thread
    def submit(self, inputs: Inputs, send: SendFn,
               is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str | None = None) -> None:
        """Starts serving one request; every outcome, errors included, ends with a final send.

        Cheap, for Triton's execute(), which holds up the model's next request until it
        returns: `inputs` may be a function giving the tensors (read on the loop, not here),
        and this thread makes no system call (_wake_loop)."""
        rid = f"{request_id or 'req'}-{next(self._ids)}"
        with self._admit_lock:
            closed = self._stop_reason is not None or self._admissions_closed
            if not closed:
                self._admissions.append(_Admission(rid, inputs, send, is_cancelled, request_id,
                                                   time.monotonic()))
                self._count_open(1)
                if self._admit_scheduled:
                    return
                self._admit_scheduled = True
        if closed:
            send(None, _unavailable(self._stop_reason or "the engine was shut down"), True)
            return
        self._wakeups.put(True)             # no system call: this thread keeps the GIL

    def stop_serving(self, reason: str) -> None:
        """Ends every request in flight now, each with `reason` as its error, and refuses new
        requests with it. For a server that is going away:
        Triton unloads a decoupled model only once its streams have ended, and it does not tell
        the model that it is stopping. Any thread."""
        if self._stop_reason is None:
            self._stop_reason = reason
        with self._lock:
            requests = list(self._inflight.values())
        for r in requests:
            r.abort(self.engine)
            self._fail(r.stream, _unavailable(self._stop_reason))

    @property
    def num_open(self) -> int:
        """Requests submitted whose final answer has not gone out (or failed) yet."""
        return self._num_open

    def _count_open(self, delta: int, more_completions: int = 0) -> None:
        """`delta` requests opened or answered for good, with `more_completions` completions
        beyond their first (n - 1 each). The board's load is their completions: a request
        with n of them is n requests' work in the engine."""
        with self._open_lock:
            self._num_open += delta
            self._more_completions += more_completions
            if self._board is not None:
                self._board.set_load(self._num_open + self._more_completions)

    def _close_open(self, r: _Request) -> None:
        """`r` has been answered for good (or can no longer be)."""
        self._count_open(-1, 1 - len(r.parts) if r.parts is not None else 0)
        with self._open_lock:           # route() may be placing its last completions
            r.placement_closed = True
            if r.num_placed:
                self._router.placed(r.engine_slot, -r.num_placed)
                r.num_placed = 0

    def _route(self, r: _Request) -> Callable[[np.ndarray], str | None] | None:
        """submit's `route` for `r` (None without prefix routing): its first completion picks
        the engine (PrefixRouter.choose), the others follow it; each counts on that engine's
        load until `r` is closed."""
        router = self._router
        if router is None:
            return None

        def route(ids: np.ndarray) -> str | None:
            if r.engine_slot is None:
                r.engine_slot, r.engine_address = router.choose(ids)
                if r.engine_address is not None:
                    self.metrics.on_run_on_peer()
            with self._open_lock:
                if not r.placement_closed:
                    router.placed(r.engine_slot, 1)
                    r.num_placed += 1
            return r.engine_address
        return route

    def stats(self) -> EngineStats:
        """Blocking; not from the loop thread."""
        return self.engine.get_stats()

    @property
    def is_alive(self) -> bool:
        return self.engine.is_alive

    def shutdown(self) -> None:
        """Requests still in flight end with an error; on_dead will not run (one under way is
        waited for); the engine's processes stop; the answers go out; the senders, the
        housekeeper and the loop (its tasks cancelled and awaited) end. Safe to call twice."""
        acquired = self._dead_lock.acquire(timeout=ON_DEAD_WAIT_S)
        self._closing = True
        if acquired:
            self._dead_lock.release()
        else:
            logger.warning("on_dead has not returned after %.0f s", ON_DEAD_WAIT_S)
        if self._stopping.is_set():
            return
        self.stop_serving("the engine was shut down")
        with self._admit_lock:              # from here on submit() refuses: nothing is lost
            self._admissions_closed = True
        self._wakeups.put(False)
        self._waker.join(STOP_WAIT_S)
        self._admit_rest()
        if self._router is not None:
            self._router.close()
        self.engine.shutdown()
        self._idle.wait(STOP_WAIT_S)
        self._stopping.set()
        self._housekeeper.join(STOP_WAIT_S)
        self.outbox.close(STOP_WAIT_S)
        if self._trace is not None:
            self._trace.close()
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._cancel_tasks(), self.loop).result(
                    STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - best effort: we are going away
                logger.exception("cancelling the loop's tasks")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(STOP_WAIT_S)

    # ------------------------------------------------------------------ admission
    def _wake_loop(self) -> None:
        """The waker thread: asks the loop to admit what was submitted, so that the thread
        calling submit() makes no system call (each one lets go of the GIL, and getting it
        back from the busy sender threads took ~0.1-0.5 ms a request)."""
        while self._wakeups.get():
            try:
                self.loop.call_soon_threadsafe(self._admit)
            except RuntimeError:            # the loop is closed: we have been shut down
                with self._admit_lock:
                    waiting, self._admissions = self._admissions, []
                    self._admit_scheduled = False
                for a in waiting:
                    self._refuse(a)

    def _refuse(self, a: _Admission) -> None:
        """A submitted request that will not start: its final answer is the stop reason."""
        try:
            a.send(None, _unavailable(self._stop_reason or "the engine was shut down"), True)
        finally:
            self._count_open(-1)

    def _admit_rest(self) -> None:
        """Shutdown: requests submitted but not yet started get their final (error) answer
        now, while the senders still run."""
        async def admit_and_start():
            self._admit()
            await asyncio.sleep(0)          # each new _serve sees the stop reason and ends
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(admit_and_start(), self.loop).result(
                    STOP_WAIT_S)
                return
            except Exception:  # noqa: BLE001 - then answer them from here
                logger.exception("admitting the last requests")
        with self._admit_lock:
            waiting, self._admissions = self._admissions, []
        for a in waiting:
            self._refuse(a)

    # ------------------------------------------------------------------ the loop
    def _admit(self) -> None:
        """Starts serving every request submitted since the last call."""
        with self._admit_lock:
            waiting, self._admissions = self._admissions, []
            self._admit_scheduled = False
        for args in waiting:
            self.loop.create_task(self._serve(*args))

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._watch_lag())
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_lag(self) -> None:
        """How late the loop wakes is how late a request is admitted."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lag = max(0.0, time.perf_counter() - start - LAG_PROBE_S)
            self.metrics.on_loop_lag(lag)
            self._max_lag = max(self._max_lag, lag)

    async def _serve(self, rid: str, inputs: Inputs, send: SendFn,
                     is_cancelled: Callable[[], bool], client_id: str | None,
                     submitted: float) -> None:
        # Its latencies count from its arrival (execute), not from the loop's start on it,
        # which a busy loop delays: TTFT and e2e as the client sees them, less Triton's queue.
        r = _Request(rid, is_cancelled=is_cancelled, client_id=client_id, submitted=submitted,
                     start=submitted or time.monotonic())
        answer = self.outbox.stream(lambda items: self._send_items(r, send, items),
                                    lambda e: self._send_failed(r, e), context=r)
        r.stream = answer
        if self._stop_reason is not None:
            self._fail(answer, _unavailable(self._stop_reason))
            return
        if callable(inputs):
            try:
                inputs = inputs()
            except Exception as e:  # noqa: BLE001 - the client must always get a final answer
                logger.exception("request %s: reading its inputs failed", rid)
                self._fail(answer, ServingError(f"internal error reading the inputs: {e}",
                                                ServingError.INTERNAL))
                return
        if inputs.get("abort_request_id") is not None:
            target = _text(inputs["abort_request_id"])
            if not target.startswith(BLS_REQUEST_ID_PREFIX):
                self._fail(answer, ServingError(
                    f"abort_request_id: only the requests llm_bls starts (ids "
                    f"'{BLS_REQUEST_ID_PREFIX}...') can be aborted this way, got {target!r}",
                    ServingError.INVALID))
                return
            self._abort_client(target)
            self.outbox.put(answer, _EMPTY, final=True)
            return
        try:
            r.req = parse_request(inputs)
        except ValueError as e:
            self._fail(answer, ServingError(str(e), ServingError.INVALID))
            return
        params = r.req.params
        if params.n > 1:                # before it can be aborted: see _Request.abort
            asked = params.logprobs is not None     # then a completion's sum starts at 0
            r.parts = [_Part(f"{rid}_{k}", cumulative_logprob=0.0 if asked else None,
                             logprobs=[] if asked else None) for k in range(params.n)]
            self._count_open(0, params.n - 1)
        if not self._track(r):
            stopped = self._stop_reason
            self._fail(answer, _CANCELLED if stopped is None else _unavailable(stopped))
            return
        if r.parts is not None:
            await self._submit_parts(r)
            return
        try:
            await self.engine.submit(r.req.prompt, r.req.params, rid,
                                     lambda out: self._on_output(r, out), stream=r.req.stream,
                                     pull=True, route=self._route(r))
            r.in_engine_now = True
            if r.aborted:       # before submit opened it in the engine, r.abort found nothing
                self.engine.abort_nowait(rid)
            if self._trace is not None:
                r.core_key = self.engine.core_key(rid)
                self._trace.in_engine(r, time.monotonic())
        except Exception as e:  # noqa: BLE001 - the client must always get a final answer
            self._fail(r.stream, _submission_error(e, rid))

    async def _submit_parts(self, r: _Request) -> None:
        """A request with n completions: the prompt tokenized once, then each completion into
        the engine as a request of its own, one after another without waiting (submit does not
        wait for a prompt already tokenized)."""
        params = r.req.params
        tokenized, submitted = None, 0
        route = self._route(r)
        try:
            tokenized = await self.engine.tokenize(r.req.prompt, dropped=lambda: r.aborted)
            # n requests are about to go in: not one if the client cancelled already (the
            # housekeeper would notice only on its next round, after all n went in).
            if not r.aborted and self._ask_cancelled(r):
                r.aborted = True        # none of them in the engine: nothing to abort there
            for k, part in enumerate(r.parts):
                def sink(out, k=k):
                    self._on_part_output(r, k, out)
                if r.aborted:           # before this one reached the engine
                    break
                await self.engine.submit(r.req.prompt, params.child(k), part.rid, sink,
                                         stream=r.req.stream, pull=True, tokenized=tokenized,
                                         route=route)
                r.in_engine_now = True
                submitted = k + 1
                if r.aborted:           # while it went in: r.abort may have missed it
                    self.engine.abort_nowait(part.rid)
        except PromptDropped:           # aborted while it waited for the tokenizer
            pass
        except Exception as e:  # noqa: BLE001 - the client must always get a final answer
            error = _submission_error(e, r.rid)
            r.abort(self.engine)        # the completions already in the engine
            self._fail(r.stream, error)
            return
        if submitted == len(r.parts) and self._trace is not None:
            self._trace.in_engine(r, time.monotonic())
        for k in range(submitted, len(r.parts)):    # aborted before they reached the engine
            self._on_part_output(r, k, RequestOutput(
                r.parts[k].rid, None, [], [CompletionOutput(0, "", [], "abort")], True))

    def _on_part_output(self, r: _Request, k: int, out) -> None:
        """_on_output for the k-th completion of a request with n above 1."""
        if r.first_output is None:
            r.first_output = time.monotonic()
        if isinstance(out, BaseException):
            r.abort(self.engine)        # the others: the request ends with this error
            self._fail(r.stream, _output_error(out))
            return
        if out.finished and self._trace is not None:
            r.final_output = time.monotonic()   # the last completion's end is the request's
        self.outbox.put(r.stream, (k, out), final=out.finished)

    def _fail(self, stream: Stream, message: ServingError) -> None:
        """The stream's final answer is this error."""
        self.outbox.put(stream, _Failure(message), final=True)

    def _on_output(self, r: _Request, out) -> None:
        """The engine's reader thread: one step of the request (or the engine's failure)."""
        if r.first_output is None:
            r.first_output = time.monotonic()
        if isinstance(out, BaseException):
            self._fail(r.stream, _output_error(out))
            return
        if out.finished and self._trace is not None:
            r.final_output = time.monotonic()
        self.outbox.put(r.stream, out, final=out.finished)

    # ------------------------------------------------------------------ sender threads
    def _send_items(self, r: _Request, send: SendFn, items: list) -> bool:
        """The outbox's send: True once the final answer is out (the request is closed). An
        exception of `send` is the client gone (the outbox calls _send_failed); one raised
        before it, making the response (rendering the request's tokens), is this request's
        fault: it ends with that error, and the others carry on."""
        sending = False

        def tracked_send(*args) -> None:
            nonlocal sending
            sending = True
            send(*args)
        try:
            final = self._send_answer(r, tracked_send, items)
        except Exception as e:  # noqa: BLE001
            if sending:
                raise
            logger.exception("request %s: making its response failed", r.rid)
            r.abort(self.engine)
            if r.rid in self._inflight:
                self._count_cut_short(r)
            send(None, ServingError(f"internal error: making the response failed: {e!r}",
                                    ServingError.INTERNAL), True)
            self._forget(r)
            final = True
        if final:
            self._close_open(r)
        return final

    def _send_answer(self, r: _Request, send: SendFn, items: list) -> bool:
        """One response for everything pending on a client's stream; True once final."""
        first = items[0]
        if first is _EMPTY:
            send({}, None, True)
            return True
        failure = next((i for i in items if isinstance(i, _Failure)), None)
        if failure is not None:
            if r.in_engine_now:         # the server stopping, the engine gone: cut short
                self._count_cut_short(r)
            send(None, failure.message, True)
            self._forget(r)
            return True
        if r.parts is not None:
            return self._send_parts(r, send, items)
        if isinstance(items[-1], PullOutput):  # every item is the request's handle
            out = self.engine.render(items[-1])
            if out is None:
                return False                 # nothing visible yet (a partial character)
            items = [out]
        last: RequestOutput = items[-1]
        r.num_prompt = len(last.prompt_token_ids)
        comps = [o.outputs[0] for o in items]
        token_ids = [t for c in comps for t in c.token_ids]
        text = "".join(c.text for c in comps)
        if last.finished and r.cancelled:
            return self._end_cancelled(r, send, last, len(token_ids))
        if not (token_ids or text or last.finished):
            return False                     # nothing to say yet (a stop string held back)
        logprobs = None
        if any(c.logprobs is not None for c in comps):
            logprobs = [lp for c in comps for lp in (c.logprobs or [])]
        self._time_stream(r, len(token_ids))
        if last.finished:
            self._count_finished(r, last, r.num_out + len(token_ids))
        r.num_out += len(token_ids)
        self._timed_send(send, make_response(r.req, last, text, token_ids, logprobs),
                         last.finished, len(token_ids))
        if last.finished:
            if self._trace is not None and r.req.stream:
                self._trace.final_sent(r, time.monotonic())
            self._forget(r)
        return last.finished

    def _end_cancelled(self, r: _Request, send: SendFn, last: RequestOutput,
                       num_unsent: int) -> bool:
        """A cancelled request's engine request(s) ended: its final answer says so. Its tokens
        were generated, sent or not: counted as vLLM counts them."""
        self._count_finished(r, last, r.num_out + num_unsent, reason="abort")
        send(None, _CANCELLED, True)
        self._forget(r)
        return True

    def _send_parts(self, r: _Request, send: SendFn, items: list) -> bool:
        """_send_answer for a request with n completions: every (k, output) pending, one
        response with an entry per completion (what each had since the last response)."""
        handles: dict[int, PullOutput] = {}
        newly_finished = False
        for k, out in items:
            if isinstance(out, PullOutput):
                handles[k] = out         # rendered below, once: it holds every step since
            else:
                newly_finished |= self._take_part_output(r, r.parts[k], out)
        for k, handle in handles.items():
            if not r.parts[k].finished:  # a finished handle is never rendered again
                out = self.engine.render(handle)
                if out is not None:
                    newly_finished |= self._take_part_output(r, r.parts[k], out)
        done = all(p.finished for p in r.parts)
        last = r.last_out
        if done and r.cancelled:
            return self._end_cancelled(r, send, last, sum(len(p.token_ids) for p in r.parts))
        pending = [len(p.token_ids) for p in r.parts]
        if not done and (not r.req.stream or not (newly_finished or any(pending)
                                                  or any(p.text for p in r.parts))):
            return False                # nothing to say yet
        self._time_stream(r, max(pending))  # the completions step together: tokens each
        num_tokens = sum(pending)
        if done:
            self._count_finished(r, last, r.num_out + num_tokens)
        r.num_out += num_tokens
        completions = []
        for p in r.parts:
            completions.append(Completion(p.text, p.token_ids, p.logprobs,
                                          p.finish_reason if p.finished else None,
                                          p.cumulative_logprob))
            p.text, p.token_ids = "", []
            if p.logprobs is not None:
                p.logprobs = []
        # The first completion's cache hit is the request's (its siblings find its prompt).
        self._timed_send(send, make_response_n(r.req, last, completions,
                                               r.parts[0].num_cached_tokens), done, num_tokens)
        if done:
            if self._trace is not None and r.req.stream:
                self._trace.final_sent(r, time.monotonic())
            self._forget(r)
        return done

    def _take_part_output(self, r: _Request, p: _Part, out: RequestOutput) -> bool:
        """Adds a completion's output to what it has pending; True if it finished it."""
        if p.finished:
            return False
        c = out.outputs[0]
        p.text += c.text
        p.token_ids += c.token_ids
        if p.logprobs is not None and c.logprobs:
            p.logprobs += c.logprobs
        if c.cumulative_logprob is not None:
            p.cumulative_logprob = c.cumulative_logprob
        if out.prompt_token_ids:        # not an abort made before it reached the engine
            r.num_prompt = len(out.prompt_token_ids)
            r.last_out = out
            p.num_cached_tokens = out.num_cached_tokens
        elif r.last_out is None:
            r.last_out = out
        if out.finished:
            p.finished, p.finish_reason = True, c.finish_reason
        return out.finished

    def _time_stream(self, r: _Request, steps: int) -> None:
        """A streamed response carrying `steps` new tokens (of each completion) goes out now:
        its time to first token, or the gap since the last such response over its steps."""
        if not (steps and r.req.stream):
            return
        now = time.monotonic()
        if r.last_sent is None:
            self.metrics.on_first_token(now - r.start)
            r.first_sent = now
        else:
            self.metrics.on_inter_token((now - r.last_sent) / steps, steps)
        r.last_sent = now

    def _timed_send(self, send: SendFn, tensors, final: bool, num_tokens: int) -> None:
        t0 = time.perf_counter()
        send(tensors, None, final)
        self.metrics.on_response(num_tokens, time.perf_counter() - t0)

    def _send_failed(self, r: _Request, e: BaseException) -> None:
        """The response could not be sent (the client is gone): stop generating for it."""
        logger.info("request %s: sending failed (%s); aborting it", r.rid, e)
        r.abort(self.engine)
        if r.rid in self._inflight:
            self._count_cut_short(r)
        self._forget(r)
        self._close_open(r)

    def _count_cut_short(self, r: _Request) -> None:
        """A request that ends without its final output (its send failed, the server stopped,
        the engine died) counts once, as vLLM counts an aborted request: its tokens so far, a
        completion that had finished under its own reason, the others as aborted."""
        if r.req is None or r.counted:
            return
        r.counted = True
        self.metrics.on_request_done(time.monotonic() - r.start)
        self.metrics.on_tokens(r.num_prompt, r.num_out)
        for p in r.parts or (None,):
            self.metrics.on_finish("abort" if p is None else p.reason_or("abort"))

    def _count_finished(self, r: _Request, out: RequestOutput, num_out: int,
                        reason: str | None = None) -> None:
        """`out`: its (last completion's) final output; `num_out`: its tokens (all its
        completions'). A request with n completions counts one finish per completion, each
        under its reason, as vLLM counts its child requests (and as the engine's running gauge
        counts them); its latencies and prompt count once."""
        r.counted = True        # before its final response is sent: a failing send finds it
        if not r.req.stream:
            first, last = out.metrics.get("first_token_time"), out.metrics.get("last_token_time")
            if first is not None:
                self.metrics.on_first_token(first - r.start)
                steps = len(out.outputs[0].token_ids) if r.parts is not None else num_out
                if steps > 1:   # that completion's own steps, not its siblings' too
                    self.metrics.on_inter_token((last - first) / (steps - 1), steps - 1)
        self.metrics.on_request_done(time.monotonic() - r.start)
        # Last: a request counts as finished once its latencies are in (TritonMetrics.publish).
        self.metrics.on_tokens(len(out.prompt_token_ids), num_out)
        if r.parts is None:
            self.metrics.on_finish(reason or out.outputs[0].finish_reason)
        else:
            for p in r.parts:           # one that finished before a cancel: its own reason
                self.metrics.on_finish(p.reason_or(reason or p.finish_reason))

    # ------------------------------------------------------------------ bookkeeping
    def _track(self, r: _Request) -> bool:
        """Registers the request; False if its caller aborted it before it arrived, or serving
        stopped since _serve looked (stop_serving reads _inflight under this lock after setting
        its reason: one or the other sees the request)."""
        with self._lock:
            if self._stop_reason is not None:
                return False
            if r.client_id and self._early_aborts.pop(r.client_id, None) is not None:
                return False
            self._inflight[r.rid] = r
            if r.client_id:
                self._client_ids[r.client_id] = r.rid
            self._idle.clear()
            return True

    def _forget(self, r: _Request) -> None:
        with self._lock:
            if self._inflight.pop(r.rid, None) is None:
                return
            if r.client_id and self._client_ids.get(r.client_id) == r.rid:
                del self._client_ids[r.client_id]
            if not self._inflight:
                self._idle.set()

    def _abort_client(self, client_id: str, pass_on: bool = True) -> None:
        """Aborts the caller's request; one that has not arrived yet (llm_bls can cancel within
        the moment before) is refused when it does. One this instance does not hold may be
        another instance's: with `pass_on` the abort goes on the board for them too."""
        with self._lock:
            rid = self._client_ids.get(client_id)
            r = self._inflight.get(rid) if rid is not None else None
            if rid is None:
                # Kept in the order they came: the expired ones leave from the front, a few
                # at a time (rebuilding the map cost every abort all of the last 10 s's).
                now = time.monotonic()
                early = self._early_aborts
                while early:
                    oldest, t = next(iter(early.items()))
                    if now - t < PENDING_ABORT_S:
                        break
                    del early[oldest]
                early.pop(client_id, None)          # to the back, with its new time
                early[client_id] = now
        if r is not None:
            r.abort(self.engine)
        elif rid is not None:
            self.engine.abort_nowait(rid)
        elif pass_on and self._board is not None:
            self._board.post_abort(client_id)

    # ------------------------------------------------------------------ housekeeping thread
    def _housekeep(self) -> None:
        cursor = 0
        last_stats = 0.0
        while not self._stopping.wait(HOUSEKEEPING_S):
            try:
                cursor = self._check_cancellations(cursor)
                if self._board is not None:
                    for client_id in self._board.take_aborts():
                        self._abort_client(client_id, pass_on=False)
                now = time.monotonic()
                if now - last_stats >= STATS_POLL_S:
                    last_stats = now
                    self._publish()
            except Exception:  # noqa: BLE001 - housekeeping must go on
                logger.exception("serving housekeeping")
        self._publish()

    def _check_cancellations(self, cursor: int) -> int:
        """Asks about up to CANCEL_CHECKS_PER_ROUND client requests, in turn."""
        with self._lock:
            clients = list(self._inflight.values())
        if not clients:
            return 0
        cursor %= len(clients)
        batch = (clients[cursor:] + clients[:cursor])[:CANCEL_CHECKS_PER_ROUND]
        for r in batch:
            if self._ask_cancelled(r):
                r.abort(self.engine)
        return cursor + len(batch)

    def _ask_cancelled(self, r: _Request) -> bool:
        """Asks the client's is_cancelled() (a server round trip): True if it says so now,
        not before. Never after its final response is out (the lock). A stream being sent is
        asked later: a send that stalls must not hold up the other streams' checks."""
        if not r.stream.lock.acquire(blocking=False):
            return False
        try:
            if r.stream.done or r.cancelled:
                return False
            try:
                r.cancelled = bool(r.is_cancelled())
            except Exception:  # noqa: BLE001 - a broken check must not stop the others
                if not r.check_failed:      # asked again each round: one traceback
                    r.check_failed = True
                    logger.exception("cancellation check for %s (its later failures "
                                     "are not logged)", r.rid)
        finally:
            r.stream.lock.release()
        return r.cancelled

    def _publish(self) -> None:
        self.metrics.on_loop_lag_max(self._max_lag)
        self._max_lag = 0.0
        if self._router is not None:
            self.metrics.on_routing_peers(len(self.engine.peers()))
        cut = self.metrics.snapshot()    # before the engine's stats, which then count every
        if self.engine.is_alive:         # step of every request the cut counts finished
            try:
                self.metrics.on_stats(self.engine.get_stats())
            except EngineDeadError:
                pass
        if not self.engine.is_alive and self.metrics.stats is not None:
            # A dead or stopped engine runs nothing and has no pool: its gauges say 0, not its
            # last stats, which would stand for as long as the process lives (the metric
            # objects are kept: TritonMetrics.close), so that summed by model they count live
            # engines only (a reload with fewer instances kept the removed ones' pools in).
            self.metrics.on_stats(replace(self.metrics.stats, num_running=0, num_waiting=0,
                                          num_kv_blocks=0, num_free_kv_blocks=0))
        if self._publisher is not None:
            self._publisher.publish(self.metrics, cut)

    # ------------------------------------------------------------------ engine death
    def _engine_died(self, reason: str) -> None:
        """On a thread of its own once the core is gone: every request's stream has its error
        (the engine failed them); let those go out, then tell the owner, unless we are
        shutting down (the core's end is then ours)."""
        self._idle.wait(1.0)
        with self._dead_lock:
            if self._on_dead is not None and not self._closing:
                self._on_dead(reason)


def _text(arr) -> str:
    v = np.asarray(arr).reshape(-1)[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)

