"""`llm`'s side of llm_bls's result streams (the protocol is described in engine/bls_client.py).

A result stream is a long-lived streaming request from one llm_bls instance (its `owner` key)
that carries the results of that instance's non-streaming requests back. This registry keeps
them per owner, hands one out (in turn) to each accepted request and counts what each still
owes, and gives back those that have been idle long enough to end: a stream that never ends
would hold up this model's unload forever, as Triton waits for in-flight requests first.
Thread-safe; no Triton, no I/O.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

IDLE_CLOSE_S = 2.0


@dataclass
class ResultStream:
    stream_id: str
    owner: str
    sink: Any                                  # the owner's way back (an outbox stream)
    requests: set[str] = field(default_factory=set)   # accepted, result not yet handed on
    last_used: float = field(default_factory=time.monotonic)


class ResultStreams:
    def __init__(self, idle_close_s: float = IDLE_CLOSE_S) -> None:
        self.idle_close_s = idle_close_s
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._by_owner: dict[str, list[ResultStream]] = {}
        self._by_id: dict[str, ResultStream] = {}
        self._turn = itertools.count()

    def open(self, owner: str, sink: Any) -> str:
        with self._lock:
            rs = ResultStream(f"rs-{next(self._ids)}", owner, sink)
            self._by_owner.setdefault(owner, []).append(rs)
            self._by_id[rs.stream_id] = rs
            return rs.stream_id

    def acquire(self, owner: str, request_id: str) -> ResultStream | None:
        """One of the owner's streams for this request (None: it has none here)."""
        with self._lock:
            streams = self._by_owner.get(owner)
            if not streams:
                return None
            rs = streams[next(self._turn) % len(streams)]
            rs.requests.add(request_id)
            rs.last_used = time.monotonic()
            return rs

    def release(self, stream_id: str, request_id: str) -> None:
        """The request's result has been handed to the stream."""
        with self._lock:
            rs = self._by_id.get(stream_id)
            if rs is not None:
                rs.requests.discard(request_id)
                rs.last_used = time.monotonic()

    def remove(self, stream_id: str) -> ResultStream | None:
        """Forgets a stream (its owner is gone); returns it, with the requests it still owed."""
        with self._lock:
            return self._forget(self._by_id.get(stream_id))

    def take_idle(self, now: float | None = None) -> list[ResultStream]:
        """Removes and returns the streams that owe nothing and were idle `idle_close_s`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [rs for rs in self._by_id.values()
                    if not rs.requests and now - rs.last_used >= self.idle_close_s]
            return [self._forget(rs) for rs in idle]

    def take_all(self) -> list[ResultStream]:
        with self._lock:
            return [self._forget(rs) for rs in list(self._by_id.values())]

    def __len__(self) -> int:
        return len(self._by_id)

    def _forget(self, rs: ResultStream | None) -> ResultStream | None:
        if rs is None:
            return None
        del self._by_id[rs.stream_id]
        streams = self._by_owner[rs.owner]
        streams.remove(rs)
        if not streams:
            del self._by_owner[rs.owner]
        return rs
