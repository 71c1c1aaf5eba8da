"""engine/core_process.py: the real core process, fed bad frames through its socket."""
import contextlib
import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from engine import child_process, wire
from engine.config import EngineConfig
from engine.core_client import CoreClient
from engine.sampling_params import SamplingParams
from scripts.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=2))


def _start(model_dir):
    died, outputs = [], []
    event = threading.Event()

    def on_dead(reason):
        died.append(reason)
        event.set()

    client = CoreClient(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                     num_kv_blocks=64, cpu_threads=1),
                        [], outputs.extend, on_dead)
    return client, died, event


BAD_FRAMES = {
    "random bytes": bytes(range(7, 57)),
    "wrong version": struct.pack("<BBBI", wire.MAGIC, wire.VERSION + 1, wire.ADD, 0),
    "truncated ADD payload": wire.frame(wire.ADD, b"\x01\x00\x00"),
}   # every other kind of bad frame, decoder by decoder: tests/test_wire.py


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_bad_frame_is_answered_with_an_error_and_the_core_exits(model_dir, name):
    client, died, event = _start(model_dir)
    try:
        start = time.monotonic()
        client._sock.sendall(BAD_FRAMES[name])
        assert event.wait(10), "the core neither answered nor exited"
        assert client.process.wait(10) == 2             # a malformed frame: exit code 2
        assert time.monotonic() - start < 10
        assert "malformed frame" in died[0], died
    finally:
        client.shutdown()


def test_a_stalled_partial_frame_does_not_stop_the_core_from_exiting(model_dir):
    client, died, event = _start(model_dir)
    try:
        client._sock.sendall(wire.frame(wire.ADD, b"x" * 100)[:20])   # half a frame, then nothing
        start = time.monotonic()
        client.shutdown()       # SHUTDOWN goes in as part of that frame, then end of stream
        assert time.monotonic() - start < 5
        assert client.process.returncode == 2          # "ended in the middle of a frame"
    finally:
        client.shutdown()       # a second call only makes sure the process is gone


def test_the_core_exits_quietly_when_its_front_end_goes_away_mid_generation(model_dir, capfd):
    stepping = threading.Event()
    client = CoreClient(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                     num_kv_blocks=64, cpu_threads=1),
                        [], lambda outputs: stepping.set(), lambda reason: None)
    try:
        for index in range(4):
            client.add(index, [1, 2, 3, 4, 5], SamplingParams(max_tokens=500, ignore_eos=True))
        assert stepping.wait(30)
        client._sock.shutdown(socket.SHUT_RD)      # its next step's outputs find nobody
        assert client.process.wait(30) == 0
    finally:
        client.shutdown()
    assert "Traceback" not in capfd.readouterr().err


_WATCHED_CHILD = """
import socket, sys, threading
from engine.child_process import exit_if_parent_goes
sock = socket.socket(fileno=int(sys.argv[1]))
stop = exit_if_parent_goes(sock, "test child")
if sys.argv[2] == "stop":
    stop()
    sock.sendall(b"s")                      # the watch is over: the parent may go
    sys.exit(3 if sock.recv(1) == b"" else 4)   # the end of stream is ours to see
threading.Event().wait()                    # a start-up that never ends
"""


@pytest.mark.parametrize("stop", [False, True], ids=["starting", "watch stopped"])
def test_a_child_still_starting_exits_when_its_parent_goes_away(stop):
    """exit_if_parent_goes: a child busy starting (here for ever) ends once its parent's end
    of the socket closes; once the watch is stopped, the end of stream is the child's own."""
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-c", _WATCHED_CHILD, str(theirs.fileno()), "stop" if stop else "-"],
        pass_fds=(theirs.fileno(),), cwd=ROOT)
    theirs.close()
    try:
        if stop:
            ours.settimeout(60)
            assert ours.recv(1) == b"s"
        ours.close()
        assert process.wait(60) == (3 if stop else 0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_core_whose_front_end_goes_away_during_start_up_exits_without_loading(model_dir,
                                                                                  capfd):
    """The core watches its socket from its first line: it does not load its model (minutes
    on a GPU, holding its memory) for a front end that is gone."""
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                          cpu_threads=1)
    sock, process = child_process.start("engine.core_process",
                                        ["--config", json.dumps(dataclasses.asdict(config))])
    try:
        sock.close()                        # gone before the core is
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    err = capfd.readouterr().err
    assert "engine core exiting during start-up: the front end went away" in err, err
    assert "Traceback" not in err


def test_a_core_killed_with_frames_unread_is_reported_with_its_signal(model_dir):
    # Its end of the socket then closes with data in it: our read gets ECONNRESET, not EOF.
    client, died, event = _start(model_dir)
    try:
        os.kill(client.pid, signal.SIGSTOP)
        client._sock.sendall(wire.frame(wire.STATS_REQ))     # in its socket, never read
        os.kill(client.pid, signal.SIGKILL)
        assert event.wait(10)
        assert "killed by signal 9" in died[0], died
    finally:
        client.shutdown()


def test_a_core_killed_in_the_middle_of_a_frame_is_reported_with_its_signal():
    """The core killed (the OOM killer) with one of its frames half written: the front end
    says it was killed, as for a death between frames, not that it sent a malformed frame.
    The core's end is a socket pair and a stand-in process (a real core cannot be stopped
    half-way through a write on cue)."""
    import subprocess
    from engine.outputs import EngineStats

    ours, core_end = socket.socketpair()
    stand_in = subprocess.Popen(["sleep", "120"])
    died, event = [], threading.Event()
    client = CoreClient.__new__(CoreClient)
    client.process = stand_in
    core_end.sendall(wire.encode_ready(wire.CoreInfo(1024, 100, 64, 16, [])))
    client._connected(ours, lambda outputs: None,
                      lambda reason: (died.append(reason), event.set()))
    try:
        stats = wire.encode_stats(EngineStats(*([0] * len(wire._STATS_FIELDS))))
        core_end.sendall(stats[:len(stats) // 2])
        stand_in.kill()
        stand_in.wait()
        core_end.close()
        assert event.wait(10)
        assert died == [f"the engine core process {stand_in.pid} killed by signal 9 in the "
                        f"middle of a frame"], died
    finally:
        client.shutdown()


def test_shutdown_closes_the_clients_socket(model_dir):
    client, died, _ = _start(model_dir)
    fd = client._sock.fileno()
    client.shutdown()
    assert client.process.returncode is not None
    assert client._sock.fileno() == -1, f"fd {fd} left open: {os.readlink(f'/proc/self/fd/{fd}')}"


def test_step_log_says_where_the_busy_loops_time_went(model_dir, caplog):
    """ENGINE_STEP_LOG_S: the core logs its steps' phases, the time taking frames in and
    sending outputs, and the running / waiting counts; set to 0 it logs nothing."""
    import logging
    from engine.core_process import _StepLog
    from engine.engine_core import EngineCore
    core = EngineCore(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                   num_kv_blocks=64, cpu_threads=1))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.add_request(core.make_request("a", [5, 6, 7], params))
    with caplog.at_level(logging.INFO, logger="engine.core_process"):
        quiet = _StepLog(core, 0.0)
        quiet.mark()
        quiet.add("step", True)
        assert not caplog.records
        log = _StepLog(core, 1e-9)
        for _ in range(3):
            log.mark()
            log.add("frames", True)
            core.step()
            log.add("step", True)
            log.add("send", True)
    text = caplog.text
    assert "busy loop ms per step" in text and "'frames'" in text and "'send'" in text
    assert "'schedule'" in text and "running 1, waiting 0" in text
    # The first step computes the 3 prompt tokens; the counts are per line, not running totals.
    assert "prompt tokens computed 3 (cached 0)" in text
    assert "prompt tokens computed 0 (cached 0)" in text and "preemptions 0" in text


# ---------------------------------------------------------------------------- peers
class _Collector:
    """on_outputs / on_dead of a client: outputs by index, finished indices, death."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, str] = {}
        self.died: list[str] = []
        self.changed = threading.Condition()

    def on_outputs(self, outputs) -> None:
        with self.changed:
            for o in outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
            self.changed.notify_all()

    def on_dead(self, reason: str) -> None:
        with self.changed:
            self.died.append(reason)
            self.changed.notify_all()

    def wait(self, predicate, timeout: float = 60.0) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout), (self.tokens, self.finished,
                                                               self.died)


@contextlib.contextmanager
def _with_peer(model_dir, timeout_s=10.0):
    """A core that takes peers, its owner's client and a peer's; both stopped however it
    ends. Yields (client, owner's collector, peer's client, peer's collector)."""
    from engine.core_client import PeerCoreClient
    address = _peer_address()
    owner = _Collector()
    client = CoreClient(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                     num_kv_blocks=64, cpu_threads=1),
                        [], owner.on_outputs, owner.on_dead, peer_address=address)
    try:
        peer = _Collector()
        peer_client = PeerCoreClient(address, peer.on_outputs, peer.on_dead, timeout_s)
        try:
            yield client, owner, peer_client, peer
        finally:
            peer_client.shutdown()
    finally:
        client.shutdown()


@contextlib.contextmanager
def _owner_and_raw_peer(model_dir, owner):
    """A core with 1024 KV blocks that takes peers, its owner's client (outputs to `owner`),
    and a peer's bare socket, past the core's READY; both closed however it ends."""
    address = _peer_address()
    client = CoreClient(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                     num_kv_blocks=1024, cpu_threads=1),
                        [], owner.on_outputs, owner.on_dead, peer_address=address)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer.settimeout(60)
        peer.connect("\0" + address)
        frames, reader = [], wire.FrameReader()
        while not frames:
            frames = reader.feed(peer.recv(1 << 16))
        assert frames[0][0] == wire.READY
        yield client, peer
    finally:
        peer.close()
        client.shutdown()


def _assert_pool_whole(client):
    stats = client.request_stats().result(timeout=10)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    return stats


def _peer_address():
    return f"tritonllm-test-core-{os.getpid()}-{time.monotonic_ns()}"


def test_a_peer_runs_requests_on_the_core_numbered_in_its_own_space(model_dir):
    with _with_peer(model_dir) as (client, owner, peer_client, peer):
        assert peer_client.info == client.info
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = {0: [5, 6, 7, 8], 1: [9, 10, 11]}
        for index, ids in prompts.items():      # the same indices from both front ends
            client.add(index, ids, greedy)
            peer_client.add(index, ids, greedy)
        for side in (owner, peer):
            side.wait(lambda side=side: len(side.finished) == 2)
        # Each front end got exactly its own requests' outputs, and the same greedy tokens.
        assert owner.tokens == peer.tokens and sorted(peer.tokens) == [0, 1]
        assert all(len(t) == 12 for t in peer.tokens.values())
        assert peer.finished == owner.finished == {0: "length", 1: "length"}
        _assert_pool_whole(client)
        assert not owner.died and not peer.died


def test_a_peer_that_goes_away_has_its_requests_aborted_and_the_core_carries_on(model_dir):
    with _with_peer(model_dir) as (client, owner, peer_client, peer):
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        peer_client.add(0, [5, 6, 7, 8], long)
        peer_client.add(1, [5, 6, 7, 9], long)
        peer.wait(lambda: len(peer.tokens.get(1, [])) >= 2)
        peer_client.shutdown()                  # mid-generation
        client.add(7, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                ignore_eos=True))
        owner.wait(lambda: 7 in owner.finished)
        # The peer's two requests were aborted, not run to their 500 tokens: the pool is whole.
        stats = _assert_pool_whole(client)
        assert stats.num_generated_tokens < 2 * 500
        assert not owner.died and client.process.poll() is None


def test_a_peer_that_stops_reading_does_not_stop_the_core_and_is_dropped(model_dir,
                                                                          monkeypatch):
    """A peer connected but not reading (its process stopped, its reader thread starved): the
    core keeps stepping for its owner (a blocking write to the peer used to freeze it once the
    socket's buffer filled, ~300 small frames), and drops the peer once it has taken none of
    its outputs for ENGINE_PEER_STALL_S, aborting its requests."""
    monkeypatch.setenv("ENGINE_PEER_STALL_S", "1")
    owner = _Collector()
    with _owner_and_raw_peer(model_dir, owner) as (client, peer):
        long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        for i in range(8):                      # and never reads again
            peer.sendall(wire.encode_add(i, [5, 6, 7, 8], long))
        client.add(1, [9, 10, 11], long)        # 900 steps: far past a full socket buffer
        owner.wait(lambda: 1 in owner.finished or owner.died)
        assert owner.finished == {1: "length"} and len(owner.tokens[1]) == 900, owner.died
        deadline = time.monotonic() + 60        # the peer dropped: its requests aborted
        while (stats := client.request_stats().result(timeout=10)).num_running:
            assert time.monotonic() < deadline, stats
        _assert_pool_whole(client)
        assert stats.num_generated_tokens < 900 + 8 * 900
        while peer.recv(1 << 16):               # what it had taken in, then the end
            pass
        assert not owner.died and client.process.poll() is None


def test_request_log_says_when_the_core_took_and_answered_each_request(model_dir, tmp_path,
                                                                       monkeypatch):
    """ENGINE_REQUEST_LOG: one line per request, its owner's and a peer's, keyed by the front
    end's pid, the core's pid and the front end's index (what the front end's trace carries),
    with its times in order; a peer's request cut off by the peer going away is logged as
    aborted."""
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("ENGINE_REQUEST_LOG", str(log))
    with _with_peer(model_dir) as (client, owner, peer_client, peer):
        assert peer_client.pid == client.pid != os.getpid()
        short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        before = time.monotonic()
        client.add(0, [5, 6, 7], short)
        peer_client.add(3, [5, 6, 8], short)
        peer_client.add(4, [5, 6, 9], SamplingParams(max_tokens=500, ignore_eos=True))
        owner.wait(lambda: 0 in owner.finished)
        peer.wait(lambda: 3 in peer.finished and peer.tokens.get(4))
        answered = time.monotonic()
        peer_client.shutdown()                  # request 4 mid-generation
        client.add(7, [1, 2, 3], short)
        owner.wait(lambda: 7 in owner.finished)
        _assert_pool_whole(client)      # a loop after request 7's line was written
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    by_key = {(t["front"], t["core"], t["index"]): t for t in lines}
    me, core = os.getpid(), client.pid
    assert len(lines) == 4 and set(by_key) == {(me, core, i) for i in (0, 3, 4, 7)}
    for i in (0, 3):
        t = by_key[(me, core, i)]
        assert before <= t["taken"] <= t["first_sent"] < t["final_sent"] <= answered, t
        assert t["finish"] == "length"
    cut = by_key[(me, core, 4)]
    assert cut["finish"] == "abort" and cut["first_sent"] <= answered < cut["final_sent"], cut


def test_a_peer_may_not_stop_the_core(model_dir):
    """SHUTDOWN (or stats) from a peer: the peer is told why and dropped, and its requests
    are aborted; the core and its owner's requests carry on."""
    with _with_peer(model_dir) as (client, owner, peer_client, peer):
        client.add(0, [1, 2, 3], SamplingParams(max_tokens=300, temperature=0.0,
                                                ignore_eos=True))
        peer_client.add(0, [5, 6, 7, 8], SamplingParams(max_tokens=500, ignore_eos=True))
        peer.wait(lambda: peer.tokens.get(0))
        peer_client._sock.sendall(wire.frame(wire.SHUTDOWN))
        peer.wait(lambda: peer.died)
        assert "may not send SHUTDOWN" in peer.died[0], peer.died
        owner.wait(lambda: 0 in owner.finished)
        assert owner.finished[0] == "length" and len(owner.tokens[0]) == 300
        _assert_pool_whole(client)
        assert not owner.died and client.process.poll() is None


def test_a_peers_connect_timeout_does_not_end_an_idle_connection(model_dir):
    """The start-up wait is bounded; once connected, a peer with nothing to hear for longer
    than that stays connected."""
    with _with_peer(model_dir, timeout_s=0.5) as (client, owner, peer_client, peer):
        with peer.changed:
            assert not peer.changed.wait_for(lambda: peer.died, 2.0), peer.died
        peer_client.add(0, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        peer.wait(lambda: 0 in peer.finished)
        assert not peer.died


def test_a_peer_hears_when_the_core_is_gone(model_dir):
    with _with_peer(model_dir) as (client, owner, peer_client, peer):
        peer_client.add(0, [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True))
        peer.wait(lambda: peer.tokens.get(0))
        client.shutdown()
        peer.wait(lambda: peer.died)
        assert "closed the connection" in peer.died[0], peer.died


def test_nobody_takes_peers_at_an_unknown_address():
    from engine.core_client import PeerCoreClient
    with pytest.raises(OSError):
        PeerCoreClient(_peer_address(), lambda outputs: None, lambda reason: None)


def test_a_peer_must_run_as_the_cores_user(monkeypatch):
    """An abstract socket has no file permissions: the core checks who connected."""
    from engine import core_process
    a, b = socket.socketpair()
    try:
        assert core_process.same_user(a)
        other = os.getuid() + 1
        monkeypatch.setattr(core_process.os, "getuid", lambda: other)
        assert not core_process.same_user(a)
    finally:
        a.close()
        b.close()


def test_the_core_dying_after_a_cancelled_stats_call_is_still_reported(model_dir):
    """A stats waiter cancelled (an `await engine.stats()` that timed out) and then the core's
    death: the death used to stop at the cancelled future, and nobody heard of it."""
    client, died, event = _start(model_dir)
    try:
        os.kill(client.pid, signal.SIGSTOP)             # it cannot answer
        fut = client.request_stats()
        assert fut.cancel()
        os.kill(client.pid, signal.SIGKILL)
        assert event.wait(10), "the core's death was not reported"
        assert "killed by signal 9" in died[0], died
    finally:
        client.shutdown()


def test_a_peer_taking_its_backlog_is_no_stalled_frame(model_dir):
    """The core idle, its owner's next frame half in, and a peer reading the outputs backed up
    for it: the peer's socket turning writable wakes the core's select with nothing to read,
    which it took for the 30 s stall of the owner's frame and exited (failing every request)."""
    import fcntl
    import termios
    owner = _Collector()
    with _owner_and_raw_peer(model_dir, owner) as (client, peer):
        params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
        for i in range(4):                      # the peer reads nothing meanwhile
            peer.sendall(wire.encode_add(i, [5, 6, 7, 8], params))
        deadline = time.monotonic() + 120       # the core idle, with the peer's backlog
        while (stats := client.request_stats().result(timeout=30)).num_running:
            assert time.monotonic() < deadline, stats
        add = wire.encode_add(1, [5] * 500, params)
        client._sock.sendall(add[:len(add) // 2])

        def unread() -> int:                    # bytes of ours the core has not read yet
            return struct.unpack("i", fcntl.ioctl(client._sock, termios.TIOCOUTQ, b"\0" * 4))[0]
        deadline = time.monotonic() + 30
        while unread():                         # the core has the half frame
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The peer takes its backlog, to its four requests' last outputs.
        reader, decoder, finished = wire.FrameReader(), wire.OutputsDecoder(), set()
        while len(finished) < 4:
            for kind, payload in reader.feed(peer.recv(1 << 16)):
                assert kind == wire.OUTPUTS, wire.KIND_NAMES[kind]
                finished |= {o.request_id for o in decoder.decode(payload)
                             if o.finish_reason is not None}
        client._sock.sendall(add[len(add) // 2:])      # the rest of the frame, well in time
        owner.wait(lambda: 1 in owner.finished or owner.died)
        assert owner.finished == {1: "length"} and not owner.died, owner.died
        assert client.process.poll() is None


def test_abort_frames_in_a_row_are_one_abort_and_keep_their_place_among_the_others(model_dir):
    """A cancelled request with n completions sends n ABORT frames at once: the core takes a
    run of them as one abort_requests (each call filters its queues: a storm of them made
    thousands of passes over a queue thousands long, found by review); the other frames keep
    their order around them, and each request ends aborted once."""
    from engine.core_process import CoreServer
    from engine.engine_core import EngineCore
    core = EngineCore(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                   num_kv_blocks=64, cpu_threads=1))
    events = []
    add, abort = core.add_request, core.abort_requests
    core.add_request = lambda request: (events.append(("add", request.request_id)), add(request))[1]
    core.abort_requests = lambda ids: (events.append(("abort", list(ids))), abort(ids))[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    frames = b"".join([wire.encode_add(0, [5, 6], params), wire.encode_add(1, [5, 7], params),
                       wire.encode_abort([0]), wire.encode_abort([1]), wire.encode_abort([9]),
                       wire.encode_add(2, [8], params), wire.encode_abort([2, 2])])
    a, b = socket.socketpair()
    try:
        server = CoreServer(b, core)
        outputs = server._handle_frames(server.reader.feed(frames))
    finally:
        a.close()
        b.close()
    assert events == [("add", 0), ("add", 1), ("abort", [0, 1, 9]), ("add", 2),
                      ("abort", [2, 2])]
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        (0, "abort"), (1, "abort"), (2, "abort")]
    assert not core.has_unfinished_requests()
