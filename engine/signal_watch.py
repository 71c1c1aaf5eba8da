"""SIGINT / SIGTERM as a call on a thread of ours, in a process whose signals are not ours.

Made for Triton's Python backend stub. The 2.51 stub (python_backend src/pb_stub.cc, main())
installs a handler that does nothing for SIGINT and SIGTERM, so that a signal to the server's
whole process group (a terminal's Ctrl-C, `kill -TERM -- -PGID`) does not kill the stub: the
server stops its models itself, calling each model's finalize. It does not tell a model that
it is stopping, though, and it unloads a decoupled model only once every response it owes has
been sent, so a stream with many tokens to go holds the server up until --exit-timeout-secs
runs out (README, Stopping). The group's signal reaching the stub is the one sign we get.

`SignalWatch` puts Python's handler in the stub's place, for the given signals. Its C part
writes the signal's number to a socket (`signal.set_wakeup_fd`) that a thread of ours reads,
so `on_signal(signum)` runs at once, whatever the main thread is doing (the stub's main thread
waits in C++ for the server's next command and runs no Python until then). The Python
function itself does nothing, and runs whenever the main thread next runs Python. The handler
keeps SA_RESTART, as the stub's had (glibc `signal()`): Python's own would cut the stub's
blocking calls short with EINTR.

Main thread only (the rule of `signal.signal` and `signal.set_wakeup_fd`).
"""
from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


def _ignore(signum, frame) -> None:
    pass


class SignalWatch:
    def __init__(self, signals: Iterable[int], on_signal: Callable[[int], None]) -> None:
        """`on_signal(signum)` runs once, on a thread of its own, at the first of `signals`."""
        self._signals = set(signals)
        self._on_signal = on_signal
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._previous: dict[int, object] = {}
        self._previous_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        try:
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, _ignore)
                signal.siginterrupt(signum, False)          # SA_RESTART
        except BaseException:
            self._restore()
            self._read.close()
            self._write.close()
            raise
        self._thread = threading.Thread(target=self._watch, name="signal-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Main thread only. Stops the watch and puts back the handlers that were Python's; one
        installed from C (the stub's) cannot be put back, so ours, which does nothing, stays."""
        self._restore()
        self._write.shutdown(socket.SHUT_WR)                # the watching thread sees the end
        self._thread.join()
        self._read.close()
        self._write.close()

    def _restore(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)

    def _watch(self) -> None:
        fired = False
        while True:
            data = self._read.recv(64)     # signal numbers, one byte each (Python's others too)
            if not data:
                return
            ours = [signum for signum in data if signum in self._signals]
            if ours and not fired:
                fired = True
                try:
                    self._on_signal(ours[0])
                except Exception:  # noqa: BLE001 - nobody else would hear of it
                    logger.exception("handling signal %d", ours[0])
