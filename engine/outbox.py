"""Responses out at the rate the server takes them: per-stream coalescing over a few senders.

A stream is one client request's way back (its response sender). The engine's reader thread
`put`s each step's output into the stream; it never waits. A stream with something pending
sits once in a FIFO of ready streams; sender threads take the oldest, merge everything pending
into one response, and send it (a round trip to tritonserver, during which the sender holds
no GIL). Whatever arrived for that stream meanwhile sends it to the back of the FIFO again.

So when a sender is free, a step's output goes out at once, as before; when every sender is
busy, a stream's steps pile up while the others are served and leave as one response carrying
them all. No timer: latency is unchanged where there is headroom, and throughput holds where
there is not (the response rate is what the server can take, however many tokens that is).

A stream's first response and its final one go before every stream merely under way: under
load each stream waits its turn behind all the others (a few steps at 256 streams), which costs
a running stream's tokens nothing (they leave together in its next response) but would add those
steps to a new request's time to first token, and to the time its client waits for the end of a
request before it sends the next one (in a closed loop, that delay is the next request's).

A stream's `lock` is held while its response is sent: whoever asks the server about the
request (e.g. `is_cancelled()`) takes it too and checks `done` first, because once the final
response is out the server frees the request.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from contextlib import contextmanager
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# send_items(items) -> True once the stream's final response is out
SendItems = Callable[[list], bool]


class Stream:
    __slots__ = ("send_items", "on_failed", "coalesce", "pending", "queued", "done", "lock",
                 "context", "started", "urgent", "sending", "final_pending")

    def __init__(self, send_items: SendItems, on_failed: Callable[[BaseException], None],
                 coalesce: bool, context: Any) -> None:
        self.send_items = send_items
        self.on_failed = on_failed
        self.coalesce = coalesce      # False: one response per item (e.g. distinct results)
        self.pending: list = []
        self.queued = False           # in the ready FIFO, or being sent
        self.done = False             # the final response is out (or sending failed)
        self.started = False          # a sender has taken it once (its first response)
        self.urgent = False           # in the FIFO ahead of the streams under way
        self.sending = False          # a sender has it
        self.final_pending = False    # its last item is in `pending`
        self.lock = threading.Lock()
        self.context = context        # the owner's per-request state

    def release(self) -> None:
        """Once done: lets go of what it was sent with. Its callbacks and context hold its
        owner's request state, which holds the stream: a cycle that only the cyclic collector
        would free, with the request behind it (in Triton, its input tensors)."""
        self.pending = []
        self.send_items = self.on_failed = _released
        self.context = None


def _released(*args):
    raise RuntimeError("outbox: a stream used after it was done")


class Outbox:
    def __init__(self, num_senders: int, name: str = "outbox") -> None:
        if num_senders < 1:
            raise ValueError(f"num_senders must be >= 1, got {num_senders}")
        self._cond = threading.Condition()
        self._batching = threading.local()     # .items: puts held by this thread's batch()
        self._ready: deque[Stream] = deque()
        self._urgent: deque[Stream] = deque()  # ready with a first or final response: first
        self._closing = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(num_senders)]
        for t in self._threads:
            t.start()

    def stream(self, send_items: SendItems, on_failed: Callable[[BaseException], None],
               coalesce: bool = True, context: Any = None) -> Stream:
        return Stream(send_items, on_failed, coalesce, context)

    def put(self, stream: Stream, item, final: bool = False) -> None:
        """Any thread; never blocks on a send. `final`: the stream's last item (its response
        jumps the queue). Inside batch() on this thread, the item waits for the batch's end."""
        held = getattr(self._batching, "items", None)
        if held is not None:
            held.append((stream, item, final))
            return
        with self._cond:
            if self._add(stream, item, final):
                self._cond.notify()

    @contextmanager
    def batch(self):
        """The puts this thread makes inside go in together at the end, under one lock (the
        engine's reader puts a whole step's outputs: with a lock each, it spent half its time
        waiting for the lock the senders take after every send). Nests."""
        if getattr(self._batching, "items", None) is not None:
            yield
            return
        self._batching.items = held = []
        try:
            yield
        finally:
            self._batching.items = None
            if held:
                with self._cond:
                    woken = sum(self._add(*put) for put in held)
                    if woken:
                        self._cond.notify(woken)

    def _add(self, stream: Stream, item, final: bool) -> bool:
        """Under the lock; True if the stream joined a ready FIFO."""
        if stream.done:
            return False
        stream.pending.append(item)
        stream.final_pending |= final
        if stream.queued:
            if final and not (stream.urgent or stream.sending):   # a sender's: see _run
                self._ready.remove(stream)
                self._urgent.append(stream)
                stream.urgent = True
            return False
        stream.queued = True
        self._enqueue(stream)
        return True

    def _enqueue(self, stream: Stream) -> None:
        stream.urgent = stream.final_pending or not stream.started
        (self._urgent if stream.urgent else self._ready).append(stream)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is pending, then stops the senders."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout_s)

    @property
    def num_ready(self) -> int:
        return len(self._ready) + len(self._urgent)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._ready) and not self._closing:
                    self._cond.wait()
                if not (self._urgent or self._ready):
                    return
                s = self._urgent.popleft() if self._urgent else self._ready.popleft()
                s.started = s.sending = True
                if s.coalesce:
                    items, s.pending = s.pending, []
                else:
                    items = [s.pending.pop(0)]
                s.final_pending &= bool(s.pending)
            try:
                with s.lock:
                    try:
                        if not s.done and s.send_items(items):
                            s.done = True
                    except BaseException:
                        s.done = True   # before the lock goes: is_cancelled is not asked again
                        raise
            except BaseException as e:  # noqa: BLE001 - the client is gone or the server refused
                s.done = True
                try:
                    s.on_failed(e)
                except Exception:  # noqa: BLE001 - a sender thread must survive its callbacks
                    logger.exception("outbox: on_failed")
            with self._cond:
                s.sending = False
                if s.pending and not s.done:   # to the back: the others go first
                    self._enqueue(s)
                    self._cond.notify()
                else:
                    s.queued = False
                    if s.done:
                        s.release()
