"""The front end's handle on the engine core process: start it, talk to it, notice its death.

Two threads of ours, so the caller's event loop never waits on the socket:
- the sender takes (kind, args) off a queue, packs the frame and writes it (a long prompt's
  ADD frame can take a while to build and to be read);
- the reader reads frames, hands each step's outputs to `on_outputs` (on the reader thread),
  answers stats futures, and calls `on_dead` once if the core dies or talks nonsense.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict

from engine import child_process, wire
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import EngineCoreOutput

logger = logging.getLogger(__name__)

RECV_BYTES = 1 << 20
SHUTDOWN_WAIT_S = 10.0


class CoreDiedError(RuntimeError):
    pass


def _pin_device(config: EngineConfig, env: dict[str, str]) -> EngineConfig:
    """cuda:N -> the process sees only GPU N (as cuda:0)."""
    device = config.device
    if not device.startswith("cuda:"):
        return config
    index = int(device.split(":")[1])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:             # (an empty one hides every GPU)
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index >= len(ids):
            raise ValueError(f"device {device!r}: CUDA_VISIBLE_DEVICES={visible!r} has "
                             f"{len(ids)} device(s)")
        env["CUDA_VISIBLE_DEVICES"] = ids[index]
    else:
        import torch
        count = torch.cuda.device_count()     # (from NVML where it can: CUDA is not started)
        if index >= count:      # here, not in the core, which would see only its "cuda:0"
            raise ValueError(f"device {device!r} asked for, but "
                             + (f"this host has {count} GPU(s)" if count
                                else "no CUDA device is available"))
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    return EngineConfig(**{**asdict(config), "device": "cuda:0"})


class CoreClient:
    _gone_level = logging.ERROR     # how the core's end is logged
    def __init__(self, config: EngineConfig, eos_token_ids: list[int],
                 on_outputs: Callable[[list[EngineCoreOutput]], None],
                 on_dead: Callable[[str], None], peer_address: str | None = None) -> None:
        """Starts the core process and waits until it is READY (model loaded, KV cache sized);
        raises RuntimeError with the core's own message if it cannot start. With
        `peer_address`, the core also takes peers there (PeerCoreClient)."""
        env = dict(os.environ)
        config = _pin_device(config, env)
        args = ["--config", json.dumps(asdict(config)),
                "--eos-token-ids", json.dumps(list(eos_token_ids))]
        if peer_address:
            args += ["--peer-address", peer_address]
        sock, self.process = child_process.start("engine.core_process", args, env)
        self._connected(sock, on_outputs, on_dead)

    def _connected(self, sock: socket.socket,
                   on_outputs: Callable[[list[EngineCoreOutput]], None],
                   on_dead: Callable[[str], None]) -> None:
        self._sock = sock
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._reader = wire.FrameReader()
        self._decoder = wire.OutputsDecoder()
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._kill()
            raise
        sock.settimeout(None)       # a start-up timeout (a peer's) is not the threads'
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stats_waiters: deque[Future] = deque()
        self._lock = threading.Lock()
        self.dead_reason: str | None = None
        self._closing = False
        self._sender = threading.Thread(target=self._send_loop, name="core-sender", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="core-reader",
                                          daemon=True)
        self._sender.start()
        self._receiver.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    # ------------------------------------------------------------------ any thread
    def add(self, index: int, token_ids, params: SamplingParams) -> None:
        self._outbox.put((wire.ADD, (index, token_ids, params)))

    def abort(self, indices: list[int]) -> None:
        if indices:
            self._outbox.put((wire.ABORT, list(indices)))

    def request_stats(self) -> Future:
        """A future of the core's EngineStats, as of the end of its current step."""
        fut: Future = Future()
        with self._lock:
            if self.dead_reason is not None:
                fut.set_exception(CoreDiedError(self.dead_reason))
                return fut
            self._stats_waiters.append(fut)
        self._outbox.put((wire.STATS_REQ, None))
        return fut

    def shutdown(self) -> None:
        """Asks the core to exit, waits (then kills), joins our threads."""
        self._closing = True
        self._outbox.put((wire.SHUTDOWN, None))
        try:
            self.process.wait(SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("engine core did not exit in %.0f s: killing it", SHUTDOWN_WAIT_S)
        self._kill()
        self._outbox.put(None)
        self._sender.join(timeout=5)
        self._receiver.join(timeout=5)
        self._sock.close()

    # ------------------------------------------------------------------ start-up
    def _wait_ready(self) -> wire.CoreInfo:
        while True:
            data = self._sock.recv(RECV_BYTES)
            if not data:
                raise RuntimeError(self._closed_before_ready())
            for kind, payload in self._reader.feed(data):
                if kind == wire.READY:
                    return wire.decode_ready(payload)
                if kind == wire.ERROR:
                    raise RuntimeError(wire.decode_error(payload))
                raise RuntimeError(f"the engine core sent {wire.KIND_NAMES[kind]} before READY")

    def _closed_before_ready(self) -> str:
        code = self.process.wait()
        return (f"the engine core process exited during start-up (exit code {code}); see its "
                f"log above")

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # ------------------------------------------------------------------ sender thread
    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            kind, arg = item
            try:
                if kind == wire.ADD:
                    data = wire.encode_add(*arg)
                elif kind == wire.ABORT:
                    data = wire.encode_abort(arg)
                else:
                    data = wire.frame(kind)
            except Exception as e:  # noqa: BLE001 - a bug; nothing may wait for this forever
                logger.exception("cannot encode a %s frame", wire.KIND_NAMES[kind])
                self._die(f"cannot encode a {wire.KIND_NAMES[kind]} frame: {e!r}")
                self._kill()
                return
            try:
                self._sock.sendall(data)
                if kind == wire.SHUTDOWN:   # and nothing more: the core sees the end of stream
                    self._sock.shutdown(socket.SHUT_WR)
                    return
            except OSError as e:
                self._die(f"cannot write to the engine core: {e}")
                return

    # ------------------------------------------------------------------ reader thread
    def _recv_loop(self) -> None:
        try:
            while True:
                try:
                    data = self._sock.recv(RECV_BYTES)
                except ConnectionResetError:    # it died with frames of ours unread
                    data = b""
                if not data:            # its death, not a malformed frame, even mid-frame
                    cut = (" in the middle of a frame"
                           if self._reader.mid_frame and not self._closing else "")
                    self._die(self._exit_message() + cut)
                    return
                for kind, payload in self._reader.feed(data):
                    if kind == wire.OUTPUTS:
                        self._on_outputs(self._decoder.decode(payload))
                    elif kind == wire.STATS:
                        stats = wire.decode_stats(payload)
                        with self._lock:
                            fut = self._stats_waiters.popleft() if self._stats_waiters else None
                        # (a waiter cancelled meanwhile, e.g. its await timed out, is skipped)
                        if fut is not None and fut.set_running_or_notify_cancel():
                            fut.set_result(stats)
                    elif kind == wire.ERROR:
                        self._die(wire.decode_error(payload))
                        return
                    else:
                        raise wire.FrameError(
                            f"the front end does not take {wire.KIND_NAMES[kind]} frames")
        except wire.FrameError as e:
            self._die(f"malformed frame from the engine core: {e}")
            self._kill()
        except OSError as e:
            self._die(f"lost the engine core: {e}")
        except BaseException as e:  # noqa: BLE001 - e.g. on_outputs failing: nothing works now
            logger.exception("engine core reader failed")
            self._die(f"the engine front end failed: {e!r}")
            self._kill()

    def _exit_message(self) -> str:
        if self._closing:
            return "the engine was shut down"
        try:
            code = self.process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return "the engine core closed its connection"
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"the engine core process {self.process.pid} {how}"

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead_reason is not None:
                return
            self.dead_reason = reason
            waiters, self._stats_waiters = list(self._stats_waiters), deque()
        for fut in waiters:
            if fut.set_running_or_notify_cancel():      # (not one cancelled meanwhile)
                fut.set_exception(CoreDiedError(reason))
        if not self._closing:
            logger.log(self._gone_level, "engine core is gone: %s", reason)
        self._on_dead(reason)


class PeerCoreClient(CoreClient):
    """A connection to another front end's core, which takes peers at `address`
    (engine/core_process.py): the same add / abort, for requests of this front end. It does
    not own the core: `shutdown` only closes the connection, and the core's end (or the
    connection's) is `on_dead`. No stats: the core's owner reports them. The core's end is
    its owner's to report (a stopping server's instances end one after another)."""
    _gone_level = logging.INFO

    def __init__(self, address: str, on_outputs: Callable[[list[EngineCoreOutput]], None],
                 on_dead: Callable[[str], None], timeout_s: float = 10.0) -> None:
        """Connects and waits for READY; raises OSError if nobody takes peers at `address`,
        RuntimeError if the core says no or nothing in `timeout_s`."""
        self.process = None
        self.address = address
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect("\0" + address)
        except BaseException:
            sock.close()
            raise
        try:
            self._core_pid = child_process.peer_credentials(sock)[0]
            self._connected(sock, on_outputs, on_dead)
        except socket.timeout:
            sock.close()
            raise RuntimeError(f"the engine core at {address!r} did not answer in "
                               f"{timeout_s:.0f} s") from None
        except BaseException:
            sock.close()
            raise

    @property
    def pid(self) -> int:
        """The core's process (another front end's child)."""
        return self._core_pid

    def request_stats(self) -> Future:
        raise RuntimeError("a peer's stats are its owner's to report")

    def shutdown(self) -> None:
        """Also from `on_dead`, on the connection's own reader or sender thread: that one
        returns once `on_dead` has; the other is joined."""
        self._closing = True
        self._kill()
        self._outbox.put(None)
        for thread in (self._sender, self._receiver):
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._sock.close()

    def _kill(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _closed_before_ready(self) -> str:
        return f"the engine core at {self.address!r} closed the connection"

    def _exit_message(self) -> str:
        if self._closing:
            return "the connection was closed"
        return f"the engine core at {self.address!r} closed the connection"
