"""What the instances of one served model share: their loads, and aborts meant for another.

Triton gives each request of a model to whichever of its instances is free, and an `llm`
instance is free again as soon as `execute` has queued the request: with one instance per GPU,
which GPU gets a request is chance (on CPU, 64 streams split 16/48, 26/38, 99/157 of 256 over
two instances). And a request that only names another request (llm_bls's `abort_request_id`)
reaches an arbitrary instance, not the one running its target: with two instances about half of
llm_bls's cancellations never reached their request.

The board is a small file in shared memory (`/dev/shm`) that every instance of the model in one
tritonserver maps (the key is the server's pid namespace, pid and start time, and the model's
name: `server_key`), no syscalls to read it:

- each instance has a slot (its pid and start time, its load: requests it holds). `wait_turn`,
  called at the end of `execute`, keeps the instance busy while it holds more than `margin`
  requests over the least-loaded live instance, for at most `max_wait_s`: Triton then hands
  the next requests to the others (the least-loaded one never waits, so two can never wait
  for each other);
- an abort that reached an instance which does not hold its target is posted to a ring of
  aborts that every instance reads on its housekeeping round;
- for prefix routing (engine/prefix_routing.py): how many requests each instance has placed on
  each instance's engine (a row per instance, written by it alone), and a table of prompt
  prefixes (block keys) and the instances whose engines took each (a bit per slot).

Slots of processes that are gone are taken back when found; the file of a server that is gone
is removed by the next board opened in its pid namespace, and the last instance to close a board
removes its file. (The board of a server killed in a container whose /dev/shm outlives it, with
no other server left in its pid namespace, stays until /dev/shm is cleared: whether a server of
another namespace is alive cannot be told from here, and removing a live one's board is worse.)
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import logging
import mmap
import os
import tempfile
import threading
import time

import numpy as np

logger = logging.getLogger(__name__)

MAGIC = 0x54524C4C4D45        # "TRLLME" (slots hold their process's start time)
NUM_SLOTS = 64
NUM_ABORTS = 256              # the ring: a reader more than this far behind loses the oldest
MAX_ABORT_ID_BYTES = 56
PREFIX_TABLE_BITS = 17        # entries of the prefix table: 2 ** 17 block keys, 2 MiB
_HEADER = 4                   # int64s: magic, abort sequence, two spare
_SLOT = 3                     # int64s per slot: pid, load, the process's start time
_ABORT = 8                    # int64s per ring entry: its sequence number, then the id's bytes
_PARTS = {                    # int64s of each part, in the file's order
    "header": _HEADER, "slots": NUM_SLOTS * _SLOT, "ring": NUM_ABORTS * _ABORT,
    "placed": NUM_SLOTS * NUM_SLOTS, "prefix_keys": 1 << PREFIX_TABLE_BITS,
    "prefix_holders": 1 << PREFIX_TABLE_BITS}
_SIZE_BYTES = 8 * sum(_PARTS.values())
PREFIX = "tritonllm-board-"

MARGIN = 1                    # requests an instance may hold over the least-loaded one
MAX_WAIT_S = 0.01             # the longest an execute call is held for the others
POLL_S = 0.0005


def slot_bit(slot: int) -> np.uint64:
    """A slot's bit in the prefix table's holder masks."""
    return np.uint64(1) << np.uint64(slot)


def _proc_is_ours() -> bool:
    """Whether /proc shows this process's pid namespace (not so in a pid namespace made
    without a /proc of its own: there /proc/PID is another namespace's process PID)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _alive(pid: int, start_time: int) -> bool:
    """Whether the process that took a slot lives: its pid, with the start time it had then
    (0: there was no /proc of its namespace to read). A pid alone is not enough: once the
    instance is gone its pid may be given to another process, and the slot would stay taken
    for good."""
    if start_time:
        return _start_time(pid) == start_time
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def board_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def pid_namespace() -> int:
    """This process's pid namespace (its inode), 0 where there is none to read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat's field 22); 0 if
    it is gone, a zombie (dead, not yet reaped), or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()     # from field 3 on: comm may hold ")"
        return 0 if fields[0] == b"Z" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return 0


def server_key(server_pid: int) -> str:
    """A server's part of its boards' file names: its pid namespace, pid and start time. Two
    servers that are each pid 1 of their own container and share /dev/shm (docker --ipc=host),
    or a server restarted under its old pid beside the board its killed predecessor left, would
    otherwise share one board: wait for each other's instances, route requests to each other's
    engines, remove each other's file."""
    return f"{pid_namespace()}-{server_pid}-{_start_time(server_pid)}"


def _server_of(name: str) -> tuple[int, int, int] | None:
    """(pid namespace, pid, start time) of a board's file name; None if it is not one."""
    if not name.startswith(PREFIX):
        return None
    fields = name[len(PREFIX):].split("-", 3)
    if len(fields) < 4 or not all(f.isdigit() for f in fields[:3]):
        return None
    return int(fields[0]), int(fields[1]), int(fields[2])


class InstanceBoard:
    def __init__(self, server_pid: int, model_name: str, directory: str | None = None,
                 model_version: str | None = None, generation: str | None = None) -> None:
        """Maps the board of `model_name` (of `model_version`: two versions loaded at once are
        two models to Triton, which never gives one's requests to the other; of `generation`,
        see load_generation) in the server `server_pid` (creating it) and takes a free slot.
        Raises OSError if the file cannot be made, RuntimeError if no slot is free."""
        directory = directory or board_dir()
        _remove_boards_of_dead_servers(directory)
        version = f"-v{_safe(str(model_version))}" if model_version is not None else ""
        version += f"-g{_safe(generation)}" if generation is not None else ""
        self.path = os.path.join(directory,
                                 f"{PREFIX}{server_key(server_pid)}-{_name_part(model_name)}{version}")
        self._lock = threading.Lock()       # this process's writers of its load
        self._load = 0
        self._fd = -1
        while True:                         # until the file we lock is the one at the path
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass                         # its last owner removed it: make it again
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        try:
            if os.fstat(fd).st_size < _SIZE_BYTES:
                os.ftruncate(fd, _SIZE_BYTES)
            self._mm = mmap.mmap(fd, _SIZE_BYTES)
            words = np.frombuffer(self._mm, dtype=np.int64)
            parts, start = {}, 0
            for name, size in _PARTS.items():
                parts[name], start = words[start:start + size], start + size
            self._header = parts["header"]
            self._slots = parts["slots"].reshape(NUM_SLOTS, _SLOT)
            self._ring = parts["ring"].reshape(NUM_ABORTS, _ABORT)
            self._placed = parts["placed"].reshape(NUM_SLOTS, NUM_SLOTS)
            self.prefix_keys = parts["prefix_keys"].view(np.uint64)
            self.prefix_holders = parts["prefix_holders"].view(np.uint64)
            if self._header[0] != MAGIC:
                words[:] = 0
                self._header[0] = MAGIC
            self.slot = self._take_slot()
            self._abort_cursor = int(self._header[1])   # aborts posted before we came are old
        except BaseException:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        self._fd = fd

    def _take_slot(self) -> int:
        """Under the file lock."""
        pids, starts = self._slots[:, 0], self._slots[:, 2]
        for i in range(NUM_SLOTS):
            if pids[i] == 0 or not _alive(int(pids[i]), int(starts[i])):
                self._free_slot(i)
                self._slots[i, 0] = os.getpid()
                self._slots[i, 2] = _start_time(os.getpid()) if _proc_is_ours() else 0
                return i
        raise RuntimeError(f"all {NUM_SLOTS} instance slots of {self.path} are taken")

    def _free_slot(self, i: int) -> None:
        """Under the file lock: slot i's process, load, placed requests and the prefixes its
        engine took are forgotten."""
        self._slots[i] = 0
        self._placed[i] = 0
        self.prefix_holders &= ~slot_bit(i)

    # ------------------------------------------------------------------ loads
    def set_load(self, num_requests: int) -> None:
        """The requests this instance holds now. Any thread; no system call."""
        with self._lock:
            if self._fd >= 0:
                self._load = num_requests
                self._slots[self.slot, 1] = num_requests

    @property
    def load(self) -> int:
        return self._load

    def peer_loads(self) -> dict[int, int]:
        """{pid: load} of the other instances with a slot."""
        with self._lock:
            if self._fd < 0:
                return {}
            return {int(pid): int(load) for i, (pid, load, _) in enumerate(self._slots)
                    if pid != 0 and i != self.slot}

    def wait_turn(self, margin: int = MARGIN, max_wait_s: float = MAX_WAIT_S,
                  poll_s: float = POLL_S) -> float:
        """Returns once this instance holds at most `margin` requests more than the least-loaded
        other live instance, or after `max_wait_s`; returns the seconds waited. No system call
        unless it waits (Triton's next request waits for this call)."""
        start = None
        checked: set[int] = set()
        while True:
            least = self._least_loaded_peer(self._load - margin, checked)
            if least is None:
                break
            now = time.monotonic()
            if start is None:
                start = now
            elif now - start >= max_wait_s:
                break
            time.sleep(poll_s)
        return 0.0 if start is None else time.monotonic() - start

    def _least_loaded_peer(self, below: int, checked: set[int]) -> int | None:
        """The lowest load among the other slots if it is below `below`, else None. Before it
        is waited for, its process is checked once per wait_turn (a system call); a slot
        whose process is gone is freed."""
        with self._lock:
            if self._fd < 0:
                return None
            while True:
                pids, loads = self._slots[:, 0], self._slots[:, 1]
                others = pids != 0
                others[self.slot] = False
                if not others.any():
                    return None
                i = int(np.flatnonzero(others)[np.argmin(loads[others])])
                pid, load = int(pids[i]), int(loads[i])
                if load >= below:
                    return None
                start = int(self._slots[i, 2])
                if pid in checked or _alive(pid, start):
                    checked.add(pid)
                    return load
                checked.add(pid)
                # Under the file lock, and only if it is still the dead one's: a new instance
                # may have taken the slot since it was read (_take_slot holds the lock).
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    if (int(self._slots[i, 0]), int(self._slots[i, 2])) == (pid, start):
                        logger.info("instance board: process %d is gone, freeing its slot", pid)
                        self._free_slot(i)
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ prefix routing
    @property
    def name(self) -> str:
        """The board's file name: unique per server and model."""
        return os.path.basename(self.path)

    def slot_pids(self) -> np.ndarray:
        """Each slot's process id (0: free), a copy."""
        with self._lock:
            return self._slots[:, 0].copy() if self._fd >= 0 else np.zeros(NUM_SLOTS, np.int64)

    def add_placed(self, slot: int, delta: int) -> None:
        """This instance has placed `delta` more requests on the engine of slot `slot`."""
        with self._lock:
            if self._fd >= 0:
                self._placed[self.slot, slot] += delta

    def free_dead_slots(self) -> list[int]:
        """Frees the slots whose processes are gone (a killed instance never closes its
        board): its load, and its requests placed on the engines, which dropped them with
        it, stop counting. A system call per slot: for a thread that looks every so often
        (prefix routing's); `wait_turn` frees only the slot it would wait for. Returns them."""
        freed = []
        with self._lock:
            if self._fd < 0:
                return freed
            fcntl.flock(self._fd, fcntl.LOCK_EX)     # not one that a new instance just took
            try:
                for i, (pid, _, start) in enumerate(self._slots.tolist()):
                    if pid and i != self.slot and not _alive(pid, start):
                        self._free_slot(i)
                        freed.append(i)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        for i in freed:
            logger.info("instance board: the process of slot %d is gone, freeing its slot", i)
        return freed

    def engine_loads(self) -> np.ndarray:
        """Per slot, the requests every live instance has placed on its engine."""
        with self._lock:
            if self._fd < 0:
                return np.zeros(NUM_SLOTS, np.int64)
            live = self._slots[:, 0] != 0
            return self._placed[live].sum(axis=0)

    # ------------------------------------------------------------------ aborts
    def post_abort(self, request_id: str) -> bool:
        """Tells the other instances to abort `request_id` (which this one does not hold).
        False if the id is too long for the ring."""
        data = request_id.encode()
        if len(data) > MAX_ABORT_ID_BYTES:
            logger.warning("instance board: abort id %r too long to pass on", request_id)
            return False
        padded = np.frombuffer(data.ljust(MAX_ABORT_ID_BYTES, b"\0"), dtype=np.int64)
        with self._lock:
            if self._fd < 0:
                return False
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                seq = int(self._header[1])
                entry = self._ring[seq % NUM_ABORTS]
                entry[0] = seq + 1
                entry[1:] = padded
                self._header[1] = seq + 1
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True             # read back by this instance too: aborting it again is harmless

    def take_aborts(self) -> list[str]:
        """The aborts posted since the last call (a memory read when there are none)."""
        with self._lock:
            if self._fd < 0 or int(self._header[1]) == self._abort_cursor:
                return []
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                end = int(self._header[1])
                start = max(self._abort_cursor, end - NUM_ABORTS)
                ids = [self._ring[seq % NUM_ABORTS, 1:].tobytes().rstrip(b"\0").decode(
                    errors="replace") for seq in range(start, end)
                    if self._ring[seq % NUM_ABORTS, 0] == seq + 1]
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            lost = start - self._abort_cursor
            self._abort_cursor = end
        if lost > 0:
            logger.warning("instance board: %d aborts were passed on before they were read", lost)
        return ids

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """Gives the slot back; the last instance removes the file. Safe to call twice; the
        other methods do nothing afterwards."""
        with self._lock:
            if self._fd < 0:
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._slots[self.slot] = 0
                self._placed[self.slot] = 0
                # The last live one (a crashed instance never closes: its pid stays in its slot)
                if not any(pid and _alive(pid, start) for pid, _, start in self._slots.tolist()):
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            del (self._header, self._slots, self._ring, self._placed, self.prefix_keys,
                 self.prefix_holders)                       # views of the mapping
            self._mm.close()
            os.close(self._fd)
            self._fd = -1


def load_generation(model_config: str, model_dir: str) -> str:
    """What tells one load of a model from the next: a digest of its Triton config (JSON, as
    the backend hands it to each instance) and of the times and sizes of the files in its
    folder (what makes Triton reload it). A reload's new instances start while the old ones
    drain their streams; on one board they routed requests to the old engines, which Triton
    then unloaded under them (it does not know they run there)."""
    h = hashlib.sha256(model_config.encode())
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            h.update(f"{os.path.relpath(path, model_dir)}:{st.st_mtime_ns}:{st.st_size}\n"
                     .encode())
    return h.hexdigest()[:12]


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _name_part(name: str) -> str:
    """A model's name in its board's file name: the name itself where it can be (letters,
    digits, "-_.", up to 64), else a readable start and a hash of the whole name. A long name
    (Triton takes folder names of up to 255 bytes) made the file name too long, and the model
    got no board; names that differ only where _safe maps to "_" ("llm a", "llm_a") would
    share one."""
    safe = _safe(name)
    if safe == name and len(name) <= 64:
        return name
    return f"{safe[:40]}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def is_board_of_dead_server(name: str) -> bool:
    """Whether `name` (a file name) is the board of a server of this pid namespace that is gone
    (no process has its pid, or one started at another time has)."""
    server = _server_of(name)
    if server is None or server[0] != pid_namespace():
        return False
    _, pid, start = server
    return _start_time(pid) != start


def _remove_boards_of_dead_servers(directory: str) -> None:
    for path in glob.glob(os.path.join(directory, PREFIX + "*")):
        if is_board_of_dead_server(os.path.basename(path)):
            try:
                os.unlink(path)
            except OSError:
                pass


def remove_boards_of(server_pid: int, directory: str | None = None) -> list[str]:
    """Removes the boards of server `server_pid` of this pid namespace, which must be gone (e.g.
    its stubs were killed, so no instance closed its board); returns their paths."""
    removed = []
    ours = f"{PREFIX}{pid_namespace()}-{server_pid}-*"
    for path in glob.glob(os.path.join(directory or board_dir(), ours)):
        if _server_of(os.path.basename(path)) is None:
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed
