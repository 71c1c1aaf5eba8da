"""The engine core in a process of its own: `python -m engine.core_process --fd N ...`.

Started by `CoreClient` (engine/core_client.py) with one end of a socket pair. It builds the
EngineCore, says READY (or ERROR and exits), then loops: take the frames that have arrived
(new requests, aborts, stats requests), run one step, send its outputs as one OUTPUTS frame.
With nothing to do it sleeps in `select` until a frame arrives. It exits when told to, when
the front end goes away (end of stream, or a write that finds the socket closed: noticed after
the step it is busy with), or on a malformed frame, after saying why in an ERROR frame. It
ignores SIGINT and SIGTERM and has a session of its own: its parent stops it
(engine/child_process.py). It never imports the tokenizer: it sees token ids only.

With `--peer-address NAME` it also takes peers: other front ends (the served model's other
instances, engine/prefix_routing.py) that connect to the abstract Unix socket NAME, get READY,
and then send ADD and ABORT frames of their own, numbered in their own space; each gets the
outputs of its own requests. A peer that goes away has its requests aborted; a peer that sends
anything else is told why (ERROR) and dropped. Peers never stop the core: their outputs wait in
a backlog of their own that is written as their sockets take it, and a peer that takes none of
it for PEER_STALL_S (its process stopped, its reader stuck; ENGINE_PEER_STALL_S sets it) is
dropped as one that went away. An abstract socket
has no file permissions: a peer whose process runs as another user is refused.

With `ENGINE_REQUEST_LOG=<file>` in its environment it appends to that file, once each request
ends, a JSON line of when (time.monotonic(), one clock for the machine's processes) it took the
request in and sent its first and final outputs, keyed by the core's and the front end's pids
and the front end's request index: joined with the front end's LLM_SERVING_TRACE, it tells a
request's time in the core from its time on the way there and back (scripts/ttft_trace.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import select
import socket
import sys
import time

from engine import child_process, wire
from engine.config import EngineConfig, model_key

logger = logging.getLogger("engine.core_process")

RECV_BYTES = 1 << 20
STALLED_FRAME_S = 30.0      # a frame begun and not finished this long: the peer is broken
PEER_STALL_S = 30.0         # a peer that takes none of its waiting outputs this long is dropped
PEER_STALL_ENV = "ENGINE_PEER_STALL_S"      # sets PEER_STALL_S (seconds)
# Set (seconds) to log, that often, where the core's time went: its steps' phases and GPU time
# (engine/step_timing.py), the time taking frames in and sending outputs, running / waiting.
STEP_LOG_ENV = "ENGINE_STEP_LOG_S"
REQUEST_LOG_ENV = "ENGINE_REQUEST_LOG"


# A peer's request k is the core's PEER_SPACE * peer + k (the parent's are below PEER_SPACE).
PEER_SPACE = 1 << 32


class _Exit(Exception):
    pass


class _Peer:
    """A front end other than the parent, connected through the peer address."""

    def __init__(self, sock: socket.socket, number: int, pid: int) -> None:
        self.sock = sock
        self.pid = pid                      # its process (the request log's key)
        self.base = PEER_SPACE * number
        self.reader = wire.FrameReader()
        self.encoder = wire.OutputsEncoder()
        self.live: set[int] = set()         # the core's ids of its unfinished requests
        self.backlog = bytearray()          # its outputs its socket has not taken yet
        self.waiting_since = 0.0            # when the backlog last grew from empty or shrank

    def send(self, data: bytes) -> None:
        if not self.backlog:
            self.waiting_since = time.monotonic()
        self.backlog += data
        self.flush()

    def flush(self) -> None:
        """Writes what the socket takes now, never waiting (OSError: the peer is gone)."""
        while self.backlog:
            try:
                n = self.sock.send(self.backlog)
            except BlockingIOError:
                return
            del self.backlog[:n]
            self.waiting_since = time.monotonic()

    def stalled(self, now: float, limit_s: float) -> bool:
        return bool(self.backlog) and now - self.waiting_since > limit_s


class CoreServer:
    def __init__(self, sock: socket.socket, core, info: wire.CoreInfo | None = None,
                 listener: socket.socket | None = None) -> None:
        self.sock = sock
        self.core = core
        self.reader = wire.FrameReader()
        self.encoder = wire.OutputsEncoder()
        self.info = info
        self.listener = listener            # peers connect here (--peer-address)
        self.peers: dict[socket.socket, _Peer] = {}
        self._peer_numbers = itertools.count(1)
        self.request_log = _RequestLog.from_env()
        self._front_pid = child_process.peer_credentials(sock)[0] if self.request_log else 0
        self.peer_stall_s = float(os.environ.get(PEER_STALL_ENV) or PEER_STALL_S)

    def serve(self) -> None:
        pending = []            # outputs of aborts, sent with the next step's
        log = _StepLog(self.core, float(os.environ.get(STEP_LOG_ENV) or 0))
        last_data = time.monotonic()    # when the front end's bytes last came
        while True:
            busy = self.core.has_unfinished_requests()
            timeout = 0.0 if busy else (
                max(0.0, last_data + STALLED_FRAME_S - time.monotonic())
                if self.reader.mid_frame else None)
            backlogged = [p.sock for p in self.peers.values() if p.backlog]
            if backlogged and timeout is None:
                timeout = self.peer_stall_s
            log.mark()
            readable, writable, _ = select.select(self._watched(), backlogged, [], timeout)
            if backlogged:
                self._flush_peers(writable)
            for sock in readable:
                if sock is self.sock:
                    data = self.sock.recv(RECV_BYTES)
                    if not data:
                        self.reader.eof()
                        raise _Exit("the front end closed the connection")
                    last_data = time.monotonic()
                    pending.extend(self._handle_frames(self.reader.feed(data)))
                elif sock is self.listener:
                    self._accept_peer()
                elif sock in self.peers:        # (not one dropped for a stall just now)
                    pending.extend(self._from_peer(self.peers[sock]))
            # (other wake-ups, a peer's socket taking its backlog, are no stall)
            if (not busy and self.reader.mid_frame
                    and time.monotonic() - last_data >= STALLED_FRAME_S):
                raise wire.FrameError(f"a frame stalled for {STALLED_FRAME_S:.0f} s")
            log.add("frames", busy)
            outputs = self.core.step() if self.core.has_unfinished_requests() else []
            log.add("step", busy)
            if pending:
                outputs, pending = pending + outputs, []
            if outputs:
                sent, stamp = outputs, time.monotonic()
                if self.peers:
                    outputs = self._send_to_peers(outputs)
                if outputs:
                    self.sock.sendall(self.encoder.encode(outputs))
                if self.request_log is not None:
                    self.request_log.sent(sent, stamp)
            log.add("send", busy)

    def _watched(self) -> list[socket.socket]:
        if self.listener is None:
            return [self.sock]
        return [self.sock, self.listener, *self.peers]

    # ------------------------------------------------------------------ peers
    def _accept_peer(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        if not same_user(sock):
            logger.warning("engine core: refused a peer that runs as another user")
            sock.close()
            return
        try:
            sock.setblocking(True)
            sock.sendall(wire.encode_ready(self.info))
            sock.setblocking(False)             # from now on: Peer.send, never waiting
        except OSError:
            sock.close()
            return
        self.peers[sock] = _Peer(sock, next(self._peer_numbers),
                                 child_process.peer_credentials(sock)[0])

    def _from_peer(self, peer: _Peer) -> list:
        try:
            try:
                data = peer.sock.recv(RECV_BYTES)
            except BlockingIOError:
                return []
            if not data:
                peer.reader.eof()
                return self._drop_peer(peer, None)
            outputs = []
            for kind, payload in peer.reader.feed(data):
                if kind == wire.ADD:
                    index, ids, params = wire.decode_add(payload)
                    request = self.core.make_request(peer.base + index, ids, params)
                    self.core.add_request(request)
                    peer.live.add(request.request_id)
                    if self.request_log is not None:
                        self.request_log.taken(request.request_id, peer.pid, index)
                elif kind == wire.ABORT:
                    ids = [peer.base + i for i in wire.decode_abort(payload)]
                    outputs.extend(self.core.abort_requests([i for i in ids if i in peer.live]))
                else:
                    raise wire.FrameError(f"a peer may not send {wire.KIND_NAMES[kind]} frames")
            return outputs
        except (wire.FrameError, ValueError) as e:
            return self._drop_peer(peer, f"the engine core dropped this peer: {e}")
        except OSError:
            return self._drop_peer(peer, None)

    def _drop_peer(self, peer: _Peer, error: str | None) -> list:
        """Closes the peer's connection (telling it `error`) and aborts its requests; the
        outputs of those aborts are nobody's and are dropped."""
        del self.peers[peer.sock]
        if error is not None:
            logger.warning("%s", error)
            try:
                peer.send(wire.encode_error(error))     # after its outputs: whole frames
            except OSError:
                pass
        peer.sock.close()
        if peer.live:
            outputs = self.core.abort_requests(sorted(peer.live))
            if self.request_log is not None:
                self.request_log.sent(outputs, time.monotonic())
        return []

    def _send_to_peers(self, outputs: list) -> list:
        """Sends each peer its requests' outputs (numbered in its space); returns the parent's."""
        own, theirs = [], {}
        for o in outputs:
            if isinstance(o.request_id, int) and o.request_id >= PEER_SPACE:
                theirs.setdefault(o.request_id // PEER_SPACE, []).append(o)
            else:
                own.append(o)
        for peer in list(self.peers.values()):
            mine = theirs.get(peer.base // PEER_SPACE)
            if not mine:
                continue
            for o in mine:
                if o.finish_reason is not None:
                    peer.live.discard(o.request_id)
            try:
                peer.send(peer.encoder.encode(
                    [dataclasses.replace(o, request_id=o.request_id - peer.base) for o in mine]))
            except OSError:
                self._drop_peer(peer, None)
        return own

    def _flush_peers(self, writable: list[socket.socket]) -> None:
        now = time.monotonic()
        for peer in list(self.peers.values()):
            try:
                if peer.sock in writable:
                    peer.flush()
            except OSError:
                self._drop_peer(peer, None)
                continue
            if peer.stalled(now, self.peer_stall_s):
                logger.warning("engine core: dropped a peer (pid %d) that took none of its %d "
                               "bytes of outputs in %.0f s", peer.pid, len(peer.backlog),
                               self.peer_stall_s)
                self._drop_peer(peer, None)

    def _handle_frames(self, frames) -> list:
        """Each frame in turn, but ABORT frames in a row are one abort: each abort_requests
        call filters the scheduler's queues, and a client's cancelled request with n
        completions sends n frames at once (a storm of them made thousands of passes over a
        queue thousands long). Frames of other kinds keep their place among the aborts."""
        outputs, aborts = [], []
        for kind, payload in frames:
            if kind == wire.ABORT:
                aborts.extend(wire.decode_abort(payload))
                continue
            if aborts:
                outputs.extend(self.core.abort_requests(aborts))
                aborts = []
            outputs.extend(self._handle(kind, payload))
        if aborts:
            outputs.extend(self.core.abort_requests(aborts))
        return outputs

    def _handle(self, kind: int, payload) -> list:
        if kind == wire.ADD:
            index, ids, params = wire.decode_add(payload)
            try:
                request = self.core.make_request(index, ids, params)
                self.core.add_request(request)
            except ValueError as e:     # the front end checks first: this is a protocol bug
                raise wire.FrameError(f"ADD for request {index}: {e}") from None
            if self.request_log is not None:
                self.request_log.taken(index, self._front_pid, index)
            return []
        if kind == wire.ABORT:
            return self.core.abort_requests(wire.decode_abort(payload))
        if kind == wire.STATS_REQ:
            wire.decode_empty(kind, payload)
            self.sock.sendall(wire.encode_stats(self.core.get_stats()))
            return []
        if kind == wire.SHUTDOWN:
            wire.decode_empty(kind, payload)
            raise _Exit("shutdown requested")
        raise wire.FrameError(f"the core does not take {wire.KIND_NAMES[kind]} frames")


class _RequestLog:
    """ENGINE_REQUEST_LOG: per request, when the core took it and sent its first and final
    outputs (see the module's docstring). One write per line to a file opened for appending,
    so the cores of several engines can share one file."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._core = os.getpid()
        self._open: dict[int, list] = {}    # the core's id: [front pid, index, taken, first]

    @classmethod
    def from_env(cls) -> _RequestLog | None:
        path = os.environ.get(REQUEST_LOG_ENV)
        return cls(path) if path else None

    def taken(self, request_id: int, front_pid: int, index: int) -> None:
        self._open[request_id] = [front_pid, index, time.monotonic(), None]

    def sent(self, outputs: list, now: float) -> None:
        """After `outputs` went out (or were dropped with their front end); `now` is from
        before the send, so a front end never sees them before this time."""
        for o in outputs:
            times = self._open.get(o.request_id)
            if times is None:
                continue
            if times[3] is None:
                times[3] = now
            if o.finish_reason is not None:
                del self._open[o.request_id]
                front, index, taken, first = times
                os.write(self._fd, (json.dumps({
                    "core": self._core, "front": front, "index": index, "taken": taken,
                    "first_sent": first, "final_sent": now, "finish": o.finish_reason})
                    + "\n").encode())


_LOGGED_STATS = ("num_computed_prompt_tokens", "num_cached_prompt_tokens",
                 "num_generated_tokens", "num_preemptions")


class _StepLog:
    """With an interval > 0 (ENGINE_STEP_LOG_S), logs that often where the busy loop's time
    went; otherwise does nothing. Time while idle (nothing to run) is not counted."""

    def __init__(self, core, interval_s: float) -> None:
        self.core = core
        self.interval = interval_s
        if interval_s > 0:
            core.times.gpu_events = True
            self.t = self.start = time.perf_counter()
            self.spent = {"frames": 0.0, "step": 0.0, "send": 0.0}
            self.times = core.times.copy()
            self.stats: dict[str, int] = {}

    def mark(self) -> None:
        if self.interval > 0:
            self.t = time.perf_counter()

    def add(self, what: str, busy: bool) -> None:
        if self.interval <= 0:
            return
        now = time.perf_counter()
        if busy:
            self.spent[what] += now - self.t
        self.t = now
        if now - self.start >= self.interval:
            times = self.core.times.since(self.times)
            n = max(times.steps, 1)
            stats = self.core.scheduler.stats
            logger.info("core %d steps in %.1f s: busy loop ms per step %s; step phases %s; "
                        "running %d, waiting %d; since the last line: prompt tokens computed %d "
                        "(cached %d), tokens generated %d, preemptions %d",
                        times.steps, now - self.start,
                        {k: round(1e3 * v / n, 3) for k, v in self.spent.items()},
                        times.per_step_ms(), self.core.scheduler.num_running,
                        self.core.scheduler.num_waiting,
                        *(getattr(stats, k) - self.stats.get(k, 0) for k in _LOGGED_STATS))
            self.stats = {k: getattr(stats, k) for k in _LOGGED_STATS}
            self.start, self.times = now, self.core.times.copy()
            self.spent = dict.fromkeys(self.spent, 0.0)


def same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of a Unix socket runs as this process's user."""
    return child_process.peer_credentials(sock)[1] == os.getuid()


def _listen(name: str) -> socket.socket:
    """A listening socket in Linux's abstract namespace: no file, gone with the process."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + name)
    listener.listen(64)
    listener.setblocking(False)
    return listener


def _send_error(sock: socket.socket, message: str) -> None:
    try:
        sock.sendall(wire.encode_error(message))
    except OSError:
        pass                    # nobody is listening any more


def default_cpu_threads(device_type: str = "cpu") -> int:
    """torch's intra-op threads for a core when `cpu_threads` is not set.

    On CPU: half the CPUs this process may run on, at least one. torch's own default (one per
    core) collapses when anything else wants a core: each parallel region waits for its slowest
    thread, and a descheduled one costs a scheduler slice. Measured on 2 cores beside two busy
    processes, two streams of the tiny model: 2 threads, one step per ~250 ms; 1 thread, ~0.8
    ms, as when idle. The rest is left to the front end, the tokenizer process and, when
    serving, the server.

    On a GPU: one. The host's torch work is staging copies of the step's inputs, which torch
    splits over every core from 32,768 elements (256 rows' block tables over 2,300-token
    contexts are 37,888): the threads spun between steps and took ~3 cores of the H200 host
    in served runs of long shared prompts (benchmarks/h200/served_shared_prefix.md)."""
    if device_type == "cuda":
        return 1
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)           # no affinity call outside Linux
    return max(1, cpus // 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fd", type=int, required=True, help="socket to the front end")
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    ap.add_argument("--eos-token-ids", default="[]", help="the tokenizer's EOS ids, JSON")
    ap.add_argument("--peer-address", default=None,
                    help="also take peers on this abstract Unix socket name")
    args = ap.parse_args(argv)
    child_process.ignore_stop_signals()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"core[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=args.fd)
    stop_watch = child_process.exit_if_parent_goes(sock, "engine core")
    try:
        # torch: only in this process's start-up
        from engine.engine_core import EngineCore, resolve_device

        config = EngineConfig.from_dict(json.loads(args.config))
        if config.cpu_threads is None:
            device_type = resolve_device(config.device).type
            config = dataclasses.replace(config, cpu_threads=default_cpu_threads(device_type))
        core = EngineCore(config, json.loads(args.eos_token_ids))
        info = wire.CoreInfo(core.max_model_len, core.vocab_size, core.kv.num_blocks,
                             config.block_size, core.eos_token_ids, model_key(config))
        listener = _listen(args.peer_address) if args.peer_address else None
        stop_watch()
    except BaseException as e:  # noqa: BLE001 - whatever it is, the front end must hear it
        logger.exception("engine core failed to start")
        _send_error(sock, f"the engine core failed to start: {e}")
        return 1
    try:
        sock.sendall(wire.encode_ready(info))
    except child_process.PEER_GONE:
        logger.info("engine core exiting: the front end went away during its start-up")
        core.shutdown()
        if listener is not None:
            listener.close()
        return 0
    code = 0
    try:
        CoreServer(sock, core, info, listener).serve()
    except _Exit as e:
        logger.info("engine core exiting: %s", e)
    except child_process.PEER_GONE:
        logger.info("engine core exiting: the front end went away")
    except wire.FrameError as e:
        logger.error("engine core got a malformed frame: %s", e)
        _send_error(sock, f"the engine core got a malformed frame: {e}")
        code = 2
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine core failed")
        _send_error(sock, f"the engine core failed: {e!r}")
        code = 1
    finally:
        core.shutdown()
        sock.close()
        if listener is not None:
            listener.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
