"""A real `tritonserver` for tests: free ports, its own process group, a log file, a clean stop.

    from tests.tritonserver import start_server

    with start_server("path/to/model_repository") as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
        ...

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        with start_server(repo, log_dir=tmp_path_factory.mktemp("server")) as s:
            yield s

The server runs in a session of its own; `stop()` sends SIGTERM to its whole process group, as
a terminal's Ctrl-C or a service manager would (the `llm` model ends its streams when its stub
sees the signal: README, Stopping), and SIGKILLs the group after the grace period. Killing the
server alone can orphan its `triton_python_backend_stub` processes (one per model instance): a
stub exits once its server is gone, but not while the dead server is unreaped, nor when the
stub itself is stuck. The engine's own processes (core, tokenizer) run in sessions of their
own, outside the group: they exit when their stub is gone, and `stop()` waits for that (and
kills any still there after 10 s). Servers still running when the interpreter exits are
stopped too, and so are they when the process gets SIGTERM (`timeout`, a CI job's limit) while
SIGTERM has its default action: the servers are stopped, then the process ends by the signal
as it would have (a server runs in a session of its own, so the signal does not reach it, and
Python's default SIGTERM runs no atexit: a benchmark cut by `timeout` left a server holding
the GPU's memory).

A server that stops cleanly removes the shared-memory regions it made for its Python models
(`/dev/shm/triton_python_backend_shm_region_*`, ~1.6 MB each); one whose stub was killed, or
that was stopped by a signal with streams in flight, leaves some (test_server_signals.py left 10
per run). `stop()` removes those this server made that no live process maps: on a machine with
a small /dev/shm (Docker's default is 64 MB) they would pile up until a server cannot start.
It removes the server's `llm` instance board too (engine/instance_board.py), which a killed
stub leaves (the next board opened on the machine would remove it).
"""
from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence

from engine.instance_board import remove_boards_of
from scripts.tritonserver_env import (remove_orphan_regions, server_command, server_env,
                                      shm_regions)

_POLL_INTERVAL_S = 0.1
_MAX_PORT_ATTEMPTS = 3
_live_servers: set[TritonServer] = set()  # strong refs: a dropped server is still stopped


class TritonServer:
    """A started server. `http_url`, `grpc_url`, `metrics_url` are "localhost:PORT"."""

    def __init__(self, proc: subprocess.Popen, http_port: int, grpc_port: int,
                 metrics_port: int, log_path: str, metrics: bool = True,
                 shm_before: set[str] = frozenset()):
        self._proc = proc
        self.metrics = metrics          # the metrics endpoint is served (not --allow-metrics=false)
        self.pid = proc.pid
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.http_url = f"localhost:{http_port}"
        self.grpc_url = f"localhost:{grpc_port}"
        self.metrics_url = f"localhost:{metrics_port}"
        self.log_path = log_path
        self._shm_before = shm_before       # the regions there before it started: not its
        self._started = Processes({})       # what it had started once ready (note_started)
        _live_servers.add(self)

    def __enter__(self) -> TritonServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"TritonServer(pid={self.pid}, http={self.http_url}, grpc={self.grpc_url})"

    def returncode(self) -> int | None:
        """None while the server runs, else its exit status (negative: killed by that signal).

        Does not reap the server: until `stop()` does, its pid, which is also its process
        group's id, cannot be reused by an unrelated process that stop() would then kill."""
        if self._proc.returncode is not None:
            return self._proc.returncode
        info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def is_ready(self) -> bool:
        """Ready for inference and, when served, for metrics scrapes: the metrics endpoint
        starts a few tens of ms after the health endpoint says ready (a scrape made at once
        was refused on the GPU machine)."""
        urls = [f"http://{self.http_url}/v2/health/ready"]
        if self.metrics:
            urls.append(f"http://{self.metrics_url}/metrics")
        try:
            for url in urls:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status != 200:
                        return False
            return True
        except (urllib.error.URLError, OSError):  # refused, not ready (HTTP 400), timed out
            return False

    def log_tail(self, num_lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-num_lines:])
        except FileNotFoundError:
            return ""

    def wait(self, timeout_s: float) -> int | None:
        """Waits up to `timeout_s` for the server to exit, without reaping it (see
        `returncode`); returns its exit status, or None if it still runs."""
        server = Processes({self.pid: "tritonserver"})
        server.wait_gone(timeout_s)
        server.close()
        return self.returncode()

    def group_pids(self) -> list[int]:
        """Live (not zombie) processes of the server's process group: the server and its stubs."""
        return _live_pids_in_group(self.pid)

    def descendant_pids(self) -> dict[int, str]:
        """Live processes started by the server or by its descendants, {pid: command line}:
        the stubs and the engine processes they start (which are in sessions of their own).
        Those of a server that died are found under its stubs while they live."""
        found = {}
        for root in {self.pid, *self.group_pids()}:
            found.update(_live_descendants(root))
        return found

    def note_started(self) -> None:
        """Holds what the server has started by now, so that stop() waits for it even when
        the server and its stubs died first and left it to init (start_server calls this once
        the server is ready)."""
        self._started.close()
        self._started = Processes(self.descendant_pids())

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, wait up to `timeout_s` for the server, then
        SIGKILL whatever is left of the group; wait until none of it, nor any process the
        server started, is alive. Safe to call more than once."""
        descendants = Processes(self.descendant_pids())
        descendants.take(self._started)
        if self.returncode() is None:
            os.killpg(self.pid, signal.SIGTERM)  # not Popen.send_signal: that may reap it
            deadline = time.monotonic() + timeout_s
            while self.returncode() is None and time.monotonic() < deadline:
                time.sleep(_POLL_INTERVAL_S)
        if self._proc.returncode is None:  # not reaped yet, so the group id is still ours
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
        deadline = time.monotonic() + 10.0
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(_POLL_INTERVAL_S)
        outlived = descendants.wait_gone(10.0)  # the engine's: they exit once their stub has
        if outlived:
            descendants.kill()
            descendants.wait_gone(10.0)
        left = {**{pid: cmd for pid, (_, cmd) in descendants.fds.items()},
                **{pid: "" for pid in self.group_pids()}}
        descendants.close()
        _live_servers.discard(self)
        remove_orphan_regions(shm_regions() - self._shm_before)
        if left:
            raise RuntimeError(f"tritonserver {self.pid}: processes {left} survived SIGKILL")
        remove_boards_of(self.pid)          # its llm instances' board, if none could close it
        if outlived:
            raise RuntimeError(f"tritonserver {self.pid}: processes {outlived} outlived the "
                               f"server by 10 s (killed)")
        crash = self.stub_crash()
        if crash:
            raise RuntimeError(f"tritonserver {self.pid}: a model's stub crashed:\n{crash}")

    def stub_crash(self) -> str:
        """The log's report of a stub that crashed (the models enable faulthandler, which
        writes "Fatal Python error" and the threads' stacks), or ""."""
        try:
            with open(self.log_path, errors="replace") as f:
                log = f.read()
        except FileNotFoundError:
            return ""
        at = log.find("Fatal Python error")
        return log[at:at + 3000] if at >= 0 else ""


def start_server(model_repository: str | os.PathLike, extra_args: Sequence[str] = (),
                 timeout_s: float = 120.0, log_dir: str | os.PathLike | None = None,
                 cpus: set[int] | None = None) -> TritonServer:
    """Starts tritonserver on free localhost ports and waits until /v2/health/ready answers.

    Raises RuntimeError with the log's tail if the server exits first (e.g. a model fails to
    load), TimeoutError (server stopped) if it is not ready within `timeout_s`. The log goes
    to `log_dir` (default: a new temporary directory), see `TritonServer.log_path`. `cpus`:
    the CPUs the server and every process it starts may run on (default: this process's).
    """
    log_dir = str(log_dir) if log_dir is not None else tempfile.mkdtemp(prefix="tritonserver-")
    os.makedirs(log_dir, exist_ok=True)
    _stop_servers_on_sigterm()
    for attempt in range(_MAX_PORT_ATTEMPTS):
        server = _launch(os.path.abspath(model_repository), list(extra_args), log_dir, cpus)
        try:
            _wait_ready(server, timeout_s)
            server.note_started()
            return server
        except RuntimeError:
            server.stop(timeout_s=5.0)
            # Another process took a port between _free_ports() and the server's bind.
            if "already in use" in server.log_tail() and attempt + 1 < _MAX_PORT_ATTEMPTS:
                continue
            raise
        except BaseException:  # TimeoutError, KeyboardInterrupt: leave nothing running
            server.stop(timeout_s=5.0)
            raise
    raise AssertionError("unreachable")


def on_cpus(cpus: set[int] | None):
    """A Popen preexec_fn that confines the child (and all it starts) to `cpus`; None: none."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def _launch(model_repository: str, extra_args: list[str], log_dir: str,
            cpus: set[int] | None = None) -> TritonServer:
    log_path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log", dir=log_dir)[1]
    http_port, grpc_port, metrics_port = _free_ports(3)
    cmd = server_command(model_repository, http_port, grpc_port, metrics_port, extra_args)
    shm_before = shm_regions()
    with open(log_path, "wb") as log:
        # stdin closed, output to a file: the stubs inherit these, and a pipe held open by
        # a stub would outlive the server.
        proc = subprocess.Popen(cmd, env=server_env(), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=on_cpus(cpus))
    return TritonServer(proc, http_port, grpc_port, metrics_port, log_path,
                        metrics="--allow-metrics=false" not in extra_args, shm_before=shm_before)


def _wait_ready(server: TritonServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.is_ready():
        if server.returncode() is not None:
            raise RuntimeError(f"tritonserver exited with status {server.returncode()} before "
                               f"it was ready; log {server.log_path}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s; "
                               f"log {server.log_path}:\n{server.log_tail()}")
        time.sleep(_POLL_INTERVAL_S)


def _free_ports(count: int) -> list[int]:
    """Distinct ports the kernel considers free now (all sockets held until all are chosen).
    Another process may still take one before the server binds it; the server then exits
    with "already in use" in its log and start_server() tries new ports."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("localhost", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _proc_stats() -> dict[int, tuple[str, int, int]]:
    """{pid: (state, ppid, pgrp)} of every process."""
    stats = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        state, ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        stats[int(entry)] = (state, int(ppid), int(pgrp))
    return stats


def _live_pids_in_group(pgid: int) -> list[int]:
    return [pid for pid, (state, _, pgrp) in _proc_stats().items()
            if pgrp == pgid and state != "Z"]


def _live_descendants(root: int) -> dict[int, str]:
    stats = _proc_stats()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if stats[pid][0] == "Z":
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile
            continue
    return found


class Processes:
    """Processes, ours or not, held by pidfd: waiting on them needs no polling and reaps
    nothing, and a pid that another process takes after one exits is never mistaken for it."""

    def __init__(self, pids: dict[int, str]) -> None:
        self.fds: dict[int, tuple[int, str]] = {}
        for pid, cmdline in pids.items():
            try:
                self.fds[pid] = (os.pidfd_open(pid), cmdline)
            except ProcessLookupError:  # gone already
                pass

    def wait_gone(self, timeout_s: float) -> dict[int, str]:
        """Waits until all have exited or `timeout_s` has passed; returns those still alive."""
        deadline = time.monotonic() + timeout_s
        while self.fds:
            ready, _, _ = select.select([fd for fd, _ in self.fds.values()], [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for pid, (fd, _) in list(self.fds.items()):
                if fd in ready:
                    os.close(fd)
                    del self.fds[pid]
        return {pid: cmdline for pid, (_, cmdline) in self.fds.items()}

    def take(self, other: Processes) -> None:
        """Adds `other`'s processes (held since they started) to these; `other` is left empty."""
        for pid, held in other.fds.items():
            if pid in self.fds:             # held twice: keep ours
                os.close(held[0])
            else:
                self.fds[pid] = held
        other.fds.clear()

    def kill(self) -> None:
        for fd, _ in self.fds.values():
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_live_servers):
        server.stop(timeout_s=10.0)


def _stop_servers_on_sigterm() -> None:
    """While SIGTERM has its default action (and from the main thread, where handlers are
    set): on SIGTERM, stop the live servers, then end by SIGTERM."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    try:
        _stop_live_servers()
    finally:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
