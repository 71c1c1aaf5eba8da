"""engine/prefix_routing.py: block keys, the router's choice, and requests run on a peer's core
(AsyncEngine.connect_peer). Through tritonserver: tests/test_serving_instances.py."""
import asyncio
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.instance_board import InstanceBoard, _start_time, slot_bit
from engine.prefix_routing import (FOLLOW_RATE_FOR_TURNS, FOLLOW_WINDOW, MIN_SHARED_BLOCKS,
                                   PrefixRouter, block_keys, core_address,
                                   position_weights)
from engine.sampling_params import SamplingParams
from scripts.make_tiny_model import make_tiny_model
from tests.waiting import wait_for

BS = 16


def test_block_keys_are_the_same_for_a_shared_prefix_and_differ_after_it():
    w = position_weights(1024)
    rng = np.random.default_rng(1)
    shared = rng.integers(0, 32000, 5 * BS)
    a = block_keys(np.concatenate([shared, rng.integers(0, 32000, 40)]), BS, w)
    b = block_keys(np.concatenate([shared, rng.integers(0, 32000, 40)]), BS, w)
    assert len(a) == len(b) == 7                        # full blocks only
    assert (a[:5] == b[:5]).all() and (a[5:] != b[5:]).all()
    assert len(set(a.tolist())) == 7 and (a != 0).all()
    # A block's key depends on where it is: the same tokens one block later are another key.
    assert block_keys(np.tile(shared[:BS], 2), BS, w)[1] != block_keys(shared[:BS], BS, w)[0]
    assert len(block_keys(shared[:BS - 1], BS, w)) == 0


def test_block_keys_are_the_same_in_every_process():
    """The instances are processes of their own (Python's hash() would differ)."""
    ids = list(range(100, 100 + 3 * BS))
    code = ("import numpy as np; from engine.prefix_routing import block_keys, position_weights;"
            f"print(block_keys(np.array({ids}), {BS}, position_weights(1024)).tolist())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert eval(out) == block_keys(np.array(ids), BS, position_weights(1024)).tolist()


class _Engine:
    """What the router asks of the engine: the peer cores connected, and to connect to one
    (here nobody takes peers: the sleeper runs no core)."""

    def __init__(self) -> None:
        self.connected: list[str] = []
        self.tried: list[str] = []

    def peers(self) -> list[str]:
        return list(self.connected)

    def connect_peer(self, address: str, timeout_s: float) -> None:
        self.tried.append(address)
        raise OSError("nobody takes peers there")


def test_a_core_address_fits_an_abstract_socket_whatever_the_model_name(tmp_path):
    """A long model name (Triton allows them) made a name past the 107 bytes an abstract
    socket takes, and the core could not take peers; such a name goes by its hash."""
    import socket
    short = InstanceBoard(os.getpid(), "llm", str(tmp_path))
    long = InstanceBoard(os.getpid(), "m" * 120, str(tmp_path))
    try:
        assert core_address(short, 123, 4).startswith(short.name)       # readable when it fits
        addresses = {core_address(long, pid, slot) for pid in (123, 124) for slot in (0, 1)}
        assert len(addresses) == 4
        for address in addresses:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind("\0" + address)
    finally:
        short.close()
        long.close()


@pytest.fixture
def two_instances(tmp_path):
    """This process's board and router, and a second instance: a live process of its own (a
    sleeper) whose slot we fill in by hand."""
    board = InstanceBoard(4242, "llm", str(tmp_path))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        peer_slot = next(i for i in range(64) if i != board.slot)
        board._slots[peer_slot] = (sleeper.pid, 0, _start_time(sleeper.pid))   # pid, load, start
        engine = _Engine()
        router = PrefixRouter(board, engine, BS, max_num_seqs=16, max_model_len=4096)
        yield router, engine, peer_slot, sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()
        board.close()


def test_the_connect_loop_frees_the_slot_of_an_instance_that_is_gone(two_instances):
    """What it placed on our engine stops counting in the engines' loads, its prefixes'
    bits go, and its failed connection is forgotten, once the connect loop's look finds its
    process gone."""
    router, engine, peer_slot, peer_pid = two_instances
    board = router.board
    board._placed[peer_slot, board.slot] = 5
    board.prefix_holders[7] = slot_bit(peer_slot) | slot_bit(board.slot)
    router.connect_new_peers()
    assert engine.tried == [core_address(board, peer_pid, peer_slot)]
    assert board.engine_loads()[board.slot] == 5                 # alive: it counts
    os.kill(peer_pid, 9)
    os.waitpid(peer_pid, 0)
    router.connect_new_peers()
    assert board.slot_pids()[peer_slot] == 0 and board.engine_loads()[board.slot] == 0
    assert board.prefix_holders[7] == slot_bit(board.slot)
    assert router._failed == {}     # its failed connection is forgotten: restarts add none


def test_a_prompt_goes_to_the_connected_engine_that_took_its_prefix(two_instances):
    router, engine, peer_slot, peer_pid = two_instances
    own = router.board.slot
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, 32000, 10 * BS)
    first = np.concatenate([prefix, rng.integers(0, 32000, 30)])
    second = np.concatenate([prefix, rng.integers(0, 32000, 30)])
    here, there = (own, None), (peer_slot, core_address(router.board, peer_pid, peer_slot))
    assert router.choose(second) == here                # no peer connected: here, unclaimed
    engine.connected.append(core_address(router.board, peer_pid, peer_slot))
    router.claim(first, peer_slot)
    assert router.choose(second) == there
    # It claimed the second prompt's own blocks for the peer too: a third with the same
    # 11 blocks goes there; one that shares fewer than MIN_SHARED_BLOCKS stays here.
    assert router.choose(np.concatenate([second[:11 * BS], rng.integers(0, 32000, 5)])) == there
    short = np.concatenate([prefix[:(MIN_SHARED_BLOCKS - 1) * BS],
                            rng.integers(0, 32000, 8 * BS)])
    assert router.choose(short) == here
    # A prompt of its own stays here, and is claimed for this instance.
    alone = rng.integers(0, 32000, 12 * BS)
    assert router.choose(alone) == here
    assert router.choose(np.concatenate([alone, [7] * 40])) == here
    # A peer that is no longer connected is not chosen.
    engine.connected.clear()
    assert router.choose(second) == here


def test_new_prefixes_go_to_the_engines_in_turn_once_most_prompts_follow_one(two_instances):
    """Plain traffic (no prompt finds its prefix held) runs here, as Triton placed it. Once
    most prompts lately found theirs held (the follow rate), a new prefix is a group's first
    member: new prefixes go to the reachable engines in turn (ours first), whatever the loads,
    and their groups follow them. Prompts too short to share take no turn."""
    router, engine, peer_slot, peer_pid = two_instances
    own = router.board.slot
    engine.connected.append(core_address(router.board, peer_pid, peer_slot))
    rng = np.random.default_rng(4)
    here, there = (own, None), (peer_slot, core_address(router.board, peer_pid, peer_slot))

    def member(prefix):
        return np.concatenate([prefix, rng.integers(0, 32000, 20)])
    for _ in range(3 * FOLLOW_WINDOW):                          # plain traffic
        assert router.choose(rng.integers(0, 32000, 10 * BS)) == here
    assert router.follow_rate == 0
    first = rng.integers(0, 32000, 8 * BS)
    assert router.choose(member(first)) == here
    for _ in range(2 * FOLLOW_WINDOW):                          # its group follows
        assert router.choose(member(first)) == here
    assert router.follow_rate > 0.8
    router.placed(own, 5)                                       # ours busier: no matter
    groups = [rng.integers(0, 32000, 8 * BS) for _ in range(4)]
    assert [router.choose(member(g)) for g in groups] == [here, there, here, there]
    router.placed(own, -5)
    for g, at in zip(groups, [here, there, here, there]):       # the groups follow
        assert router.choose(member(g)) == at
    assert router.choose(rng.integers(0, 32000, (MIN_SHARED_BLOCKS - 1) * BS)) == here
    assert router.choose(member(rng.integers(0, 32000, 8 * BS))) == here   # ours' turn again
    while router.follow_rate >= FOLLOW_RATE_FOR_TURNS:          # plain traffic again: here
        assert router.choose(rng.integers(0, 32000, 10 * BS)) in (here, there)
    assert router.choose(rng.integers(0, 32000, 10 * BS)) == here
    assert router.choose(rng.integers(0, 32000, 10 * BS)) == here


def test_an_engine_busier_than_ours_by_the_slack_keeps_the_request_here(two_instances):
    """A prefix only the peer's engine holds goes there while its load is within
    max_num_seqs / 2 (here 16 / 2 = 8) of ours; past that it runs here, and then both hold it."""
    router, engine, peer_slot, peer_pid = two_instances
    own = router.board.slot
    engine.connected.append(core_address(router.board, peer_pid, peer_slot))
    rng = np.random.default_rng(3)
    here, there = (own, None), (peer_slot, core_address(router.board, peer_pid, peer_slot))

    def ask():
        """A prompt whose 8-block prefix only the peer's engine has taken."""
        prefix = rng.integers(0, 32000, 8 * BS)
        router.claim(prefix, peer_slot)
        return prefix, router.choose(np.concatenate([prefix, rng.integers(0, 32000, 20)]))
    assert router.slack == 8
    router.board._placed[peer_slot, peer_slot] = 7          # 7 < 0 + 8: there
    assert ask()[1] == there
    router.board._placed[peer_slot, peer_slot] = 8          # 8 >= 0 + 8: here
    prefix, choice = ask()
    assert choice == here
    router.placed(own, 1)                                   # 8 < 1 + 8: there again
    assert router.board.engine_loads()[own] == 1
    assert ask()[1] == there
    # The prefix that ran here is held by both engines now: the less loaded one takes it.
    assert router.choose(np.concatenate([prefix, rng.integers(0, 32000, 20)])) == here
    router.placed(own, -1)
    assert router.board.engine_loads()[own] == 0


def test_the_slack_setting_replaces_max_num_seqs_over_2(two_instances):
    """prefix_routing_slack: a prefix only the peer holds goes there while the peer's load is
    under ours plus the slack given (here 5, where max_num_seqs / 2 would be 8)."""
    router, engine, peer_slot, peer_pid = two_instances
    own = router.board.slot
    engine.connected.append(core_address(router.board, peer_pid, peer_slot))
    router = PrefixRouter(router.board, engine, BS, max_num_seqs=16, max_model_len=4096,
                          slack=5)
    rng = np.random.default_rng(5)
    there = (peer_slot, core_address(router.board, peer_pid, peer_slot))

    def ask():
        prefix = rng.integers(0, 32000, 8 * BS)
        router.claim(prefix, peer_slot)
        return router.choose(np.concatenate([prefix, rng.integers(0, 32000, 20)]))
    router.board._placed[peer_slot, peer_slot] = 4          # 4 < 0 + 5: there
    assert ask() == there
    router.board._placed[peer_slot, peer_slot] = 5          # 5 >= 0 + 5: here
    assert ask() == (own, None)


def test_a_prefix_both_engines_hold_goes_to_the_less_loaded_ours_on_a_tie(two_instances):
    """A system prompt every engine has cached: no request moves but to even the loads (the
    last engine to take it does not draw them, as a single owner per prefix would)."""
    router, engine, peer_slot, peer_pid = two_instances
    own = router.board.slot
    engine.connected.append(core_address(router.board, peer_pid, peer_slot))
    rng = np.random.default_rng(4)
    prefix = rng.integers(0, 32000, 6 * BS)
    here, there = (own, None), (peer_slot, core_address(router.board, peer_pid, peer_slot))

    def ask(last_taker):
        router.claim(np.concatenate([prefix, rng.integers(0, 32000, 3 * BS)]), last_taker)
        return router.choose(np.concatenate([prefix, rng.integers(0, 32000, 20)]))
    router.claim(prefix, own)
    assert ask(peer_slot) == here                           # loads 0 and 0
    router.board._placed[peer_slot, peer_slot] = 3
    assert ask(peer_slot) == here
    router.placed(own, 5)                                   # 5 against 3: the peer's
    assert ask(own) == there
    router.placed(own, -2)                                  # 3 and 3: ours
    assert ask(peer_slot) == here
    # Deeper blocks that only the peer holds win over the shared prefix, within the slack.
    deeper = np.concatenate([prefix, rng.integers(0, 32000, 4 * BS)])
    router.claim(deeper, peer_slot)
    assert router.choose(np.concatenate([deeper, [5] * 7])) == there
    router.placed(own, -3)
    router.board._placed[peer_slot, peer_slot] = 0


# ---------------------------------------------------------------------------- real cores
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=3))


def _engine(model_dir, max_model_len=512, **kw):
    return AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=128,
                       cpu_threads=1, max_model_len=max_model_len, **kw)


@contextlib.contextmanager
def _owner_and_ours(model_dir, address, owner_max_model_len=512):
    """An engine whose core takes peers at `address`, and ours; both stopped however it ends."""
    owner = _engine(model_dir, owner_max_model_len, peer_address=address)
    try:
        ours = _engine(model_dir)
        try:
            yield owner, ours
        finally:
            ours.shutdown()
    finally:
        owner.shutdown()


def test_requests_routed_to_a_peer_core_answer_as_on_our_own(model_dir):
    address = f"tritonllm-test-peer-{os.getpid()}"
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    ids = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}

    async def run(owner, ours):
        loop = asyncio.get_running_loop()
        done = {}
        events = {}

        async def submit(key, params, route=None):
            events[key] = asyncio.Event()

            def sink(out):
                done.setdefault(key, []).append(out)
                if isinstance(out, BaseException) or out.finished:
                    loop.call_soon_threadsafe(events[key].set)
            await ours.submit(ids, params, key, sink, route=route)

        def there(prompt_ids):
            return address
        await submit("local", greedy)
        await submit("peer", greedy, there)
        await submit("abort", long, there)
        for key in ("local", "peer"):
            await asyncio.wait_for(events[key].wait(), 60)
        ours.abort_nowait("abort")
        await asyncio.wait_for(events["abort"].wait(), 60)
        assert owner.get_stats().num_generated_tokens >= 11    # they ran on the owner's core
        assert ours.get_stats().num_generated_tokens == 10     # only "local" ran on ours
        await submit("doomed", long, there)
        await asyncio.to_thread(owner.shutdown)
        await asyncio.wait_for(events["doomed"].wait(), 60)
        # Ours carries on, and a route to the peer that is gone runs here.
        await submit("after", greedy, there)
        await asyncio.wait_for(events["after"].wait(), 60)
        return done

    with _owner_and_ours(model_dir, address) as (owner, ours):
        with pytest.raises(OSError):
            ours.connect_peer(address + "-nobody", timeout_s=2)
        ours.connect_peer(address)
        assert ours.peers() == [address]
        peer = ours._peers[address]
        done = asyncio.run(run(owner, ours))
        # The connection to the peer that is gone is closed: its threads end, its socket too
        # (it was dropped from ours' peers and left open, past ours.shutdown()).
        wait_for(lambda: not (peer._sender.is_alive() or peer._receiver.is_alive()
                              or peer._sock.fileno() != -1),
                 "the dead peer's connection to be closed", timeout_s=30)
        tokens = {k: [t for o in v if not isinstance(o, BaseException)
                      for t in o.outputs[0].token_ids] for k, v in done.items()}
        assert tokens["peer"] == tokens["local"] and len(tokens["local"]) == 10
        assert tokens["after"] == tokens["local"]
        assert done["abort"][-1].outputs[0].finish_reason == "abort"
        error = done["doomed"][-1]
        assert isinstance(error, EngineDeadError) and "another instance" in str(error), error
        assert ours.peers() == [] and ours.is_alive
        stats = ours.get_stats()
        assert (stats.num_running, stats.num_free_kv_blocks) == (0, stats.num_kv_blocks)


def test_a_peer_core_of_another_model_is_not_used(model_dir):
    """Instances of one model run one model; a core that says otherwise (here another context
    length) is refused, so no request goes where it could not be answered as here."""
    address = f"tritonllm-test-other-{os.getpid()}"
    with _owner_and_ours(model_dir, address, owner_max_model_len=256) as (owner, ours):
        with pytest.raises(RuntimeError, match="runs another model"):
            ours.connect_peer(address)
        assert ours.peers() == []


def test_a_peer_core_with_other_weights_of_the_same_shape_is_not_used(model_dir,
                                                                       tmp_path_factory):
    """Another checkpoint of the same shape (another version on one server, or new weights
    loaded while the old instances drain): its core is refused, as routing there would change
    the answer (it compared the context length and vocabulary only)."""
    other = str(make_tiny_model(tmp_path_factory.mktemp("o") / "llama", arch="llama", seed=4))
    address = f"tritonllm-test-weights-{os.getpid()}"
    owner = _engine(other, 512, peer_address=address)
    try:
        ours = _engine(model_dir)
        try:
            assert ours.info.max_model_len == owner.info.max_model_len
            assert ours.info.vocab_size == owner.info.vocab_size
            with pytest.raises(RuntimeError, match="runs another model"):
                ours.connect_peer(address)
            assert ours.peers() == []
        finally:
            ours.shutdown()
    finally:
        owner.shutdown()
