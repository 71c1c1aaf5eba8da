"""engine/wire.py: every message round-trips, a real scheduler's steps survive the SCHED frame,
the model runner works from decoded frames alone, steady-state frames stay small, and no input
(truncated, flipped, random, lying about sizes) makes a decoder raise anything but FrameError.

Over 500 lines because it covers a whole binary format: round trips, a scheduler, the runner,
sizes and hostile input, each in its own section below.
"""
import dataclasses
import itertools
import random
import struct
import time
import tracemalloc
import warnings

import numpy as np
import pytest

from engine import wire
from engine.kv_cache_manager import KVCacheManager
from engine.outputs import EngineStats
from engine.request import Request
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                              NewRequestData, Scheduler, SchedulerOutput)

VOCAB = 1000
U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
# What the core uses of SamplingParams. The rest stays in the front end: stop strings are
# matched on text, detokenization options apply to text, and n (always 1) is checked there.
CORE_PARAM_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                     "seed", "stop_token_ids", "ignore_eos", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
                     "allowed_token_ids", "bad_words_token_ids")
# bad_words travel as their ids (bad_words_token_ids, which the front end fills in).
FRONT_END_PARAM_FIELDS = {"stop", "include_stop_str_in_output", "skip_special_tokens", "n",
                          "bad_words"}


# ---------------------------------------------------------------------------- helpers
def core_params(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in CORE_PARAM_FIELDS}


def payload(data: bytes, kind: int) -> memoryview:
    got_kind, body = wire.split_frame(data)
    assert got_kind == kind, f"a {wire.KIND_NAMES[got_kind]} frame, not {wire.KIND_NAMES[kind]}"
    return body


def f32(values) -> list[float]:
    return np.asarray(values, dtype=np.float32).tolist()


def decodes_or_frame_error(decode, data) -> bool:
    """True if `decode(data)` returned, False if it raised FrameError. Anything else (another
    exception, or a numpy warning, which would hide an overflow) fails the test."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            decode(memoryview(bytes(data)))
        return True
    except wire.FrameError:
        return False
    except Exception as e:  # noqa: BLE001 - the point: nothing else may escape a decoder
        pytest.fail(f"{type(e).__name__}: {e}\n  on input {bytes(data).hex()}")


def params_for(i: int) -> SamplingParams:
    """Another value in every core field for each i (0 <= i < 20)."""
    return SamplingParams(
        max_tokens=8 + i % 5, min_tokens=i % 3, temperature=0.5 * (i % 3),
        top_p=1.0 - 0.1 * (i % 4), top_k=i % 7, min_p=0.01 * i,
        seed=None if i % 2 else -1000003 * i, stop_token_ids=[i, 2 * i + 1],
        ignore_eos=bool(i % 2), repetition_penalty=1.0 + 0.05 * i, presence_penalty=-0.1 * i,
        frequency_penalty=0.1 * (i % 5), logprobs=None if i % 3 == 0 else i % (MAX_LOGPROBS + 1))


def next_token(tokens) -> int:
    return hash(tuple(tokens)) % VOCAB


def make_scheduler(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                   max_model_len=128) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len)


def run_steps(sched: Scheduler, on_step=None):
    """Yields each step's SchedulerOutput, then plays the model: a token for every request
    whose scheduled tokens reach its last known token. `on_step(step)` may add or abort."""
    for step in itertools.count():
        if not sched.has_unfinished_requests():
            return
        assert step < 1000, "the scheduler does not finish"
        out = sched.schedule()
        yield out
        done = [rid for rid in out.num_scheduled_tokens if rid in sched.requests
                and sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        toks = [next_token(sched.requests[rid].all_token_ids) for rid in done]
        sched.update_from_output(out, ModelRunnerOutput(done, toks))
        if on_step is not None:
            on_step(step)


def busy_scheduler(seed=0):
    """(scheduler, its steps) with a small pool and budget: prompts go in chunks, blocks are
    added while decoding, requests are preempted, some prompts share a prefix, two requests
    are aborted mid-way and two arrive late. Integer request ids, as in the core process."""
    sched = make_scheduler()
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(8)]

    def add(i):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        sched.add_request(Request(i, (shared if i % 3 == 0 else []) + prompt, params_for(i),
                                  eos_token_ids=[]))

    def on_step(step):
        if step == 2:
            victims = sched.running[:1] + list(sched.waiting)[-1:]
            sched.abort_requests([r.request_id for r in victims])
        if step == 4:
            add(8)
            add(9)

    for i in range(8):
        add(i)
    return sched, run_steps(sched, on_step)


def assert_sched_equal(got: SchedulerOutput, want: SchedulerOutput) -> None:
    assert list(got.num_scheduled_tokens.items()) == list(want.num_scheduled_tokens.items())
    assert got.total_num_scheduled_tokens == want.total_num_scheduled_tokens
    assert got.finished_request_ids == want.finished_request_ids
    assert list(got.cached_requests.request_ids) == list(want.cached_requests.request_ids)
    assert ([list(b) for b in got.cached_requests.new_block_ids]
            == [list(b) for b in want.cached_requests.new_block_ids])
    assert len(got.new_requests) == len(want.new_requests)
    for g, w in zip(got.new_requests, want.new_requests):
        assert (g.request_id, g.token_ids, g.num_prompt_tokens, g.block_ids,
                g.num_computed_tokens) == (w.request_id, w.token_ids, w.num_prompt_tokens,
                                           w.block_ids, w.num_computed_tokens)
        assert core_params(g.sampling_params) == core_params(w.sampling_params)


def with_int_ids(s: SchedulerOutput) -> SchedulerOutput:
    """LLM's request ids are "0", "1", ...; the wire carries the core's integer indices."""
    return SchedulerOutput(
        [dataclasses.replace(n, request_id=int(n.request_id)) for n in s.new_requests],
        CachedRequestData([int(r) for r in s.cached_requests.request_ids],
                          list(s.cached_requests.new_block_ids)),
        {int(r): n for r, n in s.num_scheduled_tokens.items()},
        s.total_num_scheduled_tokens,
        {int(r) for r in s.finished_request_ids})


# Consecutive steps of core outputs: logprobs, first tokens with their cached prompt tokens,
# each finish reason, rows that stay and rows that change, aborts (no token), and the OUTPUTS
# flags each step's frame must carry.
LP_SHORT = ([11], [-0.1], 1)                                              # logprobs=0
LP_LONG = (list(range(21)), [-0.1 * k - 1e-3 for k in range(21)], 17)     # logprobs=20
OUTPUT_STEPS = [
    ([EngineCoreOutput(3, [10], num_cached_tokens=U32_MAX),
      EngineCoreOutput(1, [11], new_logprobs=[LP_SHORT]),
      EngineCoreOutput(4, [0], new_logprobs=[LP_LONG], num_cached_tokens=0)],
     wire.ROWS | wire.LOGPROBS | wire.CACHED),
    ([EngineCoreOutput(3, [20]), EngineCoreOutput(1, [I32_MAX], "stop", None),
      EngineCoreOutput(4, [22])], wire.FINISHED),
    ([EngineCoreOutput(3, [30], "stop", 30), EngineCoreOutput(4, [31], "length"),
      EngineCoreOutput(9, [], "abort"), EngineCoreOutput(5, [], "abort")],
     wire.ROWS | wire.FINISHED | wire.ABORTED),
    ([EngineCoreOutput(7, [], "abort")], wire.ROWS | wire.ABORTED),
    ([EngineCoreOutput(8, [40], num_cached_tokens=48)], wire.ROWS | wire.CACHED),
    ([EngineCoreOutput(8, [41])], 0),
]


def encode_output_steps() -> list[bytes]:
    enc = wire.OutputsEncoder()
    return [enc.encode(outputs) for outputs, _ in OUTPUT_STEPS]


OUTPUT_FRAMES = encode_output_steps()


def expected_decoded(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Rows in order, then aborts; logprobs at float32 precision."""
    rows = [dataclasses.replace(o, new_logprobs=o.new_logprobs and [
        (ids, f32(values), rank) for ids, values, rank in o.new_logprobs])
        for o in outputs if o.new_token_ids]
    return rows + [EngineCoreOutput(o.request_id, [], "abort")
                   for o in outputs if not o.new_token_ids]


def primed_outputs_decoder() -> wire.OutputsDecoder:
    """A decoder that has seen the first OUTPUTS frame (rows 3, 1, 4)."""
    dec = wire.OutputsDecoder()
    dec.decode(payload(OUTPUT_FRAMES[0], wire.OUTPUTS))
    return dec


def busy_sched_frames() -> tuple[bytes, bytes]:
    """The busy scheduler's first SCHED frame (new requests only), and its first with new
    blocks for running requests and finished ids."""
    frames = [(wire.encode_sched(s), s) for s in busy_scheduler()[1]]
    rich = next(data for data, s in frames
                if s.finished_request_ids and any(s.cached_requests.new_block_ids))
    return frames[0][0], rich


ADD_PARAMS = SamplingParams(max_tokens=300, min_tokens=7, temperature=0.85, top_p=0.93,
                            top_k=40, min_p=0.05, seed=12345, stop_token_ids=[0, 7, I32_MAX],
                            ignore_eos=True, repetition_penalty=1.3, presence_penalty=-1.5,
                            frequency_penalty=2.0, logprobs=MAX_LOGPROBS,
                            logit_bias={0: -100.0, 9: 0.1, I32_MAX: 100.0},
                            allowed_token_ids=[3, 0, I32_MAX, 3],
                            bad_words_token_ids=[[5], [0, I32_MAX, 7], [5]])
SCHED_NEW, SCHED_RICH = busy_sched_frames()
# name -> (decode(payload), a valid whole frame): every decoder, and both OutputsDecoder states.
TOKENS_ITEMS = [(wire.TOKENS_OK, [1, 2, I32_MAX]), (wire.TOKENS_TOO_LONG, 150_000),
                (wire.TOKENS_FAILED, "boom ✓"), (wire.TOKENS_OK, [])]
VALID = {
    "ADD": (wire.decode_add, wire.encode_add(5, [1, 2, 3, I32_MAX], ADD_PARAMS)),
    "ABORT": (wire.decode_abort, wire.encode_abort([4, 0, U32_MAX])),
    "READY": (wire.decode_ready,
              wire.encode_ready(wire.CoreInfo(1024, 32000, 900, 16, [2, 32001], "k3y"))),
    "STATS": (wire.decode_stats, wire.encode_stats(EngineStats(*range(3, 14)))),
    "STATS_REQ": (lambda p: wire.decode_empty(wire.STATS_REQ, p), wire.frame(wire.STATS_REQ)),
    "ERROR": (wire.decode_error, wire.encode_error("boom: ünïcødé ✓")),
    "OUTPUTS rows+logprobs+cached": (lambda p: wire.OutputsDecoder().decode(p),
                                     OUTPUT_FRAMES[0]),
    "OUTPUTS steady": (lambda p: primed_outputs_decoder().decode(p), OUTPUT_FRAMES[1]),
    "OUTPUTS finished+aborted": (lambda p: primed_outputs_decoder().decode(p), OUTPUT_FRAMES[2]),
    "LOAD_TOKENIZER": (wire.decode_load_tokenizer,
                       wire.encode_load_tokenizer(1024, '{"model": "ünï"}')),
    "TOKENIZE": (wire.decode_tokenize, wire.encode_tokenize(["hi", "", "café ☕", "x" * 40])),
    "TOKENS": (wire.decode_tokens, wire.encode_tokens(TOKENS_ITEMS)),
    "SCHED new": (wire.decode_sched, SCHED_NEW),
    "SCHED blocks+finished": (wire.decode_sched, SCHED_RICH),
}
# ERROR takes any bytes; LOAD_TOKENIZER any valid utf-8 after its u32.
STRUCTURED = [name for name in VALID if name not in ("ERROR", "LOAD_TOKENIZER")]


def body_of(name: str) -> bytes:
    return bytes(wire.split_frame(VALID[name][1])[1])


# ---------------------------------------------------------------------------- round trips
def test_core_param_fields_are_every_field_but_the_front_end_ones():
    # A new SamplingParams field must be carried by the params record or listed as front end.
    every = {f.name for f in dataclasses.fields(SamplingParams)}
    assert every == set(CORE_PARAM_FIELDS) | FRONT_END_PARAM_FIELDS


@pytest.mark.parametrize("params", [
    SamplingParams(),
    ADD_PARAMS,
    SamplingParams(seed=0),
    SamplingParams(seed=-1),
    SamplingParams(seed=-(2**63)),
    SamplingParams(seed=2**63 - 1, temperature=0.0, top_k=I32_MAX),
    SamplingParams(logprobs=0, stop_token_ids=[5]),
    SamplingParams(max_tokens=1, min_tokens=1, top_p=1e-9, min_p=1.0, repetition_penalty=1e-6,
                   presence_penalty=2.0, frequency_penalty=-2.0),
    SamplingParams(logit_bias={}, allowed_token_ids=[1]),
    SamplingParams(logit_bias={"5": 1e-300, 6: -7}),
    SamplingParams(bad_words_token_ids=[]),
    SamplingParams(bad_words_token_ids=[[1] * 1024, [2]]),
], ids=["defaults", "every-field", "seed0", "seed-1", "seed-min", "seed-max", "logprobs0",
        "extremes", "no-bias-one-allowed", "bias-only", "no-bad-words", "bad-words"])
@pytest.mark.parametrize("token_ids", [
    [7], [0, 1, I32_MAX, 12345], np.random.default_rng(0).integers(0, 2**31, 1000).tolist(),
], ids=["one", "edges", "long"])
def test_add_round_trip(params, token_ids):
    data = wire.encode_add(U32_MAX, token_ids, params)
    index, ids, got = wire.decode_add(payload(data, wire.ADD))
    assert (index, ids) == (U32_MAX, token_ids)
    assert core_params(got) == core_params(params)


def test_add_leaves_front_end_fields_behind():
    params = SamplingParams(stop=["\n\n", "END"], include_stop_str_in_output=True,
                            skip_special_tokens=False, seed=3)
    _, _, got = wire.decode_add(payload(wire.encode_add(0, [1], params), wire.ADD))
    assert (got.stop, got.include_stop_str_in_output, got.skip_special_tokens) == (
        [], False, True)
    assert core_params(got) == core_params(params)


def test_add_clamps_limits_beyond_the_record():
    # As documented: beyond 2**32 - 1 tokens a limit is no limit (max_model_len ends first).
    params = SamplingParams(max_tokens=2**40, min_tokens=5, top_k=2**40)
    _, _, got = wire.decode_add(payload(wire.encode_add(0, [1], params), wire.ADD))
    assert (got.max_tokens, got.min_tokens, got.top_k) == (U32_MAX, 5, I32_MAX)
    # max_tokens None (no limit) travels as the same no-limit value.
    params = SamplingParams(max_tokens=None, min_tokens=10**12)
    _, _, got = wire.decode_add(payload(wire.encode_add(0, [1], params), wire.ADD))
    assert (got.max_tokens, got.min_tokens) == (U32_MAX, U32_MAX)


@pytest.mark.parametrize("indices", [[], [0], [1, U32_MAX, 5, 5]])
def test_abort_round_trip(indices):
    assert wire.decode_abort(payload(wire.encode_abort(indices), wire.ABORT)) == indices


@pytest.mark.parametrize("eos", [[], [2], [2, 32001, I32_MAX]])
@pytest.mark.parametrize("key", ["", "3f2a9c", "ключ"])
def test_ready_round_trip(eos, key):
    info = wire.CoreInfo(max_model_len=131072, vocab_size=151936, num_kv_blocks=U32_MAX,
                         block_size=16, eos_token_ids=eos, model_key=key)
    assert wire.decode_ready(payload(wire.encode_ready(info), wire.READY)) == info


def test_stats_round_trip():
    stats = EngineStats(*[3**k for k in range(len(dataclasses.fields(EngineStats)) - 1)], 2**62)
    assert wire.decode_stats(payload(wire.encode_stats(stats), wire.STATS)) == stats


@pytest.mark.parametrize("message", ["", "out of memory", "ünïcødé ✓ \n\t"])
def test_error_round_trip(message):
    assert wire.decode_error(payload(wire.encode_error(message), wire.ERROR)) == message


def test_error_with_bad_utf8_still_decodes():
    assert wire.decode_error(memoryview(b"bad \xff\xfe end")) == "bad \ufffd\ufffd end"


@pytest.mark.parametrize("texts", [[], [""], ["hi", "café ☕ 日本語 🙂", "x" * 100_000]])
def test_tokenize_round_trip(texts):
    assert wire.decode_tokenize(payload(wire.encode_tokenize(texts), wire.TOKENIZE)) == texts


def test_tokenize_rejects_invalid_utf8_and_lengths_that_do_not_add_up():
    body = struct.pack("<II", 1, 2) + b"\xff\xfe"
    with pytest.raises(wire.FrameError, match="invalid utf-8"):
        wire.decode_tokenize(memoryview(body))
    with pytest.raises(wire.FrameError, match="add up to 3 bytes, the frame holds 2"):
        wire.decode_tokenize(memoryview(struct.pack("<II", 1, 3) + b"ab"))


def test_tokens_round_trip():
    items = wire.decode_tokens(payload(wire.encode_tokens(TOKENS_ITEMS), wire.TOKENS))
    assert [s for s, _ in items] == [s for s, _ in TOKENS_ITEMS]
    assert items[0][1].tolist() == [1, 2, I32_MAX] and items[0][1].dtype == np.int32
    assert items[1][1] == 150_000 and items[2][1] == "boom ✓" and items[3][1].size == 0


def test_tokens_ids_are_not_a_view_of_the_frame():
    body = bytearray(body_of("TOKENS"))
    ids = wire.decode_tokens(memoryview(body))[0][1]
    body[:] = b"\0" * len(body)
    assert ids.tolist() == [1, 2, I32_MAX]


def test_tokens_refuses_unknown_status_and_token_counts_outside_u32():
    with pytest.raises(ValueError, match="unknown TOKENS status"):
        wire.encode_tokens([(7, [1])])
    with pytest.raises(ValueError, match="uint32"):
        wire.encode_tokens([(wire.TOKENS_TOO_LONG, 2**32)])
    with pytest.raises(wire.FrameError, match="unknown status 7"):
        wire.decode_tokens(memoryview(struct.pack("<IBI", 1, 7, 0)))


def test_load_tokenizer_round_trip():
    got = wire.decode_load_tokenizer(payload(wire.encode_load_tokenizer(77, "{}"),
                                             wire.LOAD_TOKENIZER))
    assert got == (77, "{}", False)
    got = wire.decode_load_tokenizer(payload(wire.encode_load_tokenizer(77, "{}", True),
                                             wire.LOAD_TOKENIZER))
    assert got == (77, "{}", True)
    with pytest.raises(wire.FrameError, match="encode_special_tokens is 2, not 0 or 1"):
        wire.decode_load_tokenizer(memoryview(struct.pack("<IB", 77, 2) + b"{}"))
    body = body_of("LOAD_TOKENIZER")
    for n in range(5):
        assert not decodes_or_frame_error(wire.decode_load_tokenizer, body[:n])
    cut = body.index("ü".encode()) + 1                          # inside a 2-byte character
    with pytest.raises(wire.FrameError, match="invalid utf-8"):
        wire.decode_load_tokenizer(memoryview(body[:cut]))


@pytest.mark.parametrize("kind", [wire.STATS_REQ, wire.SHUTDOWN, wire.TOKENIZER_READY])
def test_empty_frames(kind):
    wire.decode_empty(kind, payload(wire.frame(kind), kind))
    with pytest.raises(wire.FrameError, match="no payload"):
        wire.decode_empty(kind, memoryview(b"x"))


def test_outputs_round_trip_over_consecutive_steps():
    enc, dec = wire.OutputsEncoder(), wire.OutputsDecoder()
    for step, (outputs, flags) in enumerate(OUTPUT_STEPS):
        body = payload(enc.encode(outputs), wire.OUTPUTS)
        assert body[4] == flags, f"step {step}: flags {body[4]:#x}, expected {flags:#x}"
        assert dec.decode(body) == expected_decoded(outputs), f"step {step}"


@pytest.mark.parametrize("step", [1, 5])
def test_outputs_unchanged_rows_are_not_resent(step):
    outputs = OUTPUT_STEPS[step][0]
    fresh = wire.OutputsEncoder().encode(outputs)             # must send its rows
    assert len(fresh) - len(OUTPUT_FRAMES[step]) == 4 * len(outputs)


def test_outputs_finish_codes():
    outputs = [EngineCoreOutput(0, [2], "stop", None), EngineCoreOutput(1, [9], "stop", 9),
               EngineCoreOutput(2, [5], "length", None)]
    data = wire.OutputsEncoder().encode(outputs)
    got = wire.OutputsDecoder().decode(payload(data, wire.OUTPUTS))
    assert [(o.finish_reason, o.stop_reason) for o in got] == [
        ("stop", None), ("stop", 9), ("length", None)]


def test_outputs_logprobs_are_float32():
    got = wire.OutputsDecoder().decode(payload(OUTPUT_FRAMES[0], wire.OUTPUTS))
    ids, values, rank = got[2].new_logprobs[0]
    assert (ids, rank) == (LP_LONG[0], LP_LONG[2])
    assert values == f32(LP_LONG[1]) and values != LP_LONG[1]


def test_outputs_without_rows_need_the_previous_frame():
    with pytest.raises(wire.FrameError, match="same as before"):
        wire.OutputsDecoder().decode(payload(OUTPUT_FRAMES[1], wire.OUTPUTS))


def test_outputs_decoder_state_survives_a_bad_frame():
    dec = primed_outputs_decoder()
    bad = bytearray(payload(OUTPUT_FRAMES[1], wire.OUTPUTS))
    bad[4] |= 0x80                                            # an unknown flag
    with pytest.raises(wire.FrameError, match="flags"):
        dec.decode(memoryview(bytes(bad)))
    got = dec.decode(payload(OUTPUT_FRAMES[1], wire.OUTPUTS))
    assert got == expected_decoded(OUTPUT_STEPS[1][0])


def test_outputs_decoder_does_not_keep_a_view_of_the_callers_buffer():
    # A transport may read frames into a buffer it reuses (recv_into, a bytearray it trims).
    # The rows kept for the next frame must be the decoder's own, not a view of that buffer.
    enc, dec = wire.OutputsEncoder(), wire.OutputsDecoder()
    buf = bytearray(enc.encode([EngineCoreOutput(1, [5]), EngineCoreOutput(2, [6])]))
    dec.decode(wire.split_frame(buf)[1])
    buf[wire.HEADER.size + 5:wire.HEADER.size + 9] = struct.pack("<I", 99)   # buffer reused
    data = enc.encode([EngineCoreOutput(1, [7]), EngineCoreOutput(2, [8])])
    assert [o.request_id for o in dec.decode(payload(data, wire.OUTPUTS))] == [1, 2]
    del buf[:]                                 # BufferError while the decoder holds a view


def test_sched_round_trip_hand_built():
    new = NewRequestData(7, [5, 6, 7, 8, 9, 10], 5, ADD_PARAMS, [3, U32_MAX], 4)  # cache hit
    sched = SchedulerOutput([new], CachedRequestData([3, 0, U32_MAX], [[], [9, 10], [11]]),
                            {3: 1, 0: 1, U32_MAX: 1, 7: 2}, 5, {1, 2, 12})
    assert_sched_equal(wire.decode_sched(payload(wire.encode_sched(sched), wire.SCHED)), sched)


# ---------------------------------------------------------------------------- a real scheduler
def test_sched_round_trip_through_a_real_scheduler():
    sched, steps = busy_scheduler()
    seen = dict(chunk=0, new_blocks=0, cache_hit=0, finished=0, readmitted=0)
    admitted = set()
    for step, out in enumerate(steps):
        got = wire.decode_sched(payload(wire.encode_sched(out), wire.SCHED))
        try:
            assert_sched_equal(got, out)
        except AssertionError as e:
            raise AssertionError(f"step {step}: {e}") from None
        for new in out.new_requests:
            seen["readmitted"] += new.request_id in admitted
            seen["cache_hit"] += new.num_computed_tokens > 0
            admitted.add(new.request_id)
        seen["chunk"] += any(n > 1 for rid, n in out.num_scheduled_tokens.items()
                             if rid in out.cached_requests.request_ids)
        seen["new_blocks"] += any(out.cached_requests.new_block_ids)
        seen["finished"] += bool(out.finished_request_ids)
    assert sched.stats.num_preemptions > 0
    assert {8, 9} <= admitted                                    # the late arrivals ran
    assert all(seen.values()), f"the scenario missed a case: {seen}"


# ---------------------------------------------------------------------------- through the runner
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from scripts.make_tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("wire") / "llama", arch="llama", seed=1))


@pytest.fixture
def restore_torch_threads():
    """`cpu_threads=1` (10x faster here when the cores are busy) sets torch's global thread
    count; give the rest of the session its own back."""
    import torch

    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


def wire_step(core, frame_sizes: list[int]):
    """EngineCore.step (schedule, execute, update) with the runner fed a decoded SCHED frame."""
    def step():
        sched = core.scheduler.schedule()
        data = wire.encode_sched(with_int_ids(sched))
        frame_sizes.append(len(data))
        out = core.runner.execute_model(wire.decode_sched(payload(data, wire.SCHED)))
        out.request_ids = [str(r) for r in out.request_ids]
        return core.scheduler.update_from_output(sched, out)
    return step


def test_runner_works_from_sched_frames(tiny_model, restore_torch_threads):
    from engine import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (70, 5, 120, 33, 90, 17, 60)]
    # Greedy rows, and two seeded random rows that use every sampling field.
    params = [SamplingParams(max_tokens=16, temperature=0.0)] * 5 + [
        params_for(4), dataclasses.replace(params_for(7), max_tokens=16, seed=7)]
    # 12 blocks of 16 for 7 requests of up to 136 tokens, 64 tokens a step: prompts go in
    # chunks and requests are preempted.
    settings = dict(dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=64,
                    num_kv_blocks=12, max_model_len=192, skip_tokenizer_init=True, cpu_threads=1)
    plain, wired = LLM(tiny_model, **settings), LLM(tiny_model, **settings)
    frame_sizes: list[int] = []
    wired.core.step = wire_step(wired.core, frame_sizes)

    want = plain.generate(prompts, params)
    got = wired.generate(prompts, params)
    stats = wired.get_stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small for all requests"
    assert stats.num_steps > sum(map(len, prompts)) // 64          # prompts went in chunks
    assert len(frame_sizes) == stats.num_steps
    assert all(isinstance(r, int) for r in wired.core.runner.requests)   # wire ids only
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == (
            w.outputs[0].token_ids, w.outputs[0].finish_reason), f"request {i} differs"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


# ---------------------------------------------------------------------------- size
@pytest.mark.parametrize("n", [1, 8, 256])
def test_steady_decode_outputs_frame_is_small(n):
    enc = wire.OutputsEncoder()
    enc.encode([EngineCoreOutput(i, [i]) for i in range(n)])
    size = len(enc.encode([EngineCoreOutput(i, [i + 1]) for i in range(n)]))
    assert size <= 16 * n, f"OUTPUTS for {n} decoding requests: {size} B ({size / n:.1f} B each)"


@pytest.mark.parametrize("n", [8, 256])
def test_steady_decode_sched_frame_is_small(n):
    # Prompt lengths spread over a block, so a few requests take a new block each step.
    sched = make_scheduler(num_blocks=8 * n, block_size=16, max_num_seqs=n,
                           max_num_batched_tokens=16 * n, max_model_len=4096)
    for i in range(n):
        sched.add_request(Request(i, [1] * (1 + i % 16), SamplingParams(max_tokens=100), []))
    sizes = []
    for step, out in enumerate(itertools.islice(run_steps(sched), 25)):
        if step > 0:                                               # step 0 is the prefill
            assert not out.new_requests and len(out.num_scheduled_tokens) == n
            sizes.append(len(wire.encode_sched(out)))
    assert max(sizes) <= 16 * n, (f"SCHED for {n} decoding requests: up to {max(sizes)} B "
                                  f"({max(sizes) / n:.1f} B each), sizes {sorted(set(sizes))}")


# ---------------------------------------------------------------------------- hostile payloads
@pytest.mark.parametrize("name", list(VALID))
def test_valid_frame_decodes(name):
    assert decodes_or_frame_error(VALID[name][0], body_of(name))


@pytest.mark.parametrize("name", STRUCTURED)
def test_every_truncation_and_extension_is_a_frame_error(name):
    decode, body = VALID[name][0], body_of(name)
    for n in range(len(body)):
        assert not decodes_or_frame_error(decode, body[:n]), f"{n} of {len(body)} bytes decoded"
    assert not decodes_or_frame_error(decode, body + b"\0"), "a trailing byte was accepted"


@pytest.mark.parametrize("name", list(VALID))
def test_byte_flips_decode_or_raise_frame_error(name):
    decode, body = VALID[name][0], body_of(name)
    rng = random.Random(name)
    for _ in range(300 if body else 0):
        mutated = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        decodes_or_frame_error(decode, mutated)


@pytest.mark.parametrize("name", list(VALID))
def test_random_bytes_decode_or_raise_frame_error(name):
    rng = np.random.default_rng(len(name))
    for _ in range(200):
        decodes_or_frame_error(VALID[name][0],
                               rng.integers(0, 256, rng.integers(0, 80), dtype=np.uint8))


@pytest.mark.parametrize("name", STRUCTURED)
def test_huge_counts_raise_quickly_without_allocating(name):
    # 0xFFFFFFFF at every offset hits every count prefix (rows, ids, blocks, stop ids, ...).
    decode, body = VALID[name][0], body_of(name)
    tracemalloc.start()
    try:
        start = time.perf_counter()
        for at in range(max(0, len(body) - 3)):
            decodes_or_frame_error(decode, body[:at] + b"\xff" * 4 + body[at + 4:])
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding peaked at {peak} bytes"
    assert elapsed < 5.0, f"{len(body)} patched payloads took {elapsed:.1f} s"


def _count_offsets() -> dict[str, tuple[str, int]]:
    """Where the count prefixes are, from the layout in wire's docstring."""
    add_ids = len(body_of("ADD")) - 4 * 4 - 4                  # ADD ends n, token_ids i32[4]
    n_rows = struct.unpack_from("<I", body_of("SCHED new"))[0]
    return {
        "ABORT n": ("ABORT", 0),
        "ADD token_ids n": ("ADD", add_ids),
        "ADD stop_token_ids n": ("ADD", add_ids - 4 * len(ADD_PARAMS.stop_token_ids) - 4),
        "READY eos n": ("READY", 16),
        "OUTPUTS n_rows": ("OUTPUTS rows+logprobs+cached", 0),
        # the frame ends n, rows[2], cached prompt tokens[2]
        "OUTPUTS cached n": ("OUTPUTS rows+logprobs+cached",
                             len(body_of("OUTPUTS rows+logprobs+cached")) - 4 - 8 - 8),
        "SCHED n_rows": ("SCHED new", 0),
        "TOKENIZE n": ("TOKENIZE", 0),
        "TOKENS n": ("TOKENS", 0),
        "TOKENS ids n": ("TOKENS", 5),
        "SCHED n_new": ("SCHED new", 8 + 8 * n_rows),
    }


COUNT_OFFSETS = _count_offsets()


@pytest.mark.parametrize("case", list(COUNT_OFFSETS))
def test_count_of_2_32_minus_1_is_a_frame_error(case):
    name, at = COUNT_OFFSETS[case]
    body = body_of(name)
    assert struct.unpack_from("<I", body, at)[0] < 1000, "the offset is not a count"
    # Nothing sized by the count is allocated (a decoder that believed it would reserve GBs,
    # or loop 4G times: the generous time bound catches that, not a slow machine).
    tracemalloc.start()
    try:
        start = time.perf_counter()
        assert not decodes_or_frame_error(VALID[name][0],
                                          body[:at] + struct.pack("<I", U32_MAX) + body[at + 4:])
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decoding peaked at {peak} bytes"
    assert elapsed < 5.0


# ---------------------------------------------------------------------------- framing
def _header(magic=wire.MAGIC, version=wire.VERSION, kind=wire.ADD, n=0) -> bytes:
    return wire.HEADER.pack(magic, version, kind, n)


@pytest.mark.parametrize("header,needle", [
    (_header(magic=0x00), "magic"),
    (_header(magic=0xE8), "magic"),
    (_header(version=0), "version"),
    (_header(version=wire.VERSION + 1), "version"),
    (_header(kind=0), "kind"),
    (_header(kind=len(wire.KIND_NAMES) + 1), "kind"),
    (_header(kind=255), "kind"),
    (_header(n=wire.MAX_PAYLOAD_BYTES + 1), "limit"),
    (_header(n=U32_MAX), "limit"),
    (b"", "truncated"),
    (_header()[:6], "truncated"),
    (_header() + b"\0", "truncated"),
])
def test_bad_headers(header, needle):
    with pytest.raises(wire.FrameError, match=needle):
        wire.parse_header(header)
    with pytest.raises(wire.FrameError):
        wire.split_frame(header)
    if len(header) == wire.HEADER.size:
        with pytest.raises(wire.FrameError, match=needle):
            list(wire.FrameReader().feed(header + b"\0" * 8))


def test_random_headers_parse_or_raise_frame_error():
    rng = np.random.default_rng(1)
    for _ in range(2000):
        header = rng.integers(0, 256, wire.HEADER.size, dtype=np.uint8).tobytes()
        if rng.random() < 0.5:                         # get past magic and version often
            header = bytes([wire.MAGIC, wire.VERSION]) + header[2:]
        if decodes_or_frame_error(wire.parse_header, header):
            kind, n = wire.parse_header(header)
            assert kind in wire.KIND_NAMES and n <= wire.MAX_PAYLOAD_BYTES


@pytest.mark.parametrize("name", list(VALID))
def test_split_frame_rejects_every_wrong_length(name):
    data = VALID[name][1]
    for n in range(len(data)):
        assert not decodes_or_frame_error(wire.split_frame, data[:n])
    assert not decodes_or_frame_error(wire.split_frame, data + b"\0")


def test_split_frame_on_flipped_and_random_bytes():
    rng = random.Random(2)
    frames = [data for _, data in VALID.values()]
    for _ in range(1500):
        data = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        decodes_or_frame_error(wire.split_frame, data)
        decodes_or_frame_error(wire.split_frame, rng.randbytes(rng.randint(0, 40)))


def _stream() -> tuple[bytes, list[tuple[int, bytes]], set[int]]:
    """Frames back to back: the bytes, the (kind, payload) pairs, and where each frame ends."""
    frames = [VALID[name][1] for name in ("ADD", "STATS_REQ", "OUTPUTS rows+logprobs+cached",
                                          "ABORT", "ERROR", "SCHED blocks+finished")]
    split = [(kind, bytes(body)) for kind, body in map(wire.split_frame, frames)]
    return b"".join(frames), split, set(itertools.accumulate(map(len, frames)))


def test_frame_reader_one_byte_feeds_reassemble():
    stream, want, _ = _stream()
    reader = wire.FrameReader()
    got = [(kind, bytes(body)) for i in range(len(stream))
           for kind, body in reader.feed(stream[i:i + 1])]
    assert got == want
    assert not reader.mid_frame
    reader.eof()


def test_frame_reader_truncated_stream_yields_whole_frames_only_and_eof_raises():
    stream, want, ends = _stream()
    for cut in range(len(stream)):
        reader = wire.FrameReader()
        got = [(kind, bytes(body)) for kind, body in reader.feed(stream[:cut])]
        assert got == want[:sum(end <= cut for end in ends)], f"cut at {cut}"
        if cut == 0 or cut in ends:
            reader.eof()
        else:
            with pytest.raises(wire.FrameError, match="middle of a frame"):
                reader.eof()


def test_frame_reader_waits_for_a_huge_payload_without_allocating_it():
    reader = wire.FrameReader()
    tracemalloc.start()
    try:
        assert list(reader.feed(_header(kind=wire.ERROR, n=wire.MAX_PAYLOAD_BYTES) + b"x")) == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert reader.mid_frame
    with pytest.raises(wire.FrameError):
        reader.eof()


def test_frame_reader_on_flipped_and_random_streams():
    stream, _, _ = _stream()
    rng = random.Random(3)

    def feed_all(data):
        reader = wire.FrameReader()
        for start in range(0, len(data), 37):           # uneven chunks across frame edges
            for kind, _ in reader.feed(bytes(data[start:start + 37])):
                assert kind in wire.KIND_NAMES
        reader.eof()

    for trial in range(300):
        data = bytearray(stream if trial % 2 else rng.randbytes(rng.randint(0, 200)))
        for _ in range(rng.randint(0, 3) if data else 0):
            data[rng.randrange(len(data))] = rng.randrange(256)
        decodes_or_frame_error(feed_all, data)


def test_frame_reader_takes_bytes_when_fed_not_when_iterated():
    # "feed bytes as they arrive": bytes fed while no frame is whole yet (so the caller has
    # nothing to iterate) must not be lost, and the reader must know it is mid-frame.
    data = VALID["ABORT"][1]
    reader = wire.FrameReader()
    reader.feed(data[:3])
    assert reader.mid_frame
    assert [(kind, bytes(body)) for kind, body in reader.feed(data[3:])] == [
        (wire.ABORT, body_of("ABORT"))]


# ---------------------------------------------------------------------------- encoders
@pytest.mark.parametrize("index", [2**32, -1])
@pytest.mark.parametrize("encoder", ["ADD", "ABORT", "OUTPUTS", "SCHED"])
def test_encoders_refuse_indices_outside_u32(encoder, index):
    # A request index that does not fit must be refused, not wrapped onto another request.
    encode = {
        "ADD": lambda: wire.encode_add(index, [1], SamplingParams()),
        "ABORT": lambda: wire.encode_abort([index]),
        "OUTPUTS": lambda: wire.OutputsEncoder().encode([EngineCoreOutput(index, [1])]),
        "SCHED": lambda: wire.encode_sched(SchedulerOutput(
            [], CachedRequestData([index], [[]]), {index: 1}, 1, set())),
    }[encoder]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # numpy 1.x wraps, with this
            data = encode()
    except (ValueError, OverflowError, struct.error):
        return
    pytest.fail(f"{encoder} encoded request index {index} as {data.hex()}")
