"""Serves requests given as numpy tensors on an AsyncEngine, on an event loop of its own.

The Triton `llm` model is a thin adapter over this: it passes each request's tensors, a `send`
callback (wrapping the request's response sender) and an `is_cancelled` callback, and returns
at once. No Triton imports here, so this is tested without a server too.

Every request is a task on the loop and ends with exactly one final send, however it ends:
answered, refused, failed, or cut short by `stop_serving` (the server is going away) or
`shutdown` (their error then names why). `shutdown` leaves nothing running: once it returns,
no thread of ours sends, updates a metric or calls `on_dead` (in Triton's stub such a call
while the stub exits can leave a lock in shared memory held by a dead process, and the
server aborts: README, Stopping).
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.outputs import EngineStats
from engine.protocol import GenerateRequest, make_response, parse_request

logger = logging.getLogger(__name__)

# send(tensors or None, error message or None, final)
SendFn = Callable[[dict[str, np.ndarray] | None, str | None, bool], None]

CANCEL_POLL_S = 0.1
LAG_PROBE_S = 0.01
GIL_SWITCH_INTERVAL_S = 0.0005
STATS_POLL_S = 0.5
STOP_WAIT_S = 10.0          # shutdown: for the loop to end the requests and its own tasks
ON_DEAD_WAIT_S = 5.0        # shutdown: for an on_dead call under way to return


class Metrics(Protocol):
    def on_loop_lag(self, seconds: float) -> None: ...
    def on_loop_lag_max(self, seconds: float) -> None: ...
    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_tokens(self, num_prompt: int, num_generated: int) -> None: ...
    def on_finish(self, reason: str) -> None: ...
    def on_stats(self, stats: EngineStats) -> None: ...


class _NoMetrics:
    def on_loop_lag(self, seconds: float) -> None: pass
    def on_loop_lag_max(self, seconds: float) -> None: pass
    def on_first_token(self, seconds: float) -> None: pass
    def on_inter_token(self, seconds: float) -> None: pass
    def on_tokens(self, num_prompt: int, num_generated: int) -> None: pass
    def on_finish(self, reason: str) -> None: pass
    def on_stats(self, stats: EngineStats) -> None: pass


class _Reply:
    """A request's `send` that knows whether the final response went out, so that a request
    ended from outside (cancelled, or stopped before it began) still gets one."""
    __slots__ = ("send", "final_sent")

    def __init__(self, send: SendFn) -> None:
        self.send = send
        self.final_sent = False

    def __call__(self, tensors, error, final) -> None:
        if final:
            self.final_sent = True          # first: a send that raises is not sent again
        self.send(tensors, error, final)


class ServingEngine:
    def __init__(self, config: EngineConfig, metrics: Metrics | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        """Builds the engine (raises if it cannot start) and starts the loop thread.
        `on_dead(reason)` runs once if the engine core process dies, after every in-flight
        request has been answered with an error; never once `shutdown` has begun."""
        self.metrics = metrics or _NoMetrics()
        # The loop, tokenizer and core-reader threads share one GIL; by default a thread that
        # wants it waits up to 5 ms, so each step's hand-offs would cost milliseconds.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._on_dead = on_dead
        self.engine = AsyncEngine(config, on_dead=self._engine_died)
        self.loop = asyncio.new_event_loop()
        self._inflight: dict[str, Callable[[], bool]] = {}
        self._client_ids: dict[str, str] = {}     # caller's request id -> engine request id
        self._ids = itertools.count()
        self.max_loop_lag_s = 0.0           # since the last stats publication
        self._tasks: set[asyncio.Task] = set()      # one per request being served
        self._loop_tasks: list[asyncio.Task] = []   # _poll, _watch_lag
        self._stop_reason: str | None = None        # set: requests end with it, new are refused
        self._dead_lock = threading.Lock()          # held while on_dead runs
        self._closing = False
        self._thread = threading.Thread(target=self._run_loop, name="serving-loop", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._loop_tasks = [self.loop.create_task(self._poll()),
                            self.loop.create_task(self._watch_lag())]
        try:
            self.loop.run_forever()
        finally:
            # One more pass: requests handed over while the loop was stopping are refused.
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    # ------------------------------------------------------------------ any thread
    def submit(self, inputs: dict[str, np.ndarray], send: SendFn,
               is_cancelled: Callable[[], bool] = lambda: False,
               request_id: str | None = None) -> None:
        """Starts serving one request; every outcome, errors included, ends with a final send.
        A request whose only input is `abort_request_id` aborts the in-flight request the caller
        started with that id (how llm_bls passes on a cancellation) and gets an empty answer."""
        if inputs.get("abort_request_id") is not None:
            target = np.asarray(inputs["abort_request_id"]).reshape(-1)[0]
            if isinstance(target, bytes):
                target = target.decode("utf-8", errors="replace")
            self._hand_over(send, lambda reply: self._abort_client(str(target), reply))
            return
        rid = f"{request_id or 'req'}-{next(self._ids)}"
        self._hand_over(send, lambda reply: self._serve(rid, inputs, reply, is_cancelled,
                                                        request_id))

    def stop_serving(self, reason: str) -> None:
        """Ends every request in flight now, each with `reason` as its error, and refuses new
        ones with it. For a server that is going away: Triton unloads a decoupled model only
        once its streams have ended, and it does not tell the model that it is stopping."""
        try:
            self.loop.call_soon_threadsafe(self._end_requests, reason)
        except RuntimeError:                # the loop is closed: nothing is in flight
            pass

    def stats(self) -> EngineStats:
        """Blocking; not from the loop thread."""
        return self.engine.get_stats()

    @property
    def is_alive(self) -> bool:
        return self.engine.is_alive

    def shutdown(self) -> None:
        """Requests still in flight end with an error; on_dead will not run (one under way is
        waited for); the loop's tasks are cancelled and awaited; the engine's processes stop;
        the loop is closed and its thread joined. Safe to call more than once."""
        acquired = self._dead_lock.acquire(timeout=ON_DEAD_WAIT_S)
        self._closing = True
        if acquired:
            self._dead_lock.release()
        else:
            logger.warning("on_dead has not returned after %.0f s", ON_DEAD_WAIT_S)
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(STOP_WAIT_S)
            except Exception:  # noqa: BLE001 - best effort: we are going away
                logger.exception("ending the requests in flight")
        self.engine.shutdown()
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=STOP_WAIT_S)

    # ------------------------------------------------------------------ the loop
    def _engine_died(self, reason: str) -> None:
        """Runs on a thread of its own once the core is gone. Streams have been failed by the
        engine; wait (briefly) until their error responses are out, then tell the owner,
        unless we are shutting down (the core's end is then ours)."""
        deadline = time.monotonic() + 1.0
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._dead_lock:
            if self._on_dead is not None and not self._closing:
                self._on_dead(reason)

    def _hand_over(self, send: SendFn, serve: Callable[[SendFn], Awaitable[None]]) -> None:
        reply = _Reply(send)
        try:
            self.loop.call_soon_threadsafe(self._start, reply, serve)
        except RuntimeError:                # the loop is closed: we have been shut down
            reply(None, self._stop_reason or "the engine was shut down", True)

    def _start(self, reply: _Reply, serve: Callable[[SendFn], Awaitable[None]]) -> None:
        if self._stop_reason is not None:
            reply(None, self._stop_reason, True)
            return
        task = self.loop.create_task(serve(reply))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._finished, reply))

    def _finished(self, reply: _Reply, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("a request ended with %r", task.exception())
        if not reply.final_sent:            # cancelled, or failed before its answer
            try:
                reply(None, self._stop_reason or "internal error: the request was dropped",
                      True)
            except Exception:  # noqa: BLE001 - the sender is broken: nothing more to do
                logger.exception("sending a request's final response")

    def _end_requests(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
        for task in list(self._tasks):
            task.cancel()

    async def _close(self) -> None:
        self._end_requests("the engine was shut down")
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for task in self._loop_tasks:
            task.cancel()
        await asyncio.gather(*self._loop_tasks, return_exceptions=True)

    async def _watch_lag(self) -> None:
        """Every response goes out through this loop: how late it wakes is latency for every
        client. Published as a histogram and as the recent maximum."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lag = max(0.0, time.perf_counter() - start - LAG_PROBE_S)
            self.max_loop_lag_s = max(self.max_loop_lag_s, lag)
            self.metrics.on_loop_lag(lag)

    async def _poll(self) -> None:
        """Aborts cancelled requests that produce no output (e.g. still queued) and publishes
        engine gauges."""
        last_stats = 0.0
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            for rid, is_cancelled in list(self._inflight.items()):
                try:
                    if is_cancelled():
                        await self.engine.abort(rid)
                except Exception:  # noqa: BLE001 - a broken callback must not stop the poller
                    logger.exception("cancellation check for %s", rid)
            now = time.monotonic()
            if now - last_stats >= STATS_POLL_S and self.engine.is_alive:
                last_stats = now
                self.metrics.on_loop_lag_max(self.max_loop_lag_s)
                self.max_loop_lag_s = 0.0
                try:
                    self.metrics.on_stats(await self.engine.stats())
                except Exception:  # noqa: BLE001 - the engine died meanwhile: nothing to show
                    pass

    async def _abort_client(self, client_id: str, send: SendFn) -> None:
        rid = self._client_ids.get(client_id)
        if rid is not None:
            await self.engine.abort(rid)
        send({}, None, True)

    async def _serve(self, rid: str, inputs: dict[str, np.ndarray], send: SendFn,
                     is_cancelled: Callable[[], bool], client_id: str | None) -> None:
        try:
            req = parse_request(inputs)
        except ValueError as e:
            send(None, str(e), True)
            return
        self._inflight[rid] = is_cancelled
        if client_id:
            self._client_ids[client_id] = rid
        try:
            await self._generate(rid, req, send, is_cancelled)
        except (ValueError, EngineDeadError) as e:  # rejected (e.g. prompt too long), or dead
            send(None, str(e), True)
        except Exception as e:  # noqa: BLE001 - the client must always get a final answer
            logger.exception("request %s failed", rid)
            send(None, f"internal error: {e}", True)
        finally:
            self._inflight.pop(rid, None)
            if client_id and self._client_ids.get(client_id) == rid:
                del self._client_ids[client_id]

    async def _generate(self, rid: str, req: GenerateRequest, send: SendFn,
                        is_cancelled: Callable[[], bool]) -> None:
        start = last = time.monotonic()
        num_out = 0
        async for out in self.engine.generate(req.prompt, req.params, rid, stream=req.stream):
            comp = out.outputs[0]
            now = time.monotonic()
            if req.stream and comp.token_ids:
                if num_out == 0:
                    self.metrics.on_first_token(now - start)
                else:
                    self.metrics.on_inter_token((now - last) / len(comp.token_ids))
                last = now
            num_out += len(comp.token_ids)
            cancelled = not out.finished and is_cancelled()
            if out.finished or cancelled:
                if not req.stream:
                    self._observe_latencies(out, start, num_out)
                self.metrics.on_tokens(len(out.prompt_token_ids), num_out)
                self.metrics.on_finish("abort" if cancelled else comp.finish_reason)
            if cancelled:
                send(None, "request cancelled", True)
                return                       # leaving the generator aborts it in the engine
            # Streaming: each step's new part; not streaming: the one output, with everything.
            if comp.token_ids or comp.text or out.finished:
                send(make_response(req, out, comp.text, comp.token_ids, comp.logprobs, num_out),
                     None, out.finished)

    def _observe_latencies(self, out, start: float, num_out: int) -> None:
        """A request that was not streamed has no per-step outputs: its time to first token
        and its mean inter-token latency come from the timestamps the engine kept."""
        first, last = out.metrics.get("first_token_time"), out.metrics.get("last_token_time")
        if first is None:
            return
        self.metrics.on_first_token(first - start)
        if num_out > 1:
            self.metrics.on_inter_token((last - first) / (num_out - 1))
