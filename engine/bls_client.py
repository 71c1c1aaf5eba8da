"""The non-streaming model (`llm_bls`) over `llm`: many requests, no thread or BLS call held each.

A BLS call from a Python model holds one of tritonserver's threads for that model instance
(32 by default) until the called model's first response arrives; for a non-streaming request
that is the last one, so at most 32 requests could be in the engine at once. Here no BLS call
waits for a generation:

- a *result stream* is a long-lived streaming request from this instance to `llm`
  (`bls_open` = our owner key). `llm` answers it at once with an empty response, then sends
  one response per finished request of ours (`bls_request_id` + the usual outputs, or
  `bls_error`). One reader thread per result stream hands each result to its client.
  `llm` ends a result stream that has been idle a while, so it never holds up an unload;
- a *submission* is a short request (`bls_owner`, `bls_request_id` and the request's inputs):
  `llm` checks it, answers at once (an empty final response, or the error), and sends the
  result later on one of our result streams on that `llm` instance. An instance that has none
  answers NO_RESULT_STREAM; we open another (it may land on another instance) and retry.
- cancellation: one thread checks the clients' requests, a bounded number per round, and
  sends `abort_request_id` for the cancelled ones; their result then comes back as "abort".

The Triton calls are a `Transport` (see model_repository/llm_bls/1/model.py), so this is tested
without a server too.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)

# What `llm` answers a submission when this instance holds no result stream of the owner.
NO_RESULT_STREAM = "no result stream"
MAX_RESULT_STREAMS = 16
MAX_SUBMIT_TRIES = 24
CANCEL_POLL_S = 0.1
CANCEL_CHECKS_PER_POLL = 64     # is_cancelled() is a round trip: bounded work per round
SUBMIT_THREADS = 8
OPEN_TIMEOUT_S = 60.0


@dataclass
class Result:
    """One response on a result stream."""
    request_id: str | None                  # None: the stream's opening response
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    error: str | None = None


class SubmitError(Exception):
    pass


class Transport(Protocol):
    def open(self, owner: str) -> Iterator[str | Result]:
        """A result stream, opened when first iterated: the first item is the id `llm` gave
        it, then its results (each next() blocks for one); it stops when `llm` ends it. It is
        iterated on one thread from start to end (Triton's BLS iterators want the thread and
        the request object that made them)."""

    def submit(self, owner: str, request_id: str, inputs: dict[str, np.ndarray]) -> str:
        """Sends one request; returns, once `llm` accepted it, the id of the result stream its
        result will come on; else raises SubmitError."""

    def abort(self, request_id: str) -> None:
        """Asks `llm` to abort the request (its result then comes back as an abort)."""


class Client(Protocol):
    """The caller's request, as given to `submit`."""
    def is_cancelled(self) -> bool: ...
    def respond(self, outputs: dict[str, np.ndarray] | None, error: str | None,
                cancelled: bool) -> None: ...


class _Pending:
    __slots__ = ("client", "lock", "done", "cancelled", "stream_id")

    def __init__(self, client: Client) -> None:
        self.client = client
        self.stream_id: str | None = None  # where its result will come, once accepted
        self.lock = threading.Lock()      # respond() and is_cancelled() never overlap
        self.done = False                 # answered: the server may have freed the request
        self.cancelled = False


class BlsClient:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.owner = f"bls-{uuid.uuid4().hex[:12]}"
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._streams: set[str] = set()          # open result streams, by llm's id
        self._open_lock = threading.Lock()       # a burst opens one stream, not one each
        self._readers: list[threading.Thread] = []
        self._submitter = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="bls-submit")
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_cancellations, name="bls-cancel",
                                        daemon=True)
        self._poller.start()

    # ------------------------------------------------------------------ any thread
    def submit(self, client: Client, inputs: dict[str, np.ndarray]) -> None:
        """Never blocks; the client's `respond` is called exactly once, later."""
        request_id = f"{self.owner}-{next(self._ids)}"
        with self._lock:
            self._pending[request_id] = _Pending(client)
        self._submitter.submit(self._submit, request_id, inputs)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_result_streams(self) -> int:
        return len(self._streams)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._submitter.shutdown(wait=True)
        self._poller.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        for t in list(self._readers):       # they end when llm ends their streams
            t.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left, self._pending = list(self._pending.values()), {}
        for p in left:
            self._answer(p, None, "llm_bls is shutting down")

    # ------------------------------------------------------------------ submitter threads
    def _submit(self, request_id: str, inputs: dict[str, np.ndarray]) -> None:
        try:
            if not self._streams:
                with self._open_lock:
                    if not self._streams:
                        self._open_stream()
            for _ in range(MAX_SUBMIT_TRIES):
                try:
                    stream_id = self.transport.submit(self.owner, request_id, inputs)
                except SubmitError as e:
                    if NO_RESULT_STREAM not in str(e):
                        self._finish(request_id, None, str(e))
                        return
                    if len(self._streams) < MAX_RESULT_STREAMS:
                        self._open_stream()
                    continue
                with self._lock:
                    p = self._pending.get(request_id)
                    if p is not None and stream_id in self._streams:
                        p.stream_id = stream_id
                        return
                if p is not None:        # the stream ended before we heard where it went
                    self._finish(request_id, None, f"llm ended result stream {stream_id}")
                return
            self._finish(request_id, None, f"llm has no result stream for llm_bls after "
                                           f"{MAX_SUBMIT_TRIES} tries")
        except Exception as e:  # noqa: BLE001 - the client must always get its answer
            logger.exception("llm_bls: submitting %s", request_id)
            self._finish(request_id, None, f"internal error: {e}")

    def _open_stream(self) -> None:
        """Opens a result stream on a reader thread of its own; returns once it is open."""
        opened: Future = Future()
        t = threading.Thread(target=self._read, args=(self.transport.open(self.owner), opened),
                             name="bls-results", daemon=True)
        self._readers.append(t)
        t.start()
        opened.result(OPEN_TIMEOUT_S)

    # ------------------------------------------------------------------ reader threads
    def _read(self, results: Iterator[str | Result], opened: Future) -> None:
        try:
            stream_id = next(results)
        except BaseException as e:  # noqa: BLE001 - the submitter hears of it
            opened.set_exception(e)
            self._readers.remove(threading.current_thread())
            return
        with self._lock:
            self._streams.add(stream_id)
        opened.set_result(stream_id)
        reason = f"llm ended result stream {stream_id}"
        try:
            for r in results:
                if r.request_id is not None:
                    self._finish(r.request_id, r.outputs, r.error)
        except Exception as e:  # noqa: BLE001 - the stream broke: new ones will be opened
            logger.exception("llm_bls: result stream %s failed", stream_id)
            reason = f"llm result stream {stream_id} failed: {e}"
        finally:
            with self._lock:
                self._streams.discard(stream_id)
                orphans = [rid for rid, p in self._pending.items() if p.stream_id == stream_id]
            for rid in orphans:                  # accepted there, never answered
                self._finish(rid, None, reason)
            self._readers.remove(threading.current_thread())

    def _finish(self, request_id: str, outputs, error: str | None) -> None:
        with self._lock:
            p = self._pending.pop(request_id, None)
        if p is not None:
            self._answer(p, outputs, error)

    def _answer(self, p: _Pending, outputs, error: str | None) -> None:
        with p.lock:
            if p.done:
                return
            p.done = True
            try:
                p.client.respond(outputs if error is None else None, error, p.cancelled)
            except Exception:  # noqa: BLE001 - one client's failure is not the others'
                logger.exception("llm_bls: answering a request")

    # ------------------------------------------------------------------ cancellation
    def _poll_cancellations(self) -> None:
        cursor = 0
        while not self._stop.wait(CANCEL_POLL_S):
            with self._lock:
                items = list(self._pending.items())
            if not items:
                continue
            cursor %= len(items)
            batch = (items[cursor:] + items[:cursor])[:CANCEL_CHECKS_PER_POLL]
            cursor += len(batch)
            for request_id, p in batch:
                with p.lock:
                    if p.done or p.cancelled:
                        continue
                    try:
                        p.cancelled = p.client.is_cancelled()
                    except Exception:  # noqa: BLE001 - a broken check must not stop the poller
                        logger.exception("llm_bls: cancellation check")
                        continue
                if p.cancelled:
                    self._submitter.submit(self._abort, request_id)

    def _abort(self, request_id: str) -> None:
        try:
            self.transport.abort(request_id)
        except Exception:  # noqa: BLE001 - e.g. llm unloading: its own shutdown ends it
            logger.exception("llm_bls: aborting %s", request_id)
