"""Serves requests given as numpy tensors on an AsyncEngine, on an event loop of its own.

The Triton `llm` model is a thin adapter over this: it passes each request's tensors, a `send`
callback (wrapping the request's response sender) and an `is_cancelled` callback, and returns
at once. No Triton imports here, so this is tested without a server too.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import EngineStats
from engine.protocol import GenerateRequest, make_response, parse_request

logger = logging.getLogger(__name__)

# send(tensors or None, error message or None, final)
SendFn = Callable[[dict[str, np.ndarray] | None, str | None, bool], None]

CANCEL_POLL_S = 0.1
GIL_SWITCH_INTERVAL_S = 0.0005
STATS_POLL_S = 0.5


class Metrics(Protocol):
    def on_first_token(self, seconds: float) -> None: ...
    def on_inter_token(self, seconds: float) -> None: ...
    def on_tokens(self, num_prompt: int, num_generated: int) -> None: ...
    def on_finish(self, reason: str) -> None: ...
    def on_stats(self, stats: EngineStats) -> None: ...


class _NoMetrics:
    def on_first_token(self, seconds: float) -> None: pass
    def on_inter_token(self, seconds: float) -> None: pass
    def on_tokens(self, num_prompt: int, num_generated: int) -> None: pass
    def on_finish(self, reason: str) -> None: pass
    def on_stats(self, stats: EngineStats) -> None: pass


class ServingEngine:
    def __init__(self, config: EngineConfig, metrics: Metrics | None = None) -> None:
        """Builds the engine (raises if it cannot start) and starts the loop thread."""
        self.metrics = metrics or _NoMetrics()
        # The core, tokenizer and loop threads share one GIL; by default a thread that wants it
        # waits up to 5 ms, so each step's hand-offs would cost the core thread milliseconds.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.engine = AsyncEngine(config)
        self.loop = asyncio.new_event_loop()
        self._inflight: dict[str, Callable[[], bool]] = {}
        self._client_ids: dict[str, str] = {}     # caller's request id -> engine request id
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run_loop, name="serving-loop", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._poll())
        self.loop.run_forever()

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
            asyncio.run_coroutine_threadsafe(self._abort_client(str(target), send), self.loop)
            return
        rid = f"{request_id or 'req'}-{next(self._ids)}"
        asyncio.run_coroutine_threadsafe(
            self._serve(rid, inputs, send, is_cancelled, request_id), self.loop)

    def stats(self) -> EngineStats:
        return self.engine.get_stats()

    @property
    def is_alive(self) -> bool:
        return self.engine.is_alive

    def shutdown(self) -> None:
        """In-flight requests end with an error; the loop thread is joined."""
        if not self._thread.is_alive():
            return
        self.engine.shutdown()
        fut = asyncio.run_coroutine_threadsafe(self._drain(), self.loop)
        try:
            fut.result(timeout=10)
        except Exception:  # noqa: BLE001 - best effort: we are going away
            logger.exception("draining in-flight requests")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the loop
    async def _drain(self) -> None:
        for _ in range(100):
            if not self._inflight:
                return
            await asyncio.sleep(0.05)

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
            if now - last_stats >= STATS_POLL_S:
                last_stats = now
                self.metrics.on_stats(self.engine.get_stats())

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
        except ValueError as e:             # rejected by the engine (e.g. prompt too long)
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
