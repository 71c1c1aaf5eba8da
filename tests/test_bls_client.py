"""BlsClient's bookkeeping against an in-process stand-in for `llm`'s side of the protocol
(result streams, submissions, aborts). The real thing, through tritonserver, is in
tests/test_serving.py."""
import itertools
import queue
import threading

import numpy as np
import pytest

from engine import bls_client
from engine.bls_client import NO_RESULT_STREAM, BlsClient, Result, SubmitError

WAIT_S = 10.0
_END = object()


class FakeLLM:
    """`instances` llm instances; opens and submissions each land on the next instance in
    turn (Triton spreads requests over instances). Each holds result streams per owner; `finish` delivers a result
    on the stream the request was accepted on."""

    def __init__(self, instances=1):
        self.instances = [dict() for _ in range(instances)]   # owner -> [stream queues]
        self._open_turn = itertools.cycle(range(instances))
        self._submit_turn = itertools.cycle(range(instances))
        self._ids = itertools.count()
        self.accepted: dict[str, tuple[str, queue.Queue]] = {}
        self.inputs: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()
        self.reject: str | None = None
        self.streams_by_id: dict[str, queue.Queue] = {}

    def open(self, owner):
        with self.lock:
            inst = self.instances[next(self._open_turn)]
            q, sid = queue.Queue(), f"s{next(self._ids)}"
            inst.setdefault(owner, []).append((sid, q))
            self.streams_by_id[sid] = q

        def results():
            yield sid
            while (item := q.get()) is not _END:
                yield item
        return results()

    def submit(self, owner, request_id, inputs):
        with self.lock:
            if self.reject:
                raise SubmitError(self.reject)
            inst = self.instances[next(self._submit_turn)]
            if not inst.get(owner):
                raise SubmitError(f"{NO_RESULT_STREAM} for {owner} on this instance")
            sid, q = inst[owner][0]
            self.accepted[request_id] = (sid, q)
            self.inputs[request_id] = inputs
            return sid

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.finish(request_id, error=None, text="aborted")

    def finish(self, request_id, text="done", error=None):
        sid, q = self.accepted[request_id]
        q.put(Result(request_id, {"text_output": np.array([text.encode()], dtype=object)},
                     error))

    def end_stream(self, sid):
        with self.lock:
            for inst in self.instances:
                for owner, streams in inst.items():
                    inst[owner] = [(i, q) for i, q in streams if i != sid]
        self.streams_by_id[sid].put(_END)

    def end_all(self):
        for sid in list(self.streams_by_id):
            self.end_stream(sid)


class FakeClient:
    def __init__(self, name):
        self.name = name
        self.answer = None
        self.answered = threading.Event()
        self.cancelled = False
        self.checks = 0

    def is_cancelled(self):
        self.checks += 1
        return self.cancelled

    def respond(self, outputs, error, cancelled):
        assert self.answer is None, "answered twice"
        self.answer = (outputs, error, cancelled)
        self.answered.set()


def _wait_accepted(llm, n):
    for _ in range(int(WAIT_S / 0.01)):
        if len(llm.accepted) >= n:
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"only {len(llm.accepted)} of {n} accepted")


def _inputs(i):
    return {"text_input": np.array([f"p{i}".encode()], dtype=object)}


def test_results_reach_their_clients_over_one_result_stream():
    llm = FakeLLM()
    client = BlsClient(llm)
    clients = [FakeClient(i) for i in range(50)]
    try:
        for i, c in enumerate(clients):
            client.submit(c, _inputs(i))
        _wait_accepted(llm, 50)
        for rid in reversed(list(llm.accepted)):            # any order
            llm.finish(rid, text=f"for {llm.inputs[rid]['text_input'][0].decode()}")
        for i, c in enumerate(clients):
            assert c.answered.wait(WAIT_S)
            outputs, error, cancelled = c.answer
            assert error is None and not cancelled
            assert outputs["text_output"][0] == f"for p{i}".encode()
        assert client.num_result_streams == 1 and client.num_pending == 0
    finally:
        llm.end_all()
        client.close()


def test_an_instance_without_a_result_stream_makes_the_client_open_another():
    llm = FakeLLM(instances=2)
    client = BlsClient(llm)
    try:
        cs = [FakeClient(i) for i in range(6)]
        for i, c in enumerate(cs):
            client.submit(c, _inputs(i))
        _wait_accepted(llm, 6)
        assert all(llm.instances[k] for k in range(2)), "both instances got a result stream"
        for rid in list(llm.accepted):
            llm.finish(rid)
        assert all(c.answered.wait(WAIT_S) and c.answer[1] is None for c in cs)
    finally:
        llm.end_all()
        client.close()


def test_a_rejected_submission_answers_with_the_error():
    llm = FakeLLM()
    llm.reject = "text_input must be a string"
    client = BlsClient(llm)
    try:
        c = FakeClient(0)
        client.submit(c, _inputs(0))
        assert c.answered.wait(WAIT_S)
        assert c.answer == (None, "text_input must be a string", False)
    finally:
        llm.end_all()
        client.close()


def test_a_result_stream_that_ends_fails_the_requests_accepted_on_it():
    llm = FakeLLM()
    client = BlsClient(llm)
    try:
        cs = [FakeClient(i) for i in range(3)]
        for i, c in enumerate(cs):
            client.submit(c, _inputs(i))
        _wait_accepted(llm, 3)
        (sid,) = {s for s, _ in llm.accepted.values()}
        llm.end_stream(sid)
        for c in cs:
            assert c.answered.wait(WAIT_S)
            assert c.answer[0] is None and sid in c.answer[1]
        # ...and the next request opens a new stream and works.
        c = FakeClient("after")
        client.submit(c, _inputs(9))
        _wait_accepted(llm, 4)
        llm.finish(list(llm.accepted)[-1])
        assert c.answered.wait(WAIT_S) and c.answer[1] is None
    finally:
        llm.end_all()
        client.close()


def test_a_cancelled_request_is_aborted_and_answered_as_cancelled(monkeypatch):
    monkeypatch.setattr(bls_client, "CANCEL_POLL_S", 0.01)
    llm = FakeLLM()
    client = BlsClient(llm)
    try:
        keep, drop = FakeClient("keep"), FakeClient("drop")
        client.submit(keep, _inputs(0))
        client.submit(drop, _inputs(1))
        _wait_accepted(llm, 2)
        drop.cancelled = True
        assert drop.answered.wait(WAIT_S)
        assert drop.answer[2] is True                       # answered as cancelled
        assert len(llm.aborted) == 1 and llm.inputs[llm.aborted[0]]["text_input"][0] == b"p1"
        assert not keep.answered.is_set()
        llm.finish([r for r in llm.accepted if r not in llm.aborted][0])
        assert keep.answered.wait(WAIT_S) and keep.answer[2] is False
        assert keep.checks > 0
    finally:
        llm.end_all()
        client.close()


def test_cancellation_checks_per_round_are_bounded(monkeypatch):
    monkeypatch.setattr(bls_client, "CANCEL_CHECKS_PER_POLL", 5)
    monkeypatch.setattr(bls_client, "CANCEL_POLL_S", 0.01)
    llm = FakeLLM()
    client = BlsClient(llm)
    try:
        cs = [FakeClient(i) for i in range(20)]
        for i, c in enumerate(cs):
            client.submit(c, _inputs(i))
        _wait_accepted(llm, 20)
        # Round robin: within a few rounds every request has been looked at.
        for _ in range(int(WAIT_S / 0.01)):
            if all(c.checks for c in cs):
                break
            threading.Event().wait(0.01)
        assert all(c.checks for c in cs)
        assert max(c.checks for c in cs) - min(c.checks for c in cs) <= 2
    finally:
        llm.end_all()
        client.close()


def test_close_answers_what_is_still_pending():
    llm = FakeLLM()
    client = BlsClient(llm)
    c = FakeClient(0)
    client.submit(c, _inputs(0))
    _wait_accepted(llm, 1)
    (sid,) = {s for s, _ in llm.accepted.values()}
    llm.end_stream(sid)                                   # lets the reader thread end
    client.close()
    assert c.answered.is_set() and c.answer[0] is None


@pytest.mark.parametrize("n", [1, 200])
def test_every_request_is_answered_exactly_once(n):
    llm = FakeLLM(instances=3)
    client = BlsClient(llm)
    try:
        cs = [FakeClient(i) for i in range(n)]
        for i, c in enumerate(cs):
            client.submit(c, _inputs(i))
        _wait_accepted(llm, n)
        for rid in list(llm.accepted):
            llm.finish(rid)
        assert all(c.answered.wait(WAIT_S) for c in cs)
    finally:
        llm.end_all()
        client.close()
