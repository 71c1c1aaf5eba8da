"""engine/instance_board.py: loads and aborts shared by a model's instances, in one process
(boards of one key are two instances) and across processes."""
import json
import logging
import multiprocessing
import os
import shutil
import subprocess
import sys

import pytest

from engine.instance_board import (NUM_ABORTS, PREFIX, InstanceBoard, load_generation,
                                   remove_boards_of, server_key, slot_bit)

SERVER_PID = os.getpid()        # any live pid: the boards' key
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def boards(tmp_path):
    opened = []

    def board(model="llm"):
        opened.append(InstanceBoard(SERVER_PID, model, directory=str(tmp_path)))
        return opened[-1]
    yield board
    for b in opened:
        b.close()


def test_instances_of_one_model_share_a_board_and_see_each_others_loads(boards):
    a, b, other_model = boards(), boards(), boards("llm2")
    assert a.path == b.path != other_model.path and a.slot != b.slot
    a.set_load(5)
    b.set_load(2)
    assert b.peer_loads() == {os.getpid(): 5} and a.peer_loads() == {os.getpid(): 2}
    assert other_model.peer_loads() == {}


def test_only_an_instance_above_the_least_loaded_by_more_than_the_margin_waits(boards):
    a, b = boards(), boards()
    a.set_load(3)
    b.set_load(2)
    assert a.wait_turn(margin=1, max_wait_s=5) == 0.0         # within the margin
    assert b.wait_turn(margin=1, max_wait_s=5) == 0.0         # the least loaded never waits
    a.set_load(4)
    waited = a.wait_turn(margin=1, max_wait_s=0.05)           # nobody takes the load off
    assert waited >= 0.05


def test_a_waiting_instance_goes_on_once_the_others_have_caught_up(boards, monkeypatch):
    """While A waits, the other instance takes one request per poll (as Triton hands them
    over): A goes on at the poll that brings B within the margin, long before max_wait_s."""
    a, b = boards(), boards()
    a.set_load(10)
    b.set_load(0)
    polls = []

    def poll(seconds):
        polls.append(seconds)
        b.set_load(len(polls))
    monkeypatch.setattr("engine.instance_board.time.sleep", poll)
    a.wait_turn(margin=1, max_wait_s=60)
    assert len(polls) == 9                  # B at 9: 10 <= 9 + 1


def test_an_instance_alone_or_whose_peers_closed_never_waits(boards):
    a = boards()
    a.set_load(100)
    assert a.wait_turn(max_wait_s=5) == 0.0
    b = boards()
    b.close()
    assert a.wait_turn(max_wait_s=5) == 0.0


def _hold_a_slot(server_pid, directory, loaded, die):
    board = InstanceBoard(server_pid, "llm", directory=directory)
    board.set_load(0)
    loaded.set()
    die.wait(60)
    os._exit(0)                     # gone without closing its board, as a killed stub


def test_the_slot_of_a_process_that_is_gone_is_freed(tmp_path, boards):
    ctx = multiprocessing.get_context("spawn")
    loaded, die = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_a_slot, args=(SERVER_PID, str(tmp_path), loaded, die))
    child.start()
    try:
        assert loaded.wait(60)
        a = boards()
        a.set_load(5)
        assert a.peer_loads() == {child.pid: 0}
    finally:
        die.set()
        child.join(60)
    assert a.wait_turn(max_wait_s=30) < 30      # the dead peer (load 0) is not waited for
    assert a.peer_loads() == {}


OPENER = ("import sys\n"
          "from engine.instance_board import InstanceBoard\n"
          "b = InstanceBoard(int(sys.argv[1]), 'llm', directory=sys.argv[2])\n"
          "print(b.slot, flush=True)\n"
          "sys.stdin.readline()\n"
          "b.close()\n")


def test_wait_turn_never_frees_a_slot_a_new_instance_has_just_taken(tmp_path, monkeypatch):
    """Between wait_turn's look at a dead instance's slot and its freeing it, a new instance
    (Triton's restarted stub, another process) takes that slot: it must keep it (it was
    wiped, and the next instance got the same slot as a live one)."""
    import engine.instance_board as board_module
    a = InstanceBoard(SERVER_PID, "llm", directory=str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    a._slots[a.slot + 1] = (dead_pid, 0, 0)            # a crashed instance's slot
    a.set_load(5)
    real_alive, newcomer = board_module._alive, {}

    def alive(pid, start_time):                         # the moment in between
        if pid == dead_pid and not newcomer:
            newcomer["proc"] = subprocess.Popen(
                [sys.executable, "-c", OPENER, str(SERVER_PID), str(tmp_path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": ROOT})
            newcomer["slot"] = int(newcomer["proc"].stdout.readline())
        return real_alive(pid, start_time)

    monkeypatch.setattr(board_module, "_alive", alive)
    c = None
    try:
        a.wait_turn(max_wait_s=0.05)
        proc, slot = newcomer["proc"], newcomer["slot"]
        assert slot == a.slot + 1                        # it took the dead one's slot
        monkeypatch.setattr(board_module, "_alive", real_alive)
        assert a.slot_pids()[slot] == proc.pid
        c = InstanceBoard(SERVER_PID, "llm", directory=str(tmp_path))
        assert c.slot not in (a.slot, slot)
    finally:
        if "proc" in newcomer:
            newcomer["proc"].communicate("\n", timeout=60)
        if c is not None:
            c.close()
        a.close()


def _hold_and_die(server_pid, directory, loaded):
    board = InstanceBoard(server_pid, "llm", directory=directory)
    board.set_load(3)
    loaded.set()
    os._exit(0)                             # killed: no close()


def test_the_last_live_instance_removes_the_file_though_a_crashed_ones_slot_is_left(tmp_path):
    a = InstanceBoard(SERVER_PID, "llm", directory=str(tmp_path))
    ctx = multiprocessing.get_context("spawn")
    loaded = ctx.Event()
    child = ctx.Process(target=_hold_and_die, args=(SERVER_PID, str(tmp_path), loaded))
    child.start()
    assert loaded.wait(60)
    child.join(60)
    assert child.exitcode == 0
    assert a.peer_loads() == {child.pid: 3}            # its slot is still there
    a.close()                                           # the server's last live instance
    assert not os.path.exists(a.path)


def test_two_versions_of_a_model_have_boards_of_their_own(tmp_path):
    """Triton never gives one version's requests to the other's instances: sharing a board,
    they waited for each other and routed requests to each other's engines."""
    v1 = InstanceBoard(SERVER_PID, "llm", directory=str(tmp_path), model_version="1")
    v2 = InstanceBoard(SERVER_PID, "llm", directory=str(tmp_path), model_version="2")
    v1b = InstanceBoard(SERVER_PID, "llm", directory=str(tmp_path), model_version="1")
    try:
        assert v1.path == v1b.path != v2.path and v1.slot != v1b.slot
        v1.set_load(7)
        assert v2.peer_loads() == {} and v1b.peer_loads() == {os.getpid(): 7}
    finally:
        for b in (v1, v2, v1b):
            b.close()


def test_each_load_of_a_model_has_a_board_of_its_own(tmp_path):
    """A reload's new instances run beside the old ones while those drain their streams: on
    one board the new ones routed requests to the old engines, which Triton unloaded under
    them. A changed config or a changed file in the model's folder is another load; the
    instances of one load (the same config, the same files) share a board."""
    model_dir = tmp_path / "llm"
    (model_dir / "1" / "__pycache__").mkdir(parents=True)
    (model_dir / "1" / "model.py").write_text("# the model\n")
    (model_dir / "config.pbtxt").write_text('name: "llm"\n')
    config = json.dumps({"name": "llm", "parameters": {"max_num_seqs": {"string_value": "64"}}})
    first = load_generation(config, str(model_dir))
    assert load_generation(config, str(model_dir)) == first
    (model_dir / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"compiled")
    assert load_generation(config, str(model_dir)) == first     # Python's cache is no change
    changed = config.replace('"64"', '"32"')
    assert load_generation(changed, str(model_dir)) != first
    (model_dir / "1" / "model.py").write_text("# the model, edited\n")
    edited = load_generation(config, str(model_dir))
    assert edited != first
    old = InstanceBoard(SERVER_PID, "llm", str(tmp_path), model_version="1", generation=first)
    new = InstanceBoard(SERVER_PID, "llm", str(tmp_path), model_version="1", generation=edited)
    new_b = InstanceBoard(SERVER_PID, "llm", str(tmp_path), model_version="1", generation=edited)
    try:
        assert old.path != new.path == new_b.path
        old.set_load(7)
        assert new.peer_loads() == {os.getpid(): 0} and old.peer_loads() == {}   # new_b's
    finally:
        for b in (old, new, new_b):
            b.close()


def _place_and_die(server_pid, directory, target_slot, placed):
    board = InstanceBoard(server_pid, "llm", directory=directory)
    board.set_load(9)                       # 9 open requests...
    board.add_placed(target_slot, 7)        # ...7 of them run on the other instance's engine
    placed.set()
    os._exit(0)                             # killed: no close()


def _killed_instance(tmp_path, target_slot):
    """An instance (a process of its own) that placed 7 requests on `target_slot`'s engine and
    died without closing its board; its process, exited."""
    ctx = multiprocessing.get_context("spawn")
    placed = ctx.Event()
    child = ctx.Process(target=_place_and_die, args=(SERVER_PID, str(tmp_path), target_slot,
                                                     placed))
    child.start()
    assert placed.wait(60)
    child.join(60)
    return child


def test_what_a_killed_instance_placed_stops_counting_once_its_slot_is_freed(tmp_path, boards):
    """Loaded above the others, its slot is never the one wait_turn would wait for, so only
    free_dead_slots (prefix routing's connect loop) frees it; its placed row counted on."""
    ours = boards()
    child = _killed_instance(tmp_path, ours.slot)
    assert child.exitcode == 0 and ours.engine_loads()[ours.slot] == 7
    for load in range(10):
        ours.set_load(load)
        ours.wait_turn(max_wait_s=0.001)
    assert ours.engine_loads()[ours.slot] == 7              # still counted: why this exists
    other = next(iter(ours.peer_loads()))
    assert other == child.pid
    [freed] = ours.free_dead_slots()
    assert ours.engine_loads()[ours.slot] == 0 and ours.peer_loads() == {}
    assert ours.free_dead_slots() == [] and freed != ours.slot


def test_a_dead_instances_slot_is_freed_though_its_pid_names_another_process_now(tmp_path, boards):
    """A killed instance's pid may be given to another process before its slot is freed. The
    slot must still count as dead (its pid and the start time it had), or wait_turn waits for it
    on every call, its placed requests count on, no instance takes it, and the last instance's
    close leaves the file (found by review). The pid's reuse is written into the slot here: a
    live process of the test's own stands for the process the kernel gave the pid to."""
    ours = boards()
    child = _killed_instance(tmp_path, ours.slot)
    slot = ours.slot_pids().tolist().index(child.pid)
    dead_row = ours._slots[slot].copy()
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        def reuse_pid():
            ours._slots[slot] = dead_row
            ours._slots[slot, 0] = other.pid
            ours._slots[slot, 1] = 0                    # the least loaded: wait_turn looks at it
            ours._placed[slot, ours.slot] = 7
            assert ours.engine_loads()[ours.slot] == 7

        reuse_pid()
        ours.set_load(5)
        assert ours.wait_turn(max_wait_s=0.5) == 0.0
        assert ours.slot_pids()[slot] == 0 and ours.engine_loads()[ours.slot] == 0
        reuse_pid()
        assert ours.free_dead_slots() == [slot] and ours.engine_loads()[ours.slot] == 0
        newcomer = boards()
        assert newcomer.slot == slot
        newcomer.close()
        reuse_pid()
        ours.close()                                    # the last live instance
        assert not os.path.exists(ours.path)
    finally:
        other.communicate(b"", timeout=60)


def test_where_proc_is_another_pid_namespaces_slots_are_checked_by_pid(boards, monkeypatch):
    """In a pid namespace made without a /proc of its own, /proc/PID is another namespace's
    process: a slot then records no start time and its process is checked by os.kill, in the
    instances' own namespace. (Found by review: there a live instance's slot was handed to the
    next instance once the outer process that had its pid number exited.)"""
    import engine.instance_board as board_module
    assert board_module._proc_is_ours()                  # here, /proc is ours
    monkeypatch.setattr(board_module, "_proc_is_ours", lambda: False)
    a = boards()
    assert a._slots[a.slot, 2] == 0                     # so /proc/PID is never read for it
    b = boards()
    assert b.slot != a.slot and a.slot_pids()[a.slot] == os.getpid()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert not board_module._alive(int(gone.stdout), 0)


def test_an_instance_that_exited_unreaped_counts_as_gone():
    """A zombie (exited, its parent not yet told) still answers os.kill(pid, 0)."""
    import engine.instance_board as board_module
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"],
                            stdin=subprocess.PIPE)
    start = board_module._start_time(proc.pid)
    assert start and board_module._alive(proc.pid, start)
    proc.stdin.write(b"\n")
    proc.stdin.close()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)     # exited, left unreaped
    assert not board_module._alive(proc.pid, start)
    assert proc.wait(60) == 0


def test_an_instance_that_takes_a_slot_clears_what_the_slots_last_engine_held(boards):
    """Prefix routing's table: the bits of a slot's last instance would be wrong hints for
    the next one's engine, which starts empty."""
    a, b = boards(), boards()
    bit_a, bit_b = int(slot_bit(a.slot)), int(slot_bit(b.slot))
    a.prefix_keys[:3] = (11, 12, 13)
    a.prefix_holders[:3] = (bit_a, bit_a | bit_b, bit_b)
    old = a.slot
    a.close()
    c = boards()
    assert c.slot == old
    assert c.prefix_holders[:3].tolist() == [0, bit_b, bit_b]
    assert c.prefix_keys[:3].tolist() == [11, 12, 13]


def test_aborts_posted_by_one_instance_reach_the_others(boards):
    a, b, c = boards(), boards(), boards()
    assert b.take_aborts() == []
    assert a.post_abort("bls-1") and a.post_abort("bls-2")
    assert b.take_aborts() == ["bls-1", "bls-2"]
    assert b.take_aborts() == []                   # each is read once
    assert c.take_aborts() == ["bls-1", "bls-2"]
    assert not a.post_abort("bls-" + "x" * 60)     # longer than the ring's entries
    late = boards()
    assert late.take_aborts() == []                # posted before it came: not its business


def test_a_reader_too_far_behind_loses_the_oldest_aborts_and_says_so(boards, caplog):
    a, b = boards(), boards()
    for i in range(NUM_ABORTS + 3):
        a.post_abort(f"bls-{i}")
    with caplog.at_level(logging.WARNING, logger="engine.instance_board"):
        ids = b.take_aborts()
    assert ids == [f"bls-{i}" for i in range(3, NUM_ABORTS + 3)]
    assert "3 aborts" in caplog.text


def test_the_last_instance_removes_the_file_and_a_closed_board_does_nothing(boards):
    a, b = boards(), boards()
    a.close()
    assert os.path.exists(b.path)
    b.close()
    assert not os.path.exists(b.path)
    b.close()                                       # twice is fine
    b.set_load(3)
    assert b.peer_loads() == {} and b.take_aborts() == [] and not b.post_abort("bls-1")
    assert b.wait_turn(max_wait_s=5) == 0.0


def test_boards_of_servers_that_are_gone_are_removed(tmp_path, boards):
    """Of this pid namespace: a server whose pid is gone, and one whose pid a later process
    has (another start time). Not a live server's, nor one of another pid namespace (another
    container sharing /dev/shm), whose server may well be alive."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    ns, parent, start = server_key(os.getppid()).split("-")
    stale = tmp_path / f"{PREFIX}{ns}-{int(dead.stdout)}-{start}-llm"
    reused = tmp_path / f"{PREFIX}{ns}-{parent}-{int(start) - 1}-llm"
    live = tmp_path / f"{PREFIX}{server_key(os.getppid())}-llm"
    elsewhere = tmp_path / f"{PREFIX}{int(ns) + 1}-{int(dead.stdout)}-{start}-llm"
    for path in (stale, reused, live, elsewhere):
        path.write_bytes(b"\0" * 64)
    boards()
    assert not stale.exists() and not reused.exists()
    assert live.exists() and elsewhere.exists()


def test_a_board_is_keyed_by_the_servers_namespace_pid_and_start_time(boards):
    ns, pid, start = boards().name[len(PREFIX):].split("-", 3)[:3]
    assert (int(ns), int(pid)) == (os.stat("/proc/self/ns/pid").st_ino, SERVER_PID)
    with open(f"/proc/{SERVER_PID}/stat") as f:
        assert int(start) == int(f.read().rsplit(")", 1)[1].split()[19])


def _can_make_pid_namespaces() -> bool:
    """unshare(1) is there and may make a pid namespace here (root, or the capability)."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True,
                          timeout=30).returncode == 0


@pytest.mark.skipif(not _can_make_pid_namespaces(),
                    reason="needs unshare(1) allowed to make pid namespaces (root)")
def test_servers_that_are_pid_1_of_their_containers_keep_their_boards_apart(tmp_path):
    """Two servers, each pid 1 of its own pid namespace (containers sharing /dev/shm, as with
    docker --ipc=host), one still running, the other's instance opening its board: they shared
    one file (the key was the pid alone), and the second removed the first's as a dead
    server's. Then the first is killed and a third comes, with the same pids: it meets no
    ghost of the first on its board."""
    instance = ("import json, os, sys, time\n"
                "from engine.instance_board import InstanceBoard\n"
                "board = InstanceBoard(os.getppid(), 'llm', directory=sys.argv[1])\n"
                "board.set_load(5)\n"
                "print(json.dumps({'path': board.path, 'pid': os.getpid(),\n"
                "                  'peers': board.peer_loads()}), flush=True)\n"
                "if sys.argv[2] == 'stay':\n"
                "    sys.stdin.read()\n"         # until its server's test ends
                "    board.close()\n"
                "elif sys.argv[2] == 'die':\n"
                "    os._exit(0)\n"              # killed: its board is left behind
                "else:\n"
                "    board.close()\n")
    server = "import subprocess, sys; subprocess.run([sys.executable, '-c', *sys.argv[1:]])"

    def run(mode, stdin=None):
        return subprocess.Popen(["unshare", "-pf", "--mount-proc", sys.executable, "-c", server,
                                 instance, str(tmp_path), mode], stdin=stdin,
                                stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": ROOT})

    first = run("stay", stdin=subprocess.PIPE)
    try:
        one = json.loads(first.stdout.readline())
        two = json.loads(run("close").communicate(timeout=60)[0])
        assert one["pid"] == two["pid"] == 2            # the stub of pid 1, in each
        assert two["path"] != one["path"] and os.path.exists(one["path"])
        assert two["peers"] == {}
    finally:
        first.communicate(timeout=60)
    assert not os.path.exists(one["path"])              # its last instance removed it
    ghost = json.loads(run("die").communicate(timeout=60)[0])
    assert os.path.exists(ghost["path"])
    three = json.loads(run("close").communicate(timeout=60)[0])
    assert three["pid"] == ghost["pid"] and three["path"] != ghost["path"]
    assert three["peers"] == {}                         # no ghost to wait for
    os.unlink(ghost["path"])


def test_remove_boards_of_takes_only_that_servers_boards(tmp_path):
    ns = server_key(os.getpid()).split("-")[0]
    mine = [tmp_path / f"{PREFIX}{ns}-4242-7-llm", tmp_path / f"{PREFIX}{ns}-4242-9-llm_2"]
    others = [tmp_path / f"{PREFIX}{ns}-42421-7-llm",  # another pid that starts the same
              tmp_path / f"{PREFIX}{int(ns) + 1}-4242-7-llm"]      # another pid namespace's
    for path in mine + others:
        path.write_bytes(b"\0" * 64)
    removed = remove_boards_of(4242, directory=str(tmp_path))
    assert sorted(removed) == sorted(str(p) for p in mine)
    assert all(p.exists() for p in others) and not any(p.exists() for p in mine)


def test_any_model_name_gets_a_board_of_its_own(tmp_path, boards):
    """A model name of 200 characters (Triton takes folder names of up to 255 bytes) made the
    file name too long: no board, so no routing, no load balance, lost llm_bls aborts. And
    names that differ only in characters a file name cannot hold shared one board."""
    from engine.instance_board import remove_boards_of
    long_a, long_b = "m" * 200, "m" * 199 + "n"
    a, a2, b = boards(long_a), boards(long_a), boards(long_b)
    assert a.path == a2.path != b.path and a.slot != a2.slot
    assert len(os.path.basename(a.path)) < 255
    spaced, underscored, plain = boards("llm a"), boards("llm_a"), boards("llm-1.b")
    assert spaced.path != underscored.path
    assert plain.path.endswith(f"{server_key(SERVER_PID)}-llm-1.b")       # as it was
    assert len(remove_boards_of(SERVER_PID, str(tmp_path))) == 5    # still this server's
