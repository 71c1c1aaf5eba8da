"""engine/instance_board.py: loads and aborts shared by a model's instances, in one process
(boards of one key are two instances) and across processes."""
import logging
import multiprocessing
import os
import subprocess
import sys

import pytest

from engine.instance_board import NUM_ABORTS, PREFIX, InstanceBoard, remove_boards_of, slot_bit

SERVER_PID = os.getpid()        # any live pid: the boards' key


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
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = tmp_path / f"{PREFIX}{int(dead.stdout)}-llm"
    stale.write_bytes(b"\0" * 64)
    live = tmp_path / f"{PREFIX}{os.getppid()}-llm"
    live.write_bytes(b"\0" * 64)
    boards()
    assert not stale.exists() and live.exists()
    live.unlink()


def test_remove_boards_of_takes_only_that_servers_boards(tmp_path):
    mine = [tmp_path / f"{PREFIX}4242-llm", tmp_path / f"{PREFIX}4242-llm_2"]
    other = tmp_path / f"{PREFIX}42421-llm"           # another pid that starts the same
    for path in mine + [other]:
        path.write_bytes(b"\0" * 64)
    removed = remove_boards_of(4242, directory=str(tmp_path))
    assert sorted(removed) == sorted(str(p) for p in mine)
    assert other.exists() and not any(p.exists() for p in mine)
