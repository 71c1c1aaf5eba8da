"""engine/serving.py's ServingEngine without a server: what reaches `send`. Through a real
tritonserver: tests/test_serving.py."""
import dataclasses
import json
import os
import threading
import time

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.instance_board import InstanceBoard
from engine.serving import ServingEngine
from scripts.make_tiny_model import make_tiny_model
from tests.waiting import wait_for

SETTINGS = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "num_kv_blocks": 128,
            "max_model_len": 256, "cpu_threads": 1}
WAIT_S = 60.0
# A request a test interrupts (cancels, aborts, stops, fails to send to) runs on LONG_SETTINGS
# for LONG tokens, ~5 s here: it cannot end by itself before the interruption reaches it (the
# housekeeper asks for cancellations every 0.1 s; 200 tokens took 1-1.4 s here under load).
LONG_SETTINGS = SETTINGS | {"max_model_len": 1024, "num_kv_blocks": 512}
LONG = 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=5))


def _str(v):
    return np.array([v.encode()], dtype=np.object_)


def _inputs(prompt, max_tokens):
    return {"text_input": _str(prompt), "stream": np.array([True]),
            "return_output_ids": np.array([True]), "return_num_output_tokens": np.array([True]),
            "sampling_parameters": _str(json.dumps({"max_tokens": max_tokens, "temperature": 0,
                                                     "ignore_eos": True}))}


class Recorder:
    """A `send` that records responses; with `hold`, its first call waits until released."""

    def __init__(self, hold=False):
        self.responses = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.final = threading.Event()
        self.hold = hold

    def __call__(self, tensors, error, final):
        self.first = tensors                  # what the held (first) call carries
        self.entered.set()
        if self.hold:
            self.hold = False
            assert self.release.wait(WAIT_S)
        self.responses.append((tensors, error, final))
        if final:
            self.final.set()


def _wait_generated(serving, at_least):
    wait_for(lambda: serving.stats().num_generated_tokens >= at_least,
             f"the engine to generate {at_least} tokens", timeout_s=WAIT_S)


def test_a_stream_whose_sender_was_busy_gets_its_steps_in_one_response(model_dir):
    """One sender, held inside the stream's first response: the steps made meanwhile leave as
    one response carrying all their tokens; the concatenation is the direct engine's output."""
    max_tokens = 40
    direct = LLM(model_dir, dtype="float32", device="cpu", **SETTINGS).generate(
        "Coalesce me", SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS), num_senders=1)
    try:
        rec = Recorder(hold=True)
        serving.submit(_inputs("Coalesce me", max_tokens), rec)
        assert rec.entered.wait(WAIT_S)             # the only sender is held in response 1
        # It carries what was there when the sender took it (1 token, or more if the engine
        # was quicker than the sender's wake-up); meanwhile the engine goes on by 10 more.
        held = len(rec.first["output_ids"])
        _wait_generated(serving, held + 10)
        rec.release.set()
        assert rec.final.wait(WAIT_S)
    finally:
        serving.shutdown()
    tensors = [t for t, e, f in rec.responses]
    assert all(e is None for _, e, _ in rec.responses)
    ids_per_response = [len(t["output_ids"]) for t in tensors]
    assert ids_per_response[0] == held and ids_per_response[1] >= 10, ids_per_response
    assert sum(ids_per_response) == max_tokens
    assert [i for t in tensors for i in t["output_ids"].tolist()] == direct.outputs[0].token_ids
    assert "".join(t["text_output"][0].decode() for t in tensors) == direct.outputs[0].text
    # num_output_tokens counts each response's own tokens (Triton's vLLM backend).
    assert [int(t["num_output_tokens"][0]) for t in tensors] == ids_per_response
    assert [f for _, _, f in rec.responses] == [False] * (len(tensors) - 1) + [True]


def test_stop_serving_ends_every_request_with_the_reason_and_refuses_new_ones(model_dir):
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    try:
        recs = [Recorder() for _ in range(3)]
        for i, rec in enumerate(recs):
            serving.submit(_inputs(f"long {i}", LONG), rec)
        for rec in recs:
            assert rec.entered.wait(WAIT_S)
        serving.stop_serving("the server is shutting down")
        for rec in recs:
            assert rec.final.wait(WAIT_S)
            assert rec.responses[-1] == (None, "the server is shutting down", True)
        late = Recorder()
        serving.submit(_inputs("late", 4), late)
        assert late.responses == [(None, "the server is shutting down", True)]
        _wait_idle(serving)
    finally:
        serving.shutdown()


def test_a_stop_while_a_request_is_being_admitted_ends_it_too(model_dir):
    """The stop (the signal watch's thread) lands after the loop looked at it for this request
    and before the request was registered in flight (here: as its inputs are read, on the
    loop). stop_serving, ending what is in flight, missed it, and it ran to max_tokens."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    try:
        def inputs():
            serving.stop_serving("the server is shutting down")
            return _inputs("long", LONG)
        rec = Recorder()
        serving.submit(inputs, rec)
        assert rec.final.wait(WAIT_S)
        assert rec.responses == [(None, "the server is shutting down", True)]
        wait_for(lambda: serving.num_open == 0, "the request closed", timeout_s=WAIT_S)
        _wait_idle(serving)
    finally:
        serving.shutdown()


def _wait_idle(serving):
    def idle():
        s = serving.stats()
        return s.num_running == s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks
    wait_for(idle, "the engine to be idle with its pool whole", timeout_s=WAIT_S,
             state=serving.stats)


def test_shutdown_answers_what_is_in_flight_and_leaves_no_thread(model_dir):
    before = {t.ident for t in threading.enumerate()}
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    rec = Recorder()
    serving.submit(_inputs("in flight", LONG), rec)
    assert rec.entered.wait(WAIT_S)
    serving.shutdown()
    assert rec.final.is_set() and rec.responses[-1][1] == "the engine was shut down"
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == [], left


def test_abort_request_id_aborts_only_llm_bls_requests_even_before_they_arrive(model_dir):
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    try:
        refused = Recorder()
        serving.submit({"abort_request_id": _str("someone-elses-id")}, refused)
        assert refused.final.wait(WAIT_S)
        assert "abort_request_id" in refused.responses[0][1] and "bls-" in refused.responses[0][1]

        # llm_bls cancels in the moment before its inner request has arrived.
        early, ack = Recorder(), Recorder()
        serving.submit({"abort_request_id": _str("bls-early")}, ack)
        assert ack.final.wait(WAIT_S) and ack.responses == [({}, None, True)]
        steps = serving.stats().num_steps
        serving.submit(_inputs("too late", 200), early, request_id="bls-early")
        assert early.final.wait(WAIT_S)
        assert early.responses == [(None, "request cancelled", True)]
        assert serving.stats().num_steps == steps            # it never reached the engine

        # ...and one under way is aborted: its last response says so.
        running, ack2 = Recorder(), Recorder()
        serving.submit(_inputs("running", LONG) | {"return_finish_reason": np.array([True])},
                       running, request_id="bls-running")
        assert running.entered.wait(WAIT_S)
        serving.submit({"abort_request_id": _str("bls-running")}, ack2)
        assert running.final.wait(WAIT_S)
        assert running.responses[-1][0]["finish_reason"][0] == b"abort"
        _wait_idle(serving)
    finally:
        serving.shutdown()


def _concat(rec):
    """The text and ids of a recorded stream, whatever its responses' grouping."""
    assert all(error is None for _, error, _ in rec.responses), rec.responses
    return (b"".join(t["text_output"][0] for t, _, _ in rec.responses),
            [int(i) for t, _, _ in rec.responses for i in t["output_ids"]])


def _block_loop(serving):
    """Holds the serving loop inside a callback until the returned event is set."""
    entered, release = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(WAIT_S)
    serving.loop.call_soon_threadsafe(hold)
    assert entered.wait(WAIT_S)
    return release


def test_inputs_given_as_a_function_are_read_once_on_the_loop(model_dir):
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        readers = []

        def inputs():
            readers.append(threading.current_thread().name)
            return _inputs("Read me later", 6)
        lazy, eager = Recorder(), Recorder()
        serving.submit(inputs, lazy)
        serving.submit(_inputs("Read me later", 6), eager)
        assert lazy.final.wait(WAIT_S) and eager.final.wait(WAIT_S)
        assert readers == ["serving-loop"]
        assert _concat(lazy) == _concat(eager)      # responses may group tokens differently

        def broken():
            raise RuntimeError("tensor gone")
        failed = Recorder()
        serving.submit(broken, failed)
        assert failed.final.wait(WAIT_S)
        assert failed.responses == [(None, "internal error reading the inputs: tensor gone",
                                     True)]
        _wait_idle(serving)
    finally:
        serving.shutdown()


def test_requests_submitted_while_the_loop_is_busy_start_together(model_dir):
    """While the loop is busy, submissions queue; the loop then starts them all in one call
    (one wake-up for the lot), and each is answered."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        admits = []
        admit = serving._admit
        serving._admit = lambda: (admits.append(len(serving._admissions)), admit())
        release = _block_loop(serving)
        recs = [Recorder() for _ in range(12)]
        for i, rec in enumerate(recs):
            serving.submit(_inputs(f"burst {i}", 3), rec)
        release.set()
        for rec in recs:
            assert rec.final.wait(WAIT_S)
            assert rec.responses[-1][1] is None and rec.responses[-1][2]
        assert admits == [12]
        _wait_idle(serving)
    finally:
        serving.shutdown()


def test_latencies_count_from_arrival_not_from_the_loops_start(model_dir):
    """A request that waits for a busy loop waits as the client sees it: its time to first
    token and its end-to-end latency count from submit() (Triton's execute)."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        release = _block_loop(serving)
        recs = [Recorder(), Recorder()]
        serving.submit(_inputs("waits for the loop", 2), recs[0])
        quiet = dict(_inputs("waits too, answered once", 2), stream=np.array([False]))
        serving.submit(quiet, recs[1])
        t0 = time.monotonic()                  # after both arrived: each waits at least held_s
        time.sleep(0.3)                        # the loop busy elsewhere (a delay, not a wait)
        held_s = time.monotonic() - t0
        release.set()
        for rec in recs:
            assert rec.final.wait(WAIT_S) and rec.responses[-1][1] is None
        _wait_idle(serving)
        m = serving.metrics
        assert m.ttft.count == 2 and m.e2e.count == 2
        assert m.ttft.sum >= 2 * held_s and m.e2e.sum >= 2 * held_s, (m.ttft.sum, m.e2e.sum)
    finally:
        serving.shutdown()


def test_the_trace_tells_the_wait_for_the_loop_from_the_rest(model_dir, tmp_path,
                                                             monkeypatch):
    """LLM_SERVING_TRACE's "serving" is when the loop took the request (scripts/ttft_trace.py's
    execute -> loop stage): a request that waited for a busy loop shows that wait there (it
    read as "submitted" once the latencies counted from arrival)."""
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("LLM_SERVING_TRACE", str(trace))
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        release = _block_loop(serving)
        rec = Recorder()
        serving.submit(_inputs("waits for the loop", 2), rec)
        t0 = time.monotonic()
        time.sleep(0.3)                        # the loop busy elsewhere (a delay, not a wait)
        held_s = time.monotonic() - t0
        release.set()
        assert rec.final.wait(WAIT_S) and rec.responses[-1][1] is None
    finally:
        serving.shutdown()
    [line] = [json.loads(x) for x in trace.read_text().splitlines()]
    assert line["serving"] - line["submitted"] >= held_s, line
    assert line["serving"] <= line["in_engine"], line


def test_shutdown_answers_requests_submitted_but_not_yet_started(model_dir):
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    release = _block_loop(serving)
    recs = [Recorder() for _ in range(3)]
    for i, rec in enumerate(recs):
        serving.submit(_inputs(f"queued {i}", 3), rec)
    stopper = threading.Thread(target=serving.shutdown)
    stopper.start()
    wait_for(lambda: serving._stop_reason is not None,
             "shutdown to begin (from then on nothing new starts)", timeout_s=WAIT_S)
    release.set()
    stopper.join(WAIT_S)
    assert not stopper.is_alive()
    for rec in recs:
        assert rec.responses == [(None, "the engine was shut down", True)]


def test_trace_file_has_each_streams_timeline_in_order(model_dir, tmp_path, monkeypatch):
    """Three streams of one completion and one of two (n 2: its timeline spans both, from
    the first's first output to the last's final response)."""
    trace, core_log = tmp_path / "trace.jsonl", tmp_path / "core.jsonl"
    monkeypatch.setenv("LLM_SERVING_TRACE", str(trace))
    monkeypatch.setenv("ENGINE_REQUEST_LOG", str(core_log))
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    core_pid = serving.engine.core.pid
    try:
        recs = [Recorder() for _ in range(4)]
        for i, rec in enumerate(recs[:3]):
            serving.submit(_inputs(f"trace me {i}", 4), rec)
        serving.submit(_n_inputs("trace us", 2, True, max_tokens=4, temperature=0,
                                 ignore_eos=True), recs[3])
        for rec in recs:
            assert rec.final.wait(WAIT_S)
    finally:
        serving.shutdown()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 4 and len({t["rid"] for t in lines}) == 4
    for t in lines:
        assert all(isinstance(t[k], float) for k in
                   ("submitted", "serving", "in_engine", "first_output", "first_sent",
                    "final_output", "final_sent")), t
        # in_engine is taken on the loop just after the request went to the core, so the
        # reader may in principle see its first output before that: not ordered against it.
        assert t["submitted"] <= t["serving"] <= t["in_engine"], t
        assert t["serving"] <= t["first_output"] <= t["first_sent"] <= t["final_sent"], t
        assert t["first_output"] < t["final_output"] <= t["final_sent"], t   # 4 steps
    # Joined with the core's request log (its lines are written by the time it exits): the
    # three requests of one completion; the n 2 request's completions have no single key.
    from scripts.ttft_trace import join_core_log
    assert join_core_log(lines, [json.loads(x) for x in core_log.read_text().splitlines()]) == 3
    for t in lines:
        assert t["front"] == os.getpid(), t
        if t["core"] is None:
            assert t["index"] is None and "core_taken" not in t, t
            continue
        assert t["core"] == core_pid, t
        assert t["serving"] <= t["core_taken"] <= t["core_first_sent"] <= t["first_output"], t
        assert t["core_first_sent"] < t["core_final_sent"] <= t["final_output"], t


def test_trace_of_a_final_response_sent_before_the_reader_noted_its_step(tmp_path):
    """A streamed request's outputs are one handle the sender renders: the last step's tokens
    can go out before the reader thread notes final_output. The line then has final_output at
    final_sent (the step was back by then), not null."""
    from types import SimpleNamespace
    from engine.serving_trace import RequestTrace
    trace = RequestTrace(str(tmp_path / "t.jsonl"))
    r = SimpleNamespace(rid="x", submitted=1.0, serving=1.1, in_engine=None, first_output=1.5,
                        first_sent=1.6, final_output=None, final_sent=None, core_key=None)
    trace.in_engine(r, 1.2)
    trace.final_sent(r, 3.0)
    trace.close()
    (line,) = (tmp_path / "t.jsonl").read_text().splitlines()
    t = json.loads(line)
    assert t["final_output"] == t["final_sent"] == 3.0 and t["in_engine"] == 1.2, t


def _wait_open(serving, n):
    """num_open drops just after a final answer's send returns."""
    wait_for(lambda: serving.num_open == n, f"{n} open requests", timeout_s=WAIT_S,
             state=lambda: f"num_open={serving.num_open}")


def test_open_requests_are_counted_on_the_board_until_their_final_answer(model_dir, tmp_path):
    board = InstanceBoard(os.getpid(), "llm", directory=str(tmp_path))
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS), board=board)
    try:
        running = Recorder()
        serving.submit(_inputs("runs a while", LONG), running, request_id="bls-long")
        assert running.entered.wait(WAIT_S)
        assert serving.num_open == board.load == 1
        endings = [Recorder() for _ in range(4)]
        serving.submit(_inputs("answered", 3), endings[0])
        serving.submit({"text_input": _str("x"), "sampling_parameters": _str("{bad json")},
                       endings[1])
        serving.submit({"abort_request_id": _str("bls-long")}, endings[2])
        serving.submit(lambda: 1 / 0, endings[3])             # its inputs cannot be read
        for rec in endings + [running]:
            assert rec.final.wait(WAIT_S)
        assert running.responses[-1][1] is None          # it ended by the abort, answered
        _wait_open(serving, 0)
        assert board.load == 0
        serving.stop_serving("going away")
        refused = Recorder()
        serving.submit(_inputs("refused", 3), refused)
        assert refused.responses == [(None, "going away", True)]
        assert serving.num_open == board.load == 0
    finally:
        serving.shutdown()
        board.close()


def test_an_abort_reaching_the_wrong_instance_is_passed_on_to_the_right_one(model_dir,
                                                                           tmp_path):
    """Two instances of a model (two engines, one board): llm_bls's abort of a request that
    instance B runs reaches instance A, as Triton may route it; B aborts it. (Each instance's
    prefix router takes the prefix_routing_slack setting, or max_num_seqs / 2.)"""
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", **LONG_SETTINGS)
    boards = [InstanceBoard(os.getpid(), "llm", directory=str(tmp_path)) for _ in range(2)]
    a = ServingEngine(config, board=boards[0])
    b = ServingEngine(dataclasses.replace(config, prefix_routing_slack=3), board=boards[1])
    try:
        assert (a._router.slack, b._router.slack) == (config.max_num_seqs // 2, 3) == (8, 3)
        running = Recorder()
        b.submit(_inputs("on b", LONG) | {"return_finish_reason": np.array([True])}, running,
                 request_id="bls-on-b")
        assert running.entered.wait(WAIT_S)
        ack = Recorder()
        a.submit({"abort_request_id": _str("bls-on-b")}, ack)
        assert ack.final.wait(WAIT_S) and ack.responses == [({}, None, True)]
        assert running.final.wait(WAIT_S)
        assert running.responses[-1][0]["finish_reason"][0] == b"abort"
        assert sum(len(t["output_ids"]) for t, _, _ in running.responses) < LONG
        # Passed on before the request arrived: refused where it lands.
        a.submit({"abort_request_id": _str("bls-not-yet")}, Recorder())
        late = Recorder()
        wait_for(lambda: b._early_aborts, "B to read the board (a housekeeping round)",
                 timeout_s=WAIT_S)
        b.submit(_inputs("too late", 200), late, request_id="bls-not-yet")
        assert late.final.wait(WAIT_S) and late.responses == [(None, "request cancelled", True)]
        _wait_idle(b)
    finally:
        a.shutdown()
        b.shutdown()
        for board in boards:
            board.close()


def _wait_failed_send_dealt_with(serving, failed: threading.Event) -> None:
    assert failed.wait(30)
    wait_for(lambda: not serving.num_open, "the failed send to be dealt with")


def test_a_request_whose_final_send_fails_is_counted_once(model_dir):
    """The final response's request is counted finished before it is sent; should that send
    fail (the client is gone), the request is not counted again as aborted."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        failed = threading.Event()

        def send(tensors, error, final):
            if final:
                failed.set()
                raise RuntimeError("the client is gone")

        serving.submit({"text_input": _str("Hello"), "stream": np.array([False]),
                        "sampling_parameters": _str(json.dumps(
                            {"max_tokens": 4, "temperature": 0, "ignore_eos": True}))}, send)
        _wait_failed_send_dealt_with(serving, failed)
        counters = serving.metrics.snapshot_counters()
        assert (counters["finished_length"], counters["finished_abort"]) == (1, 0)
        assert serving.metrics.e2e.count == 1
    finally:
        serving.shutdown()


def test_a_stream_whose_send_fails_counts_its_prompt_and_generated_tokens(model_dir):
    """A stream whose client is gone mid-way (a send fails) is counted aborted once, with its
    prompt tokens and the tokens generated for it so far, as vLLM counts them (they used to be
    left out of llm_generation_tokens_total)."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    try:
        failed = threading.Event()
        sent = []                                   # num_output_tokens of each response

        def send(tensors, error, final):
            sent.append(int(tensors["num_output_tokens"][0]))
            if len(sent) == 3:
                failed.set()
                raise RuntimeError("the client is gone")

        serving.submit({"text_input": _str("Hello there"), "stream": np.array([True]),
                        "return_num_output_tokens": np.array([True]),
                        "sampling_parameters": _str(json.dumps(
                            {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}))}, send)
        _wait_failed_send_dealt_with(serving, failed)
        counters = serving.metrics.snapshot_counters()
        assert counters["finished_abort"] == 1 and sum(counters[f"finished_{r}"] for r in
                                                       ("stop", "length")) == 0
        assert counters["prompt_tokens"] == len(serving.engine.tokenizer.encode("Hello there"))
        assert sum(sent) <= counters["generation_tokens"] < LONG
    finally:
        serving.shutdown()


def _n_inputs(prompt, n, stream, **sampling):
    return {"text_input": _str(prompt), "stream": np.array([stream]),
            "return_output_ids": np.array([True]), "return_num_output_tokens": np.array([True]),
            "return_finish_reason": np.array([True]),
            "return_cumulative_logprob": np.array([True]), "return_logprobs": np.array([True]),
            "exclude_input_in_output": np.array([True]),
            "sampling_parameters": _str(json.dumps({"n": n, **sampling}))}


def _completions(rec, n):
    """Each completion's text, ids, logprobs (per token) and last cumulative logprob and
    finish reason, from a recorded request with n entries per response."""
    assert all(error is None for _, error, _ in rec.responses), rec.responses
    assert [f for _, _, f in rec.responses] == [False] * (len(rec.responses) - 1) + [True]
    texts, ids, logprobs = [b""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for t, _, _ in rec.responses:
        counts = [int(c) for c in t["num_output_tokens"]]
        assert len(t["text_output"]) == len(counts) == len(t["finish_reason"]) == n
        assert len(t["cumulative_logprob"]) == len(t["logprobs"]) == n
        assert len(t["output_ids"]) == sum(counts)      # one after another, in index order
        flat = [int(i) for i in t["output_ids"]]
        for k in range(n):
            texts[k] += t["text_output"][k]
            ids[k] += flat[sum(counts[:k]):sum(counts[:k + 1])]
            steps = json.loads(t["logprobs"][k])       # None: none asked for
            assert steps is None or len(steps) == counts[k]
            logprobs[k] += steps or []
    last = rec.responses[-1][0]
    return ([x.decode() for x in texts], ids, logprobs,
            [float(v) for v in last["cumulative_logprob"]],
            [r.decode() for r in last["finish_reason"]])


@pytest.mark.parametrize("stream", [True, False])
def test_n_completions_are_the_seeded_requests_each_in_its_entry(model_dir, stream):
    """n 3, seeded: the k-th entry of every response belongs to the k-th completion, which is
    the request seeded seed + k run alone (vLLM's rule), text, ids, logprobs and cumulative
    logprob; the request ends once all three have, with their finish reasons; the prompt's
    KV blocks are shared and the pool ends whole."""
    n = 3
    prompt = " ".join(f"fan {i} out" for i in range(30))       # several KV blocks long
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True,
                "logprobs": 1}
    llm = LLM(model_dir, dtype="float32", device="cpu", **SETTINGS)
    # The request's num_cached_tokens is the first completion's (its siblings find the prompt
    # it computed): 0 on a fresh engine, here and served (where it was whichever completion's
    # output came last).
    assert llm.generate(prompt, SamplingParams(**sampling, n=n))[0].num_cached_tokens == 0
    alone = [llm.generate(prompt, SamplingParams(**(sampling | {"seed": 11 + k})))[0].outputs[0]
             for k in range(n)]
    assert len({tuple(c.token_ids) for c in alone}) == n       # the seeds make them differ
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        num_prompt = len(serving.engine.tokenizer.encode(prompt))
        before = serving.stats()
        rec = Recorder()
        serving.submit(_n_inputs(prompt, n, stream, **sampling)
                       | {"return_num_cached_tokens": np.array([True])}, rec)
        assert rec.final.wait(WAIT_S)
        _wait_idle(serving)
        counters = serving.metrics.snapshot_counters()
        num_itl = serving.metrics.itl.count
        computed = serving.stats().num_computed_prompt_tokens - before.num_computed_prompt_tokens
    finally:
        serving.shutdown()
    texts, ids, logprobs, cumulative, reasons = _completions(rec, n)
    assert [t["num_cached_tokens"].tolist() for t, _, _ in rec.responses] == \
        [[0]] * len(rec.responses)
    assert texts == [c.text for c in alone]
    assert ids == [c.token_ids for c in alone]
    # Logprobs to float32 rounding: a batch of three rows sums in another order than one.
    for k, c in enumerate(alone):
        assert [float(next(iter(step.values()))["logprob"]) for step in logprobs[k]] == \
            pytest.approx([next(iter(step.values())).logprob for step in c.logprobs], abs=1e-4)
    assert cumulative == pytest.approx([c.cumulative_logprob for c in alone], abs=1e-3)
    assert reasons == ["length"] * n
    if not stream:
        assert len(rec.responses) == 1
    # The prompt's whole blocks are computed once for the three (a block of its own each at
    # most: the last token is always computed).
    block = serving.engine.config.block_size
    assert num_prompt > 2 * block and computed <= num_prompt + n * block, (computed, num_prompt)
    # Its prompt counted once, every completion's tokens, and a finish per completion (as vLLM
    # counts its child requests). Not streamed, the inter-token gaps are those of one
    # completion's 12 tokens (not of the three's 36); streamed, a response's gap is spread over
    # the most tokens any completion has in it, after the first response with any (its time is
    # the time to first token; it carries more than one token when the sender was busy).
    assert counters["finished_length"] == n
    assert counters["prompt_tokens"] == num_prompt
    if stream:
        most = [max(int(c) for c in t["num_output_tokens"]) for t, _, _ in rec.responses]
        most = [m for m in most if m]
        assert num_itl == sum(most[1:]) and 12 - most[0] <= num_itl < 12 * n, (num_itl, most)
    else:
        assert num_itl == 11
    assert counters["generation_tokens"] == 12 * n


def test_n_greedy_completions_are_equal_and_output_ids_split_by_num_output_tokens(model_dir):
    """Greedy (temperature 0), n 2, a stop string: both completions are the direct engine's one
    completion; with a stop string each entry's text is found step by step (no pull)."""
    prompt = "Greedy twice"
    sampling = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    llm = LLM(model_dir, dtype="float32", device="cpu", **SETTINGS)
    direct = llm.generate(prompt, SamplingParams(**sampling))[0].outputs[0]
    # A stop string found in the direct text, so that the request ends on it.
    stop = direct.text[len(direct.text) // 2:len(direct.text) // 2 + 2]
    stopped = llm.generate(prompt, SamplingParams(**sampling, stop=[stop]))[0].outputs[0]
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        plain, with_stop = Recorder(), Recorder()
        serving.submit(_n_inputs(prompt, 2, True, **sampling), plain)
        serving.submit(_n_inputs(prompt, 2, True, **sampling, stop=[stop]), with_stop)
        assert plain.final.wait(WAIT_S) and with_stop.final.wait(WAIT_S)
        _wait_idle(serving)
    finally:
        serving.shutdown()
    texts, ids, _, _, reasons = _completions(plain, 2)
    assert texts == [direct.text] * 2 and ids == [direct.token_ids] * 2
    assert reasons == ["length"] * 2
    texts, ids, _, _, reasons = _completions(with_stop, 2)
    assert texts == [stopped.text] * 2 and ids == [stopped.token_ids] * 2
    assert reasons == [stopped.finish_reason] * 2 == ["stop"] * 2


def test_n_completions_are_all_aborted_by_a_cancel_an_abort_or_a_stop(model_dir):
    """A request with n completions ends every one of them in the engine when its client
    cancels it, when llm_bls aborts it (even while its completions are going into the engine),
    or when the server stops: the pool ends whole each time. Every prompt goes through the
    tokenizer process (no inline tokenizing), so a completion's way into the engine waits, and
    the abort can come between two completions."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         tokenize_inline_max_chars=0, **LONG_SETTINGS))
    long = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    try:
        # The client cancels.
        cancelled = threading.Event()
        rec = Recorder()
        serving.submit(_n_inputs("cancel me", 3, True, **long), rec,
                       is_cancelled=cancelled.is_set)
        assert rec.entered.wait(WAIT_S)
        cancelled.set()
        assert rec.final.wait(WAIT_S)
        assert rec.responses[-1] == (None, "request cancelled", True)
        _wait_idle(serving)
        assert serving.metrics.snapshot_counters()["finished_abort"] == 3    # per completion

        # llm_bls aborts it, once under way, and once as its completions go in (the loop is
        # held, so the abort is queued right behind the request's admission).
        for held in (False, True):
            rec, ack = Recorder(), Recorder()
            release = _block_loop(serving) if held else None
            serving.submit(_n_inputs("abort me", 4, True, **long), rec,
                           request_id=f"bls-n-{held}")
            if held:
                serving.submit({"abort_request_id": _str(f"bls-n-{held}")}, ack)
                release.set()
            else:
                assert rec.entered.wait(WAIT_S)
                serving.submit({"abort_request_id": _str(f"bls-n-{held}")}, ack)
            assert rec.final.wait(WAIT_S) and ack.final.wait(WAIT_S)
            final = rec.responses[-1]
            assert final[1] == "request cancelled" or final[0]["finish_reason"].tolist() == \
                [b"abort"] * 4, final
            _wait_idle(serving)

        # The server stops.
        rec = Recorder()
        serving.submit(_n_inputs("stop me", 3, True, **long), rec)
        assert rec.entered.wait(WAIT_S)
        serving.stop_serving("the server is shutting down")
        assert rec.final.wait(WAIT_S)
        assert rec.responses[-1] == (None, "the server is shutting down", True)
        _wait_idle(serving)
    finally:
        serving.shutdown()


@pytest.mark.parametrize("hook", ["engine_open", "processor_add"])
def test_a_cancel_seen_as_the_request_goes_into_the_engine_ends_it(model_dir, hook):
    """The housekeeper's round (on its own thread) sees the client's cancel while the loop hands
    the request to the engine: before the engine has opened it, or as the output processor
    takes it. The abort was lost there (and never asked again) and the request ran to
    max_tokens; now it ends within a step or two."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    owner, name = (serving.engine, "_open") if hook == "engine_open" else \
        (serving.engine._processor, "add_request")
    inner = getattr(owner, name)

    def housekeeper_round_meanwhile(*args, **kwargs):
        round_ = threading.Thread(target=serving._check_cancellations, args=(0,))
        round_.start()
        round_.join()
        return inner(*args, **kwargs)
    setattr(owner, name, housekeeper_round_meanwhile)
    try:
        rec = Recorder()
        serving.submit(_inputs("cancel me", LONG), rec, is_cancelled=lambda: True)
        assert rec.final.wait(WAIT_S)
        assert rec.responses[-1] == (None, "request cancelled", True)
        _wait_idle(serving)
        stats = serving.stats()
        assert stats.num_generated_tokens < LONG // 2, stats
    finally:
        serving.shutdown()


def test_n_completions_of_a_bad_request_fail_it_once_and_leave_nothing_running(model_dir):
    """A prompt too long for the model fails the request with the engine's message, once,
    whatever its n."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    try:
        rec = Recorder()
        serving.submit(_n_inputs("word " * 400, 3, True, max_tokens=4), rec)
        assert rec.final.wait(WAIT_S)
        assert len(rec.responses) == 1 and "max_model_len" in rec.responses[0][1]
        too_many = Recorder()
        serving.submit(_n_inputs("hi", 129, True, max_tokens=4), too_many)
        assert too_many.final.wait(WAIT_S)
        assert "n must be" in too_many.responses[0][1] and "128" in too_many.responses[0][1]
        _wait_idle(serving)
    finally:
        serving.shutdown()


def test_n_completions_finish_counts_and_logprob_sums_are_per_completion(model_dir):
    """Completions ending for different reasons count a finish each under its own reason; and
    a completion with no token yet in a response has the cumulative logprob 0 (not NaN, which
    says no logprobs were asked for) when logprobs were asked for."""
    prompt = "Count each"
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                "logprobs": 1}
    llm = LLM(model_dir, dtype="float32", device="cpu", **SETTINGS)
    alone = llm.generate(prompt, SamplingParams(**sampling, n=3))[0].outputs
    # A stop token that the first completion samples at its 4th token: it stops there, the
    # others run on unless they sample it too.
    stop_id = alone[0].token_ids[3]
    want = llm.generate(prompt, SamplingParams(**sampling, n=3, stop_token_ids=[stop_id]))[0]
    reasons = [c.finish_reason for c in want.outputs]
    assert "stop" in reasons and "length" in reasons, reasons
    # One sequence at a time: the completions run one after another, so the first responses
    # have completions without a token yet.
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **(SETTINGS | {"max_num_seqs": 1})))
    try:
        rec = Recorder()
        serving.submit(_n_inputs(prompt, 3, True, **sampling, stop_token_ids=[stop_id]), rec)
        assert rec.final.wait(WAIT_S)
        _wait_idle(serving)
        counters = serving.metrics.snapshot_counters()
    finally:
        serving.shutdown()
    texts, ids, _, cumulative, got_reasons = _completions(rec, 3)
    assert ids == [c.token_ids for c in want.outputs] and got_reasons == reasons
    assert (counters["finished_stop"], counters["finished_length"]) == \
        (reasons.count("stop"), reasons.count("length"))
    had_tokens, num_before_first = [False] * 3, 0
    for t, _, _ in rec.responses:
        for k, count in enumerate(t["num_output_tokens"]):
            had_tokens[k] |= bool(count)
            assert not np.isnan(t["cumulative_logprob"][k])
            if not had_tokens[k]:
                assert t["cumulative_logprob"][k] == 0.0
                num_before_first += 1
    assert num_before_first > 0


def test_n_completions_tokenize_the_prompt_once(model_dir):
    """n 8: the prompt goes through the tokenizer once (vLLM tokenizes a parent request once);
    it used to be tokenized once per completion, one after another."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         tokenize_inline_max_chars=0, **SETTINGS))
    encodes = []
    tokenizer = serving.engine._batch_tokenizer
    real_encode = tokenizer.encode

    async def counted(text, *args, **kwargs):
        encodes.append(text)
        return await real_encode(text, *args, **kwargs)
    tokenizer.encode = counted
    try:
        rec = Recorder()
        serving.submit(_n_inputs("Once for all of them", 8, True, max_tokens=3, temperature=0,
                                 ignore_eos=True), rec)
        assert rec.final.wait(WAIT_S)
        _wait_idle(serving)
    finally:
        serving.shutdown()
    assert encodes == ["Once for all of them"]
    texts, ids, _, _, _ = _completions(rec, 8)
    assert len(set(map(tuple, ids))) == 1 and all(len(i) == 3 for i in ids)


def test_errors_carry_their_kind_for_the_status_code(model_dir):
    """A refused request's error is INVALID (the client's: HTTP 400), a stop's UNAVAILABLE, a
    cancel's CANCELLED; the model turns the kind into Triton's code (it sent INTERNAL for all)."""
    from engine.serving import ServingError
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    try:
        bad, too_long, cancelled, stopped = Recorder(), Recorder(), Recorder(), Recorder()
        serving.submit(_n_inputs("hi", 1, True, max_tokens=-1), bad)
        serving.submit(_inputs("word " * 2000, 4), too_long)
        flag = threading.Event()
        serving.submit(_inputs("cancel me", LONG), cancelled, is_cancelled=flag.is_set)
        assert cancelled.entered.wait(WAIT_S)
        flag.set()
        for rec in (bad, too_long, cancelled):
            assert rec.final.wait(WAIT_S)
        serving.submit(_inputs("stop me", LONG), stopped)
        assert stopped.entered.wait(WAIT_S)
        serving.stop_serving("the server is shutting down")
        assert stopped.final.wait(WAIT_S)
    finally:
        serving.shutdown()
    kinds = [rec.responses[-1][1].kind for rec in (bad, too_long, cancelled, stopped)]
    assert kinds == [ServingError.INVALID, ServingError.INVALID, ServingError.CANCELLED,
                     ServingError.UNAVAILABLE]
    assert "max_tokens must be >= 1" in bad.responses[-1][1]


def test_a_request_of_n_completions_is_n_requests_load_on_the_board(model_dir, tmp_path):
    """The load an instance shows the others (which steers requests between GPUs) counts each
    completion: a request with n of them is n requests' work in the engine. It drops when the
    request is answered for good, however it ends: aborted, refused, or its send failing."""
    board = InstanceBoard(os.getpid(), "llm", directory=str(tmp_path))
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS), board=board)
    long = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    try:
        fan, one = Recorder(), Recorder()
        serving.submit(_n_inputs("fan out", 3, True, **long), fan, request_id="bls-fan")
        serving.submit(_inputs("one", LONG), one, request_id="bls-one")
        assert fan.entered.wait(WAIT_S) and one.entered.wait(WAIT_S)
        assert serving.num_open == 2 and board.load == 4
        serving.submit({"abort_request_id": _str("bls-fan")}, Recorder())
        assert fan.final.wait(WAIT_S)
        _wait_open(serving, 1)
        assert board.load == 1
        serving.submit({"abort_request_id": _str("bls-one")}, Recorder())
        assert one.final.wait(WAIT_S)
        _wait_open(serving, 0)
        assert board.load == 0

        refused = Recorder()                    # too long for the model: fails once
        serving.submit(_n_inputs("word " * 2000, 3, True, max_tokens=4), refused)
        assert refused.final.wait(WAIT_S) and "max_model_len" in refused.responses[-1][1]
        _wait_open(serving, 0)
        assert board.load == 0

        failed = threading.Event()

        def send(tensors, error, final):        # the client is gone at the first response
            failed.set()
            raise RuntimeError("the client is gone")
        serving.submit(_n_inputs("gone", 2, True, **long), send)
        _wait_failed_send_dealt_with(serving, failed)
        assert board.load == 0
        _wait_idle(serving)
    finally:
        serving.shutdown()
        board.close()


# ---------------------------------------------------------------------------- counted once
N2_BASE = {"temperature": 1.0, "seed": 3, "ignore_eos": True}
N2_PROMPT = "Count each"


@pytest.fixture(scope="module")
def early_stop_id(model_dir):
    """A token the first of two seeded completions samples early (it stops there) and the
    second never samples in its first 600 (it runs on)."""
    llm = LLM(model_dir, dtype="float32", device="cpu", **LONG_SETTINGS)
    outs = llm.generate(N2_PROMPT, SamplingParams(**N2_BASE, max_tokens=600, n=2))[0].outputs
    a, b = outs[0].token_ids, outs[1].token_ids
    found = [a[i] for i in range(2, 12) if a[i] not in a[:i] and a[i] not in b]
    assert found, (a[:12], "no early token of completion 0 that completion 1 never samples")
    return found[0]


def _n2_inputs(stop_id):
    sampling = {**N2_BASE, "max_tokens": LONG, "n": 2, "stop_token_ids": [stop_id]}
    return {"text_input": _str(N2_PROMPT), "stream": np.array([True]),
            "return_finish_reason": np.array([True]),
            "sampling_parameters": _str(json.dumps(sampling))}


def _reasons(tensors):
    return [r.decode() if isinstance(r, bytes) else str(r)
            for r in tensors["finish_reason"].tolist()]


@pytest.mark.parametrize("how", ["cancel", "failed send"])
def test_a_completion_that_stopped_before_its_sibling_was_cut_short_counts_as_stopped(
        model_dir, early_stop_id, how):
    """n=2: completion 0 stops (the client is told "stop"), then the client cancels, or a
    send fails, while completion 1 runs: one finish under "stop", one "abort" (both counted
    "abort" before)."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    try:
        stopped, final, told = threading.Event(), threading.Event(), []

        def send(tensors, error, is_final):
            if how == "failed send" and stopped.is_set() and not is_final:
                raise RuntimeError("the client is gone")    # the response after "stop"
            if tensors is not None and tensors.get("finish_reason") is not None:
                if _reasons(tensors)[:2] == ["stop", "None"]:
                    stopped.set()
            told.append(error)
            if is_final:
                final.set()

        serving.submit(_n2_inputs(early_stop_id), send, is_cancelled=(
            stopped.is_set if how == "cancel" else lambda: False))
        if how == "cancel":
            assert final.wait(WAIT_S) and str(told[-1]) == "request cancelled", told
        wait_for(lambda: sum(serving.metrics.snapshot_counters()[f"finished_{r}"]
                             for r in ("stop", "length", "abort")) >= 2,
                 "both completions counted", timeout_s=WAIT_S)
        _wait_idle(serving)
        counters = serving.metrics.snapshot_counters()
    finally:
        serving.shutdown()
    assert stopped.is_set()
    assert (counters["finished_stop"], counters["finished_abort"],
            counters["finished_length"]) == (1, 1, 0), counters


def test_a_stream_the_server_stops_counts_its_tokens(model_dir):
    """stop_serving ends a stream that had sent tokens: it counts once, as an aborted request
    (its prompt, its tokens, an "abort" finish), as vLLM counts one; its tokens were sent, so
    generated >= sent (they were not counted at all)."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    try:
        sent, final = [], threading.Event()

        def send(tensors, error, is_final):
            if tensors is not None:
                sent.append(len(tensors["output_ids"]))
            if is_final:
                final.set()

        serving.submit(_inputs("stop me", LONG), send)
        wait_for(lambda: sum(sent) >= 5, "some tokens to reach the client", timeout_s=WAIT_S)
        serving.stop_serving("the server is shutting down")
        assert final.wait(WAIT_S)
        _wait_idle(serving)
        counters = serving.metrics.snapshot_counters()
    finally:
        serving.shutdown()
    assert counters["response_tokens"] == sum(sent) >= 5
    assert counters["generation_tokens"] >= counters["response_tokens"], counters
    assert counters["prompt_tokens"] > 0 and counters["finished_abort"] == 1, counters


@pytest.mark.parametrize("how", ["cancelled", "server stopped"])
def test_a_request_that_ends_before_its_prefill_counts_no_prompt_tokens(model_dir, how):
    """One seat: the second request waits, and ends (its client cancels, or the server stops)
    before the engine ever ran it. vLLM's prompt-token counter counts prefilled prompts only;
    its prompt was counted."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **(LONG_SETTINGS | {"max_num_seqs": 1})))
    try:
        running, waiting, cancelled = Recorder(), Recorder(), threading.Event()
        serving.submit(_inputs("runs first", LONG), running)
        assert running.entered.wait(WAIT_S)
        serving.submit(_inputs("waits for a seat " * 10, LONG), waiting,
                       is_cancelled=cancelled.is_set)
        wait_for(lambda: serving.stats().num_waiting == 1, "the second request to wait",
                 timeout_s=WAIT_S)
        if how == "cancelled":
            cancelled.set()
            assert waiting.final.wait(WAIT_S)
            assert not running.final.is_set()           # it ended while the first still ran
            serving.stop_serving("the server is shutting down")
        else:
            serving.stop_serving("the server is shutting down")
        assert running.final.wait(WAIT_S) and waiting.final.wait(WAIT_S)
        _wait_idle(serving)
        counters = serving.metrics.snapshot_counters()
    finally:
        serving.shutdown()
    assert counters["finished_abort"] == 2, counters
    assert counters["prompt_tokens"] == len(serving.engine.tokenizer.encode("runs first"))


def test_a_stopped_engines_gauges_are_zero_so_that_instances_sum_to_the_live_ones(model_dir):
    """After its engine stopped (an unload), an instance's series stay on /metrics for the
    process's life (TritonMetrics.close keeps them): its gauges showed its whole pool free, and
    a reload with fewer instances summed the removed ones' pools into the model's totals."""
    published = []

    class Publisher:
        def publish(self, metrics, cut=None):
            published.append(metrics.stats)

        def close(self):
            pass

    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS), publisher=Publisher())
    rec = Recorder()
    serving.submit(_inputs("count me", 4), rec)
    assert rec.final.wait(WAIT_S)
    wait_for(lambda: published and published[-1] is not None
             and published[-1].num_kv_blocks == SETTINGS["num_kv_blocks"], "a publication")
    serving.shutdown()
    last = published[-1]
    assert (last.num_kv_blocks, last.num_free_kv_blocks, last.num_running,
            last.num_waiting) == (0, 0, 0, 0), last
    assert last.num_generated_tokens >= 4        # its counters as they were


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not streamed"])
def test_a_request_whose_response_cannot_be_made_ends_with_its_error_alone(model_dir,
                                                                           monkeypatch, stream):
    """A request whose tokens the tokenizer cannot decode: streamed (its text rendered on a
    sender thread) the exception was taken for a failed send, the request forgotten without
    its final response (the client's stream hung, and the server's unload with it); not
    streamed (decoded on the reader thread) it killed the engine. Now it alone ends, with an
    INTERNAL error naming the cause; the engine and the other requests carry on."""
    import engine.async_engine as ae
    from tests.test_async_engine import _refusing_decode
    bad_id = 1000
    real_load = ae.load_tokenizer
    monkeypatch.setattr(ae, "load_tokenizer",
                        lambda config: _refusing_decode(real_load(config), bad_id))
    expected = LLM(model_dir, dtype="float32", device="cpu", **SETTINGS).generate(
        ["A good prompt"], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    )[0].outputs[0].token_ids
    died = []
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS), on_dead=died.append)
    try:
        good = Recorder()
        serving.submit(_inputs("A good prompt", 60), good)
        assert good.entered.wait(WAIT_S)                      # under way
        bad = Recorder()
        inputs = _inputs("", 8)
        del inputs["text_input"]
        inputs["input_ids"] = np.array([5, bad_id, 7], dtype=np.int32)
        inputs["stream"] = np.array([stream])
        serving.submit(inputs, bad)
        assert bad.final.wait(WAIT_S) and good.final.wait(WAIT_S)
        later = Recorder()
        serving.submit(_inputs("A good prompt", 60), later)
        assert later.final.wait(WAIT_S)
        wait_for(lambda: serving.stats().num_running == 0, "the engine idle", timeout_s=WAIT_S)
        stats = serving.stats()
    finally:
        serving.shutdown()
    errors = [e for _, e, _ in bad.responses if e is not None]
    assert len(errors) == 1 and bad.responses[-1][2], bad.responses
    assert errors[0].kind == "internal" and "piece id 1000 is out of range" in errors[0]
    for rec in (good, later):
        assert [e for _, e, _ in rec.responses if e is not None] == []
        assert [int(t) for r, _, _ in rec.responses if r for t in r["output_ids"]] == expected
    assert not died and stats.num_free_kv_blocks == stats.num_kv_blocks


def test_aborts_for_ids_not_held_are_kept_in_order_and_leave_when_expired(monkeypatch):
    """Each abort for an id this instance does not hold (yet) rebuilt the whole map of those
    from the last PENDING_ABORT_S, under the lock the request paths take: a burst of them
    (any client can send abort_request_id; llm_bls's cancels that land on another instance)
    cost O(n^2). Now the expired ones leave from the front and the map is never rebuilt."""
    import engine.serving as serving_module
    clock = [1000.0]
    monkeypatch.setattr(serving_module.time, "monotonic", lambda: clock[0])
    s = object.__new__(ServingEngine)      # only the state _abort_client reads
    s._lock, s._client_ids, s._inflight, s._early_aborts, s._board = (
        threading.Lock(), {}, {}, {}, None)
    early = s._early_aborts
    for i in range(10_000):
        s._abort_client(f"bls-{i}")
        clock[0] += 0.0005                                   # 5 s in all
    assert s._early_aborts is early and len(early) == 10_000
    s._abort_client("bls-0")                                 # again: to the back
    clock[0] += serving_module.PENDING_ABORT_S - 4.0         # the first ~2,000 have expired
    s._abort_client("bls-new")
    assert s._early_aborts is early
    assert list(early)[-2:] == ["bls-0", "bls-new"]
    assert not any(f"bls-{i}" in early for i in range(1, 1990)) and "bls-2010" in early
    times = list(early.values())
    assert times == sorted(times)
    assert all(clock[0] - t < serving_module.PENDING_ABORT_S for t in times)


def test_a_serving_engine_that_fails_to_start_after_its_engine_leaves_no_process(
        model_dir, tmp_path, monkeypatch):
    """A step of start-up after the engine's (the prefix router's) that raises: the engine's
    core and tokenizer process are stopped, not left to the threads that hold them."""
    from engine import async_engine, serving as serving_module
    started = []
    real_core = async_engine.CoreClient

    def core(*args, **kwargs):
        started.append(real_core(*args, **kwargs))
        return started[-1]

    def router(*args, **kwargs):
        raise RuntimeError("this router fails")

    monkeypatch.setattr(async_engine, "CoreClient", core)
    monkeypatch.setattr(serving_module, "PrefixRouter", router)
    board = InstanceBoard(os.getpid(), "llm", directory=str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="this router fails"):
            ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                       tokenizer_process=True, **SETTINGS), board=board)
        assert started[0].process.wait(30) is not None
    finally:
        board.close()
        for client in started:
            if client.process.poll() is None:
                client.process.kill()
                client.process.wait()


def test_a_send_that_stalls_does_not_hold_up_the_other_streams_cancellation(model_dir):
    """The housekeeping thread asks each stream whether its client cancelled it, under the
    stream's lock, which a send holds: one stalled send held up every other stream's check
    (and the metrics). A stream being sent is now asked in a later round."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS), num_senders=2)
    stalled, cancelled_one, cancelled = Recorder(hold=True), Recorder(), threading.Event()
    try:
        serving.submit(_inputs("stalls", LONG), stalled)     # asked first in every round
        assert stalled.entered.wait(WAIT_S)
        serving.submit(_inputs("cancelled", LONG), cancelled_one, cancelled.is_set)
        assert cancelled_one.entered.wait(WAIT_S)            # it streams on the other sender
        cancelled.set()
        assert cancelled_one.final.wait(WAIT_S)
        tensors, error, final = cancelled_one.responses[-1]
        assert error == "request cancelled", (error, len(cancelled_one.responses))
    finally:
        stalled.release.set()
        serving.shutdown()


def test_a_cancellation_check_that_keeps_failing_is_logged_once(model_dir, caplog):
    """The housekeeper asks each stream every round: a request whose is_cancelled() raises
    each time logged a traceback each round, for as long as it ran."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **LONG_SETTINGS))
    asked = []

    def is_cancelled():
        asked.append(1)
        if len(asked) < 4:
            raise RuntimeError("the server lost this request")
        return True
    recorder = Recorder()
    try:
        serving.submit(_inputs("its check fails", LONG), recorder, is_cancelled)
        assert recorder.final.wait(WAIT_S)
        assert recorder.responses[-1][1] == "request cancelled"
    finally:
        serving.shutdown()
    logged = [r for r in caplog.records if "cancellation check" in r.getMessage()]
    assert len(asked) >= 4 and len(logged) == 1, (len(asked), [r.getMessage() for r in logged])


class _TritonLikeRequest:
    """What the model hands ServingEngine for a Triton request: its inputs (read on the loop)
    and its is_cancelled, both holding the request, which holds its tensors (in Triton, the
    shared-memory regions of its inputs)."""

    def __init__(self, inputs):
        self.inputs = inputs
        self.payload = np.zeros(1 << 20, np.uint8)

    def read(self):
        return self.inputs

    def is_cancelled(self):
        return False


def test_a_finished_request_is_freed_without_the_cyclic_collector(model_dir):
    """Found by review: a finished request's state and its stream held each other, so the
    Triton request behind them (its input tensors, 16 MiB where a prompt was refused for its
    size) lived until Python's cyclic collector ran, which a busy server seldom runs: the
    server's memory and shared memory grew by every request. With the collector off, answered
    requests of every kind (refused, served, n completions, cancelled) are freed as they end."""
    import gc
    import weakref
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    cases = [{"text_input": _str("x"), "sampling_parameters": _str("{oops")},
             _inputs("served", 4),
             {**_inputs("two", 3), "sampling_parameters": _str('{"n": 2, "max_tokens": 3}')},
             {"text_input": _str("y"), "sampling_parameters": _str('{"logit_bias": [1]}')},
             # Refused by the tokenizer (prompts longer than max_model_len), in its process and
             # inline (the error's traceback held the frame that held it: found by review),
             # and by the engine's checks.
             _inputs("word " * 400, 4),
             _inputs("".join(chr(0x4E00 + 37 * i) for i in range(120)), 4),
             {"text_input": _str("z"), "sampling_parameters": _str('{"allowed_token_ids": [5000]}')}]
    gc.collect()
    gc.disable()
    try:
        refs, recs = [], []
        for inputs in cases * 3:
            req = _TritonLikeRequest(inputs)
            rec = Recorder()
            serving.submit(req.read, rec, req.is_cancelled)
            refs.append(weakref.ref(req))
            recs.append(rec)
            del req
        for rec in recs:
            assert rec.final.wait(WAIT_S)
        assert [e is None for rec in recs for _, e, f in rec.responses if f] == [
            False, True, True, False, False, False, False] * 3
        wait_for(lambda: all(r() is None for r in refs), "every answered request to be freed",
                 state=lambda: [i for i, r in enumerate(refs) if r() is not None])
    finally:
        gc.enable()
        serving.shutdown()


def test_a_request_of_n_completions_cancelled_before_it_starts_puts_none_in_the_engine(model_dir):
    """Its n requests would all go in before the housekeeper's next round noticed the cancel
    (found by review: a storm of cancelled n=128 requests put ~15,000 into the core and stalled
    the others for seconds). Asked as its completions are about to start: none go in, and the
    client is answered as cancelled; an uncancelled one puts its n in."""
    serving = ServingEngine(EngineConfig(model=model_dir, dtype="float32", device="cpu",
                                         **SETTINGS))
    submitted = []
    submit = serving.engine.submit

    async def counting_submit(prompt, params, request_id, *args, **kwargs):
        submitted.append(request_id)
        return await submit(prompt, params, request_id, *args, **kwargs)
    serving.engine.submit = counting_submit
    inputs = {**_inputs("Cancel me", 8),
              "sampling_parameters": _str('{"n": 16, "max_tokens": 8, "ignore_eos": true}')}
    try:
        cancelled, kept = Recorder(), Recorder()
        serving.submit(inputs, cancelled, lambda: True)
        assert cancelled.final.wait(WAIT_S)
        assert submitted == []
        tensors, error, final = cancelled.responses[-1]
        assert final and error is not None and "cancelled" in str(error).lower(), error
        serving.submit(inputs, kept)
        assert kept.final.wait(WAIT_S)
        assert len(submitted) == 16 and all(e is None for _, e, _ in kept.responses)
    finally:
        serving.shutdown()
