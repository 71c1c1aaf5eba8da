import random
import threading

import pytest

from engine.outbox import Outbox

WAIT_S = 10.0


class Recorder:
    """send_items for a stream: records each response's items; item "END" makes it final;
    an optional gate holds the first send until released."""

    def __init__(self, gate: threading.Event | None = None):
        self.responses: list[list] = []
        self.gate = gate
        self.entered = threading.Event()
        self.sent = threading.Condition()

    def __call__(self, items):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
            self.gate = None
        with self.sent:
            self.responses.append(list(items))
            self.sent.notify_all()
        return items[-1] == "END"

    def wait_for(self, num_items):
        with self.sent:
            assert self.sent.wait_for(lambda: sum(map(len, self.responses)) >= num_items,
                                      WAIT_S), self.responses


def _never_fails(e):
    raise AssertionError(f"unexpected send failure {e!r}")


def test_a_free_sender_sends_each_item_at_once():
    box = Outbox(2)
    rec = Recorder()
    s = box.stream(rec, _never_fails)
    for i in range(5):
        box.put(s, i)
        rec.wait_for(i + 1)          # each goes out before the next arrives
    box.put(s, "END")
    rec.wait_for(6)
    box.close()
    assert rec.responses == [[0], [1], [2], [3], [4], ["END"]]
    assert s.done


def test_a_busy_sender_coalesces_and_serves_streams_in_turn():
    box = Outbox(1)
    order = []
    gate = threading.Event()
    a = Recorder(gate)
    b, c = Recorder(), Recorder()
    streams = {}
    for name, rec in (("a", a), ("b", b), ("c", c)):
        def send(items, rec=rec, name=name):
            order.append(name)
            return rec(items)
        streams[name] = box.stream(send, _never_fails)
    box.put(streams["a"], "a0")
    assert a.entered.wait(WAIT_S)    # the only sender is now held inside a's first send
    for i in range(1, 6):
        box.put(streams["a"], f"a{i}")
    box.put(streams["b"], "b0")
    box.put(streams["c"], "c0")
    box.put(streams["a"], "END")
    gate.set()
    a.wait_for(7)
    b.wait_for(1)
    c.wait_for(1)
    box.close()
    assert a.responses == [["a0"], ["a1", "a2", "a3", "a4", "a5", "END"]]
    assert order == ["a", "b", "c", "a"]     # a went to the back of the queue


def test_nothing_is_sent_after_the_final_response():
    box = Outbox(1)
    rec = Recorder()
    s = box.stream(rec, _never_fails)
    box.put(s, "END")
    rec.wait_for(1)
    box.put(s, "late")
    box.close()
    assert rec.responses == [["END"]] and s.done and not s.pending


def test_a_failed_send_ends_that_stream_only():
    box = Outbox(1)
    failures = []
    failed = threading.Event()

    def broken(items):
        raise RuntimeError("client gone")
    bad = box.stream(broken, lambda e: (failures.append(e), failed.set()))
    rec = Recorder()
    good = box.stream(rec, _never_fails)
    box.put(bad, 1)
    assert failed.wait(WAIT_S)
    box.put(bad, 2)
    box.put(good, "END")
    rec.wait_for(1)
    box.close()
    assert len(failures) == 1 and str(failures[0]) == "client gone"
    assert bad.done and rec.responses == [["END"]]


def test_without_coalescing_each_item_is_its_own_response():
    box = Outbox(1)
    gate = threading.Event()
    rec = Recorder(gate)
    s = box.stream(rec, _never_fails, coalesce=False)
    box.put(s, 0)
    assert rec.entered.wait(WAIT_S)
    for i in range(1, 4):
        box.put(s, i)
    gate.set()
    rec.wait_for(4)
    box.close()
    assert rec.responses == [[0], [1], [2], [3]]


@pytest.mark.parametrize("seed", range(3))
def test_every_stream_arrives_whole_and_in_order_under_many_senders(seed):
    rng = random.Random(seed)
    box = Outbox(4)
    recs = [Recorder() for _ in range(16)]
    streams = [box.stream(r, _never_fails) for r in recs]
    lengths = [rng.randint(1, 60) for _ in recs]
    feeders = []

    def feed(indices):
        for i in indices:
            for k in range(lengths[i]):
                box.put(streams[i], (i, k))
            box.put(streams[i], "END")

    for part in (range(0, 8), range(8, 16)):
        feeders.append(threading.Thread(target=feed, args=(part,)))
        feeders[-1].start()
    for t in feeders:
        t.join()
    for rec, n in zip(recs, lengths):
        rec.wait_for(n + 1)
    box.close()
    for i, rec in enumerate(recs):
        flat = [x for r in rec.responses for x in r]
        assert flat == [(i, k) for k in range(lengths[i])] + ["END"]
        assert rec.responses[-1][-1] == "END"


def test_close_sends_what_is_pending():
    box = Outbox(1)
    gate = threading.Event()
    rec = Recorder(gate)
    s = box.stream(rec, _never_fails)
    box.put(s, 0)
    assert rec.entered.wait(WAIT_S)
    box.put(s, "END")
    closer = threading.Thread(target=box.close)
    closer.start()
    gate.set()
    closer.join(WAIT_S)
    assert rec.responses == [[0], ["END"]]


def test_needs_a_sender():
    with pytest.raises(ValueError, match="num_senders"):
        Outbox(0)


def test_a_batch_holds_its_puts_until_it_ends_then_each_stream_sends_them_as_one():
    box = Outbox(2)
    recs = [Recorder() for _ in range(3)]
    streams = [box.stream(r, _never_fails) for r in recs]
    with box.batch():
        for step in range(3):
            for s in streams:
                box.put(s, step)
        with box.batch():                        # nested: part of the outer batch
            box.put(streams[0], "END")
        assert box.num_ready == 0 and all(not r.entered.is_set() for r in recs)
    for r, n in zip(recs, (4, 3, 3)):
        r.wait_for(n)
    box.close()
    assert recs[0].responses == [[0, 1, 2, "END"]] and streams[0].done
    assert recs[1].responses == recs[2].responses == [[0, 1, 2]]


def test_puts_from_another_thread_during_a_batch_go_out_at_once():
    box = Outbox(1)
    a, b = Recorder(), Recorder()
    sa, sb = box.stream(a, _never_fails), box.stream(b, _never_fails)
    with box.batch():
        box.put(sa, "held")
        t = threading.Thread(target=box.put, args=(sb, "now"))
        t.start()
        t.join(WAIT_S)
        b.wait_for(1)                            # not held by this thread's batch
        assert not a.entered.is_set()
    a.wait_for(1)
    box.close()
    assert a.responses == [["held"]] and b.responses == [["now"]]


def _held_outbox(names):
    """One sender that stream a's first send will hold until `gate` is set: the outbox, the
    streams and recorders by name, the order of sends, the gate."""
    box = Outbox(1)
    order = []
    gate = threading.Event()
    recs = {name: Recorder(gate if name == "a" else None) for name in names}
    streams = {}
    for name, rec in recs.items():
        def send(items, rec=rec, name=name):
            order.append(name)
            return rec(items)
        streams[name] = box.stream(send, _never_fails)
    return box, streams, recs, order, gate


def test_a_new_streams_first_response_goes_before_streams_under_way():
    box, streams, recs, order, gate = _held_outbox(("a", "b", "c", "n", "m"))
    for name in ("b", "c"):                  # b and c under way: each has sent a response
        box.put(streams[name], f"{name}0")
        recs[name].wait_for(1)
    box.put(streams["a"], "a0")
    assert recs["a"].entered.wait(WAIT_S)    # the only sender is held inside a's first send
    box.put(streams["b"], "b1")
    box.put(streams["c"], "c1")
    box.put(streams["n"], "n0")              # new streams arrive after b and c were ready
    box.put(streams["m"], "m0")
    box.put(streams["a"], "a1")
    gate.set()
    for name, n in (("a", 2), ("b", 2), ("c", 2), ("n", 1), ("m", 1)):
        recs[name].wait_for(n)
    box.close()
    assert order == ["b", "c", "a", "n", "m", "b", "c", "a"]


def test_a_final_response_goes_before_streams_under_way():
    box, streams, recs, order, gate = _held_outbox(("a", "b", "c", "d"))
    for name in ("b", "c", "d"):             # under way: each has sent a response
        box.put(streams[name], f"{name}0")
        recs[name].wait_for(1)
    box.put(streams["a"], "a0")
    assert recs["a"].entered.wait(WAIT_S)    # the only sender is held inside a's first send
    for name in ("b", "c", "d"):
        box.put(streams[name], f"{name}1")
    box.put(streams["d"], "END", final=True)  # d was queued behind b and c: it moves ahead
    gate.set()
    for name, n in (("a", 1), ("b", 2), ("c", 2), ("d", 3)):
        recs[name].wait_for(n)
    box.close()
    assert order == ["b", "c", "d", "a", "d", "b", "c"]
    assert recs["d"].responses[-1] == ["d1", "END"] and streams["d"].done


def test_a_final_put_while_its_stream_is_being_sent_goes_first_after_that_send():
    box, streams, recs, order, gate = _held_outbox(("a", "b", "c"))
    for name in ("b", "c"):
        box.put(streams[name], f"{name}0")
        recs[name].wait_for(1)
    box.put(streams["a"], "a0")
    assert recs["a"].entered.wait(WAIT_S)
    box.put(streams["b"], "b1")
    box.put(streams["c"], "c1")
    box.put(streams["a"], "a1")
    box.put(streams["a"], "END", final=True)
    gate.set()
    for name, n in (("a", 3), ("b", 2), ("c", 2)):
        recs[name].wait_for(n)
    box.close()
    assert order == ["b", "c", "a", "a", "b", "c"]
    assert recs["a"].responses == [["a0"], ["a1", "END"]]


def test_without_coalescing_a_final_keeps_its_place_ahead_until_it_is_sent():
    box = Outbox(1)
    order = []
    gate = threading.Event()
    recs = {name: Recorder(gate if name == "a" else None) for name in ("a", "b")}
    streams = {"a": box.stream(lambda items: (order.append("a"), recs["a"](items))[1],
                               _never_fails, coalesce=False),
               "b": box.stream(lambda items: (order.append("b"), recs["b"](items))[1],
                               _never_fails)}
    box.put(streams["b"], "b0")
    recs["b"].wait_for(1)
    box.put(streams["a"], "a0")
    assert recs["a"].entered.wait(WAIT_S)
    box.put(streams["b"], "b1")
    box.put(streams["a"], "a1")
    box.put(streams["a"], "END", final=True)
    gate.set()
    recs["a"].wait_for(3)
    recs["b"].wait_for(2)
    box.close()
    assert order == ["b", "a", "a", "a", "b"]
    assert recs["a"].responses == [["a0"], ["a1"], ["END"]]


class _LookAfterRelease:
    """A stream's lock whose sender, leaving it by an exception, lets another thread take it
    and look at the stream before the sender goes on (as a thread switch there can)."""

    def __init__(self, stream):
        self._lock = threading.Lock()
        self.stream = stream
        self.looked = threading.Event()
        self.done_seen = None

    def __enter__(self):
        self._lock.acquire()

    def __exit__(self, kind, value, traceback):
        self._lock.release()
        if kind is not None:
            looker = threading.Thread(target=self._look)
            looker.start()
            looker.join()

    def _look(self):
        with self._lock:
            self.done_seen = self.stream.done
        self.looked.set()


def test_a_send_that_raises_is_done_before_its_lock_is_released():
    """Whoever takes a stream's lock after its send raised (the housekeeping thread asking
    `is_cancelled`) must find it done: in Triton the request may be freed by then."""
    box = Outbox(1)
    failed = threading.Event()
    try:
        def send(items):
            raise RuntimeError("the client is gone")
        s = box.stream(send, lambda e: failed.set())
        s.lock = lock = _LookAfterRelease(s)
        box.put(s, "final", final=True)
        assert failed.wait(10) and lock.looked.is_set()
        assert lock.done_seen is True
    finally:
        box.close()
