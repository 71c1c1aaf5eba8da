"""Requests that share a long prompt prefix run on one engine, when a model has several.

With one `llm` instance per GPU, Triton gives each request to whichever instance is free, so
the requests of a group that share a long prefix (a document, few-shot examples, a system
prompt) land on every GPU: each GPU computes the prefix and keeps it cached, and cascade
attention reads it once per GPU instead of once for the group. On two H200s, 512 streams in
groups of 16 sharing 2,000 tokens were served at 77.6% of the same engines given whole groups;
with this routing 10-12% faster than without (benchmarks/h200x2/served_shared_prefix.md).

So an instance that takes a request looks up its prompt's prefix in a table on the instance
board (engine/instance_board.py) and, where another instance's engine took the longest part of
it, runs the request on that engine: each engine core takes peers (engine/core_process.py), and
the instance keeps its connections to the others' cores (AsyncEngine.connect_peer). The
request stays this instance's in every other way: its tokenization, its responses, its
metrics, its cancellation.

- Keys: one per full KV block of the prompt, each a hash of every token up to that block's end
  (position-weighted sums, the same in every process): a shared prefix of k blocks has the
  same first k keys.
- The table: 2 ** 17 entries in shared memory, each a key and a mask of the board slots whose
  engines took it, written without locks by every instance (a torn or lost write is a wrong
  hint, never an error; an instance that takes a slot clears the slot's bits). A request
  claims its keys for the engine it runs on.
- The choice: at the deepest key (at least MIN_SHARED_BLOCKS deep: a chat template's common
  start is not worth it) that a reachable engine holds (ours, or a connected instance's), the
  least loaded of the engines that hold it, ours on a tie. So a prefix that every engine holds
  (a system prompt) moves no request except to even the loads, and a group whose members run
  on two engines goes on by load, not to whichever took it last (as a single owner per key
  did; this rule gave 1.4-5.9% more tokens a second on two H200s). Where only other engines
  hold it, the least loaded of them, unless it has max_num_seqs / 2 requests (the
  prefix_routing_slack setting) or more over ours: then here (and the prefix is claimed here,
  so both engines hold it). The GPUs' loads stay that close: on two H200s, letting an engine
  fill up to max_num_seqs while the other had room left one GPU short of work. A slack that
  splits groups costs their prefill twice: under the old new-prefix rule, max_num_seqs / 4
  served 4.6% more tokens a second than / 8; with new prefixes placed in turn (below), / 2
  kept every group whole in 5 runs of 5 (96.2% of whole groups per engine, against 94.2% at
  / 4, where 3 runs of 4 split some: benchmarks/h200x2/served_shared_prefix.md). Loads are
  what the instances placed on each engine (the board's `placed` rows), counted as requests
  are routed and answered.
- A prefix no reachable engine holds: where most prompts lately found their prefix held (the
  follow rate, FOLLOW_RATE_FOR_TURNS), it is a group's first member, which its group then
  follows, and it goes to the reachable engines in turn, ours first (a count per instance),
  whatever the loads. On two H200s (512 streams, groups of 16 sharing 2,000 tokens) this served
  6.1% more tokens a second than running it where Triton put it (95.5% of whole groups per
  engine, against 90.0%): new groups left there put the engines' loads ~90 requests apart at
  the median. Sending it to the least loaded engine lost 4.3% instead: the new groups of a
  moment all went to the engine that was lighter before their members arrived. Where few
  prompts share (plain traffic), each is its own load, which Triton's choice of instance
  already evens (instance_board's wait_turn), so it runs here: in turn, two CPU instances
  sent half of such prompts to the other's engine (one hop more) and left their loads further
  apart (load gap p50 4-8 against 1-2).
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time

import numpy as np

from engine.instance_board import PREFIX_TABLE_BITS, InstanceBoard, slot_bit

logger = logging.getLogger(__name__)

MIN_SHARED_BLOCKS = 4           # blocks a prefix must share with another engine's to go there
FOLLOW_WINDOW = 64              # prompts the follow rate averages over (a moving average)
FOLLOW_RATE_FOR_TURNS = 0.5     # from this follow rate on, new prefixes go to engines in turn
CONNECT_EVERY_S = 0.5           # how often the board is checked for cores to connect to
CONNECT_TIMEOUT_S = 5.0
_MIX = np.uint64(0x9E3779B97F4A7C15)    # spreads keys over the table (Fibonacci hashing)
_SEED = 0x7472697470            # the position weights: the same in every process


def position_weights(max_len: int) -> np.ndarray:
    """An odd random uint64 per token position, the same in every process."""
    rng = np.random.default_rng(_SEED)
    return rng.integers(0, 2 ** 63, size=max_len, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def block_keys(ids: np.ndarray, block_size: int, weights: np.ndarray) -> np.ndarray:
    """The key of each full block of `ids`: a hash of every token up to the block's end (never
    0, the table's empty key). Wrapping uint64 arithmetic."""
    n = min(len(ids), len(weights)) // block_size * block_size
    if n == 0:
        return np.zeros(0, np.uint64)
    tokens = np.asarray(ids[:n], dtype=np.int64).astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        sums = (tokens * weights[:n]).reshape(-1, block_size).sum(axis=1, dtype=np.uint64)
        return np.cumsum(sums, dtype=np.uint64) | np.uint64(1)


class PrefixRouter:
    def __init__(self, board: InstanceBoard, engine, block_size: int, max_num_seqs: int,
                 max_model_len: int, slack: int | None = None) -> None:
        """`engine`: the instance's AsyncEngine, whose core takes peers at
        `core_address(board, os.getpid(), board.slot)`. `slack`: the requests more than ours
        another engine may have and still take a prefix only it holds (None: max_num_seqs / 2,
        at least 1). Call `start()` to connect to the others."""
        self.board = board
        self.engine = engine
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.slack = max(1, max_num_seqs // 2) if slack is None else slack
        self._weights = position_weights(max_model_len)
        self._shift = np.uint64(64 - PREFIX_TABLE_BITS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: dict[str, float] = {}     # address -> when connecting last failed
        self._new_prefixes = 0                  # new prefixes placed in turn
        self.follow_rate = 0.0                  # of the prompts routed lately, those that
                                                # found their prefix on a reachable engine

    # ------------------------------------------------------------------ the loop's
    def choose(self, ids: np.ndarray) -> tuple[int, str | None]:
        """The board slot of the engine to run a prompt on (this instance's own, or a peer's
        that holds its prefix) and where to send it there (None: our own engine); claims the
        prompt's prefix for that engine."""
        own = self.board.slot
        connected = self.engine.peers()
        if len(ids) < MIN_SHARED_BLOCKS * self.block_size or not connected:
            return own, None                # nothing to share, or nobody to share it with
        keys, index = self._keys(ids)
        pids = self.board.slot_pids()
        target = None
        same = self.board.prefix_keys[index] == keys
        hits = np.flatnonzero(same)
        hits = hits[hits + 1 >= MIN_SHARED_BLOCKS]
        # Which engines are reachable matters to a prompt with hits, or to one that may take a
        # turn (a miss only lowers the follow rate): not to plain traffic.
        reachable = (self._reachable(pids, connected)
                     if len(hits) or self.follow_rate >= FOLLOW_RATE_FOR_TURNS else 0)
        if len(hits):
            holders = self.board.prefix_holders[index[hits]] & reachable
            held = np.flatnonzero(holders)
            if len(held):                   # the deepest block a reachable engine holds
                target = self._least_loaded(int(holders[held[-1]]), own)
        self.follow_rate += ((target is not None) - self.follow_rate) / FOLLOW_WINDOW
        if target is None:                  # a prefix new to every engine
            target = own
            if self.follow_rate >= FOLLOW_RATE_FOR_TURNS:   # it will have followers
                slots = _set_bits(int(reachable))
                target = slots[(slots.index(own) + self._new_prefixes) % len(slots)]
                self._new_prefixes += 1
        self._claim(keys, index, target, same)
        if target == own:
            return own, None
        return target, core_address(self.board, int(pids[target]), target)

    def _least_loaded(self, holders: int, own: int) -> int:
        """Of the engines whose slots are set in `holders`, the least loaded (ours on a tie);
        ours if it holds none of them and theirs is loaded by the slack over ours."""
        loads = self.board.engine_loads()
        slots = _set_bits(holders)
        best = min(slots, key=lambda slot: (loads[slot], slot != own))
        if own not in slots and loads[best] >= loads[own] + self.slack:
            return own
        return best

    def claim(self, ids: np.ndarray, slot: int) -> None:
        """Claims a prompt's prefix for the engine of `slot`, as choose does for the engine
        it picks (and as another instance's router does for its own)."""
        self._claim(*self._keys(ids), slot)

    def _keys(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's block keys and their entries in the table."""
        keys = block_keys(ids, self.block_size, self._weights)
        return keys, ((keys * _MIX) >> self._shift).astype(np.int64)

    def _claim(self, keys: np.ndarray, index: np.ndarray, slot: int,
               same: np.ndarray | None = None) -> None:
        """Sets the slot's bit on the keys' entries (an entry of another key is taken over).
        `same`: which entries hold the keys now, if the caller has just read them."""
        if same is None:
            same = self.board.prefix_keys[index] == keys
        held = np.where(same, self.board.prefix_holders[index], np.uint64(0))
        self.board.prefix_keys[index] = keys
        self.board.prefix_holders[index] = held | slot_bit(slot)

    def placed(self, slot: int, delta: int) -> None:
        self.board.add_placed(slot, delta)

    def _reachable(self, pids: np.ndarray, connected: list[str]) -> np.uint64:
        """The bits of this instance's slot and of the peers whose cores are connected."""
        connected = set(connected)
        bits = slot_bit(self.board.slot)
        for slot, pid in enumerate(pids.tolist()):
            if pid and core_address(self.board, pid, slot) in connected:
                bits |= slot_bit(slot)
        return bits

    # ------------------------------------------------------------------ connections
    def start(self) -> None:
        self._thread = threading.Thread(target=self._connect_loop, name="prefix-router",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CONNECT_TIMEOUT_S + 1)

    def _connect_loop(self) -> None:
        """Connects to the cores of the instances on the board (they come up at their own
        pace; one that is gone is dropped by the engine and tried again here)."""
        while not self._stop.is_set():
            try:
                self.connect_new_peers()
            except Exception:  # noqa: BLE001 - routing is a hint: it must not stop
                logger.exception("prefix routing: connecting to the other instances")
            self._stop.wait(CONNECT_EVERY_S)

    def connect_new_peers(self) -> None:
        self.board.free_dead_slots()    # what a killed instance placed stops counting
        connected = set(self.engine.peers())
        now = time.monotonic()
        on_board = {core_address(self.board, pid, slot): (slot, pid)
                    for slot, pid in enumerate(self.board.slot_pids().tolist()) if pid}
        for address in [a for a in self._failed if a not in on_board]:
            del self._failed[address]       # an instance gone: reloads must not pile them up
        for address, (slot, pid) in on_board.items():
            if slot == self.board.slot or address in connected or self._stop.is_set():
                continue
            if now - self._failed.get(address, -1e9) < 2 * CONNECT_EVERY_S:
                continue
            try:
                self.engine.connect_peer(address, CONNECT_TIMEOUT_S)
                self._failed.pop(address, None)
                logger.info("prefix routing: connected to the engine of instance pid %d", pid)
            except (OSError, RuntimeError) as e:    # not up yet, or gone
                self._failed[address] = now
                logger.debug("prefix routing: no engine at %s yet: %s", address, e)


def _set_bits(mask: int) -> list[int]:
    """The slots whose bits are set in `mask`."""
    slots = []
    while mask:
        low = mask & -mask
        slots.append(low.bit_length() - 1)
        mask ^= low
    return slots


# An abstract socket's name: 107 bytes after the leading NUL (sun_path holds 108).
MAX_ADDRESS_BYTES = 107


def core_address(board: InstanceBoard, pid: int, slot: int) -> str:
    """The abstract socket name where the core of the instance (pid, board slot) takes peers;
    a name too long for a socket (a long model name) goes by its hash."""
    address = f"{board.name}-core-{pid}-{slot}"
    if len(address.encode()) > MAX_ADDRESS_BYTES:
        address = f"tritonllm-core-{hashlib.sha256(address.encode()).hexdigest()}"
    return address

