"""Starting an engine module in a child process of its own, with a socket pair to talk over.

Used for the engine core (engine/core_process.py) and the tokenizer process
(engine/tokenizer_process.py): a fresh interpreter (spawn semantics), the repository importable,
the child's end of the socket passed as `--fd N`.

Lifetime. The child runs in a session (and process group) of its own, so signals meant for the
caller's process group never reach it: a terminal's Ctrl-C (SIGINT to the foreground group),
`kill -TERM -- -PGID`. Its parent stops it (an end of stream or a SHUTDOWN frame on the socket);
`ignore_stop_signals` makes it ignore SIGINT and SIGTERM sent to it directly too (systemd, for
one, signals every process of a service at once). If the parent dies, the kernel closes the
parent's end of the socket and the child, seeing the end of stream, exits by itself (after the
step or batch it is busy with; a child still starting, which does not read its socket yet,
watches it with `exit_if_parent_goes`). Not PR_SET_PDEATHSIG: that fires when the *thread* that
forked the child ends, and an engine may be started from a short-lived thread.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (for a socket pair:
    the process that made it)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)


def python_executable() -> str:
    """The interpreter for child processes. Inside Triton's backend stub `sys.executable` can
    be the stub itself, so fall back to the environment's own python."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python") and os.access(exe, os.X_OK):
        return exe
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        candidate = os.path.join(sys.prefix, "bin", name)
        if os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(f"cannot find a python interpreter for the engine's processes "
                       f"(sys.executable={exe!r}, sys.prefix={sys.prefix!r})")


def start(module: str, args: list[str], env: dict[str, str] | None = None
          ) -> tuple[socket.socket, subprocess.Popen]:
    """Runs `python -m module --fd N *args` (env: os.environ by default); returns our end of
    the socket pair and the process."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(
        [_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    ours, child = socket.socketpair()
    try:
        process = subprocess.Popen(
            [python_executable(), "-m", module, "--fd", str(child.fileno()), *args],
            pass_fds=(child.fileno(),), env=env, start_new_session=True)
    except BaseException:
        ours.close()
        raise
    finally:
        child.close()
    return ours, process


def ignore_stop_signals() -> None:
    """For the child's main(): SIGINT and SIGTERM are its parent's business (see above)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


PEER_GONE = (BrokenPipeError, ConnectionResetError)   # the other end of the socket has closed


def exit_if_parent_goes(sock: socket.socket, what: str) -> Callable[[], None]:
    """For a child's start-up, while it does not read its socket (the engine core loading its
    model, tuning and capturing graphs: minutes on a GPU, holding its memory): a thread that
    ends the process at once if the parent's end of the socket closes, so a child still
    starting does not outlive a killed parent by its whole start-up. The parent sends nothing
    before the child is ready; should it, the watch ends. Returns the call that stops the
    watch, for before the child reads the socket itself (then an end of stream is its own)."""
    wake_r, wake_w = os.pipe()
    lock = threading.Lock()
    stopped = False

    def watch() -> None:
        select.select([sock, wake_r], [], [])
        with lock:
            if stopped:
                return
            try:
                gone = not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                gone = True
            if gone:
                logging.getLogger(__name__).info("%s exiting during start-up: the front end "
                                                 "went away", what)
                os._exit(0)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()

    def stop() -> None:
        nonlocal stopped
        with lock:
            stopped = True
        os.write(wake_w, b"x")
        thread.join()
        os.close(wake_r)
        os.close(wake_w)
    return stop
