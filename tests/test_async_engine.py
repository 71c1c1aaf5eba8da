import asyncio
import os
import signal
import threading
import time

import pytest

from engine import AsyncEngine, LLM, SamplingParams
from engine.async_engine import EngineDeadError
from scripts.make_tiny_model import make_tiny_model
from tests.waiting import until


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=3))


PROMPTS = [f"Request {i}: tell me about the number {i * 7}." for i in range(32)]


async def _collect(engine, prompt, params, rid, abort_after=None):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
        if abort_after is not None and len(outs) == abort_after:
            await engine.abort(rid)
    return outs


async def _wait_idle(engine, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        s = await engine.stats()
        if s.num_running == 0 and s.num_waiting == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


def test_32_streams_half_aborted(model_dir):
    # The ones to abort could run long: the abort, not max_tokens, must end them.
    params = [SamplingParams(max_tokens=400 if i % 2 else 24, temperature=0, ignore_eos=True)
              for i in range(len(PROMPTS))]
    expected = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=256).generate(
        PROMPTS, [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(PROMPTS))
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256)

    async def main():
        tasks = [_collect(engine, p, params[i], f"r{i}", abort_after=3 if i % 2 else None)
                 for i, p in enumerate(PROMPTS)]
        results = await asyncio.gather(*tasks)
        return results, await _wait_idle(engine)

    try:
        results, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    for i, outs in enumerate(results):
        last = outs[-1]
        assert last.finished and sum(o.finished for o in outs) == 1
        text = "".join(o.outputs[0].text for o in outs)
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        if i % 2:
            assert last.outputs[0].finish_reason == "abort"
            assert 3 <= len(ids) < 400
            n = min(len(ids), 24)
            assert ids[:n] == expected[i].outputs[0].token_ids[:n]
        else:
            assert last.outputs[0].finish_reason == "length"
            assert ids == expected[i].outputs[0].token_ids
            assert text == expected[i].outputs[0].text
            assert len(outs) > 1                  # streamed, not one lump
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_leaving_the_loop_early_aborts(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    # ~3-5 s here: it cannot end by itself before the abort reaches it.
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)

    async def main():
        n = 0
        async for _ in engine.generate("hello", params, "x"):
            n += 1
            if n == 2:
                break
        return await _wait_idle(engine)

    try:
        stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert stats.num_generated_tokens < 1000


def test_core_runs_in_its_own_process_and_stops_with_the_engine(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    pid = engine.core.pid
    tokenizer_pid = None
    try:
        tokenizer_pid = engine._batch_tokenizer.process.pid
        assert pid != os.getpid()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"engine.core_process" in f.read()
        with open(f"/proc/{tokenizer_pid}/cmdline", "rb") as f:
            assert b"engine.tokenizer_process" in f.read()
        outs = asyncio.run(_collect(engine, "hi", SamplingParams(max_tokens=3, temperature=0),
                                    "a"))
        assert outs[-1].finished
        assert engine.get_stats().num_steps >= 3          # the steps ran over there
    finally:
        engine.shutdown()
    assert engine.core.process.poll() is not None
    assert not os.path.exists(f"/proc/{pid}")
    assert not os.path.exists(f"/proc/{tokenizer_pid}")


def test_bad_request_is_an_error_for_that_request_only(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                         max_model_len=32)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, [5] * 40, SamplingParams(max_tokens=3), "bad")
        with pytest.raises(ValueError, match="n must be 1 here, got 2.*send n requests"):
            await _collect(engine, "ok", SamplingParams(max_tokens=3, n=2), "n2")
        for too_big in (2**63, -2**63 - 1):     # past int64: named as LLM.generate names them
            with pytest.raises(ValueError, match="token ids"):
                await _collect(engine, [5, too_big], SamplingParams(max_tokens=3), "big")
            with pytest.raises(ValueError, match="token ids"):
                await engine.submit([5, too_big], SamplingParams(max_tokens=3), "big", _Sink())
        for not_text in ("no \ud800 text", "no \udfff text " * 30):   # inline; the thread
            with pytest.raises(ValueError, match="not valid text: surrogates not allowed"):
                await _collect(engine, not_text, SamplingParams(max_tokens=3), "surrogate")
        outs = await _collect(engine, "ok", SamplingParams(max_tokens=3, temperature=0), "good")
        assert not engine._streams
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs[-1].finished


def test_duplicate_request_id(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    async def main():
        gen = engine.generate("a", params, "same")
        first = await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, "b", params, "same")
        await gen.aclose()
        return first

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_non_streamed_request_yields_one_complete_output(model_dir):
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=["e"])]
    prompts = ["one output please", "one output please"]
    expected = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64).generate(
        prompts, params)
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)

    async def main():
        return [[o async for o in engine.generate(p, sp, f"n{i}", stream=False)]
                for i, (p, sp) in enumerate(zip(prompts, params))]

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for outs, exp in zip(results, expected):
        assert len(outs) == 1 and outs[0].finished
        got = outs[0].outputs[0]
        assert got.text == exp.outputs[0].text and got.token_ids == exp.outputs[0].token_ids
        assert got.finish_reason == exp.outputs[0].finish_reason
        assert outs[0].metrics["first_token_time"] <= outs[0].metrics["last_token_time"]


def test_vllm_prompt_dicts_are_the_prompts_they_hold(model_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    text = "one output please"
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    (want,) = llm.generate(text, params)
    ids = llm.tokenizer.encode(text)
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)

    async def main():
        outs = [[o async for o in engine.generate(p, params, f"d{i}", stream=False)]
                for i, p in enumerate([{"prompt": text}, {"prompt_token_ids": ids}])]
        with pytest.raises(ValueError, match="not supported"):
            async for _ in engine.generate({"prompt": text, "lora": "x"}, params, "bad"):
                pass
        return outs

    try:
        (text_out,), (ids_out,) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert text_out.prompt == text and ids_out.prompt is None
    for out in (text_out, ids_out):
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == want.outputs[0].token_ids


def _engine_noting_what_it_tokenizes(model_dir):
    """An engine whose longer prompts go through its tokenizer thread (no process), and the
    list of those prompts, as the thread takes them."""
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                         tokenizer_process=False)
    seen = []
    real = engine._batch_tokenizer.encode_now
    engine._batch_tokenizer.encode_now = lambda batch: seen.extend(batch) or real(batch)
    return engine, seen


def test_requests_queued_for_the_tokenizer_are_dropped_on_abort_and_failed_on_shutdown(
        model_dir):
    """A prompt waiting for the tokenizer thread is never tokenized once its request is
    aborted, and shutdown fails the waiting requests at once, not after tokenizing them (a
    cancelled client's 15 MB prompts used to hold up later requests and the server's stop)."""
    long_prompt = "word " * 100                 # past tokenize_inline_max_chars: queued
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine, seen = _engine_noting_what_it_tokenizes(model_dir)
    gate = threading.Event()
    stopper = None

    async def queued(n):
        await until(lambda: len(engine._batch_tokenizer._pending) >= n, f"{n} prompts queued")

    async def main():
        nonlocal stopper
        engine._tokenizer_thread.submit(gate.wait)      # the tokenizer thread is busy
        aborted = asyncio.create_task(_collect(engine, long_prompt + "a", params, "a"))
        await queued(1)
        await engine.abort("a")
        kept = asyncio.create_task(_collect(engine, long_prompt + "k", params, "k"))
        await queued(2)
        gate.set()
        (dropped,), outs = await aborted, await kept
        gate.clear()
        engine._tokenizer_thread.submit(gate.wait)
        waiting = asyncio.create_task(_collect(engine, long_prompt + "w", params, "w"))
        await queued(1)
        stopper = threading.Thread(target=engine.shutdown)
        stopper.start()
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(waiting, 10)         # while the thread is still busy
        return dropped, outs

    try:
        dropped, outs = asyncio.run(main())
    finally:
        gate.set()
        if stopper is not None:
            stopper.join()
        engine.shutdown()
    assert dropped.finished and dropped.outputs[0].finish_reason == "abort"
    assert dropped.prompt_token_ids == [] and seen == [long_prompt + "k"]
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 4


def test_killing_the_core_ends_every_stream_with_an_error_within_a_second(model_dir):
    died = threading.Event()
    reasons = []

    def on_dead(reason):
        reasons.append(reason)
        died.set()

    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256,
                         on_dead=on_dead)
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    async def stream(i, started):
        n = 0
        try:
            async for _ in engine.generate(f"stream {i}", params, f"s{i}"):
                n += 1
                if n == 2:
                    started.release()
        except EngineDeadError as e:
            return time.monotonic(), str(e), n
        return None, "finished normally", n

    async def main():
        started = asyncio.Semaphore(0)
        tasks = [asyncio.create_task(stream(i, started)) for i in range(4)]
        for _ in tasks:
            await started.acquire()
        killed_at = time.monotonic()
        os.kill(engine.core.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        with pytest.raises(EngineDeadError, match="killed by signal 9"):
            await _collect(engine, "after", SamplingParams(max_tokens=2), "late")
        return killed_at, results

    try:
        killed_at, results = asyncio.run(main())
        assert died.wait(5)
    finally:
        engine.shutdown()
    for ended_at, message, n in results:
        assert ended_at is not None, message
        assert ended_at - killed_at < 1.0
        assert "killed by signal 9" in message and n >= 2
    assert "killed by signal 9" in reasons[0]
    with pytest.raises(EngineDeadError):
        engine.get_stats()


class _Sink:
    """A submit() sink: records what arrives, on which thread, and when it is over."""

    def __init__(self):
        self.items = []
        self.threads = set()
        self.started = threading.Event()
        self.done = threading.Event()

    def __call__(self, item):
        self.items.append(item)
        self.threads.add(threading.current_thread().name)
        self.started.set()
        if isinstance(item, BaseException) or item.finished:
            self.done.set()


def test_submit_hands_each_step_to_the_sink_on_the_reader_thread(model_dir):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256)

    async def main():
        expected = await _collect(engine, PROMPTS[0], params, "via-generate")
        sinks = [_Sink() for _ in range(4)]
        for i, sink in enumerate(sinks):
            await engine.submit(PROMPTS[0] if i == 0 else PROMPTS[i], params, f"sub{i}", sink)
        for sink in sinks:
            assert await asyncio.to_thread(sink.done.wait, 30)
        return expected, sinks, await _wait_idle(engine)

    try:
        expected, sinks, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    got = sinks[0].items
    assert [t for o in got for t in o.outputs[0].token_ids] == \
        [t for o in expected for t in o.outputs[0].token_ids]
    assert "".join(o.outputs[0].text for o in got) == "".join(o.outputs[0].text for o in expected)
    assert len(got) > 1 and got[-1].finished and sum(o.finished for o in got) == 1
    assert all(s.threads == {"core-reader"} for s in sinks)       # not the loop's thread
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and not engine._streams


def test_submit_refuses_a_bad_request_and_aborts_from_any_thread(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256,
                         max_model_len=1024)

    async def main():
        never = _Sink()
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.submit("word " * 2000, SamplingParams(), "too-long", never)
        sink = _Sink()
        # ~3-5 s here: it cannot end by itself before the abort reaches it.
        await engine.submit("abort me", SamplingParams(max_tokens=1000, temperature=0,
                                                       ignore_eos=True), "ab", sink)
        assert await asyncio.to_thread(sink.started.wait, 30)
        await asyncio.to_thread(engine.abort_nowait, "ab")   # from another thread
        assert await asyncio.to_thread(sink.done.wait, 30)
        return never, sink, await _wait_idle(engine)

    try:
        never, sink, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert never.items == []
    assert sink.items[-1].outputs[0].finish_reason == "abort"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("hook", ["processor_add", "core_add"])
def test_an_abort_from_another_thread_as_the_request_goes_into_the_core_ends_it(model_dir, hook):
    """The abort lands on another thread while the loop sends the request to its core: after
    submit's check of the flag (as the output processor takes it), or while the ADD is queued.
    It was lost there (the ABORT before the ADD, or the flag set and never read again) and the
    request ran to max_tokens."""
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256,
                         max_model_len=1024)
    owner, name = (engine._processor, "add_request") if hook == "processor_add" else \
        (engine.core, "add")
    inner = getattr(owner, name)

    def abort_meanwhile(*args, **kwargs):
        aborter = threading.Thread(target=engine.abort_nowait, args=("ab",))
        aborter.start()
        aborter.join()
        return inner(*args, **kwargs)
    setattr(owner, name, abort_meanwhile)

    async def main():
        sink = _Sink()
        # ~3-5 s here if the abort is lost, so that it cannot end by itself first.
        await engine.submit("abort me", SamplingParams(max_tokens=1000, temperature=0,
                                                       ignore_eos=True), "ab", sink)
        assert await asyncio.to_thread(sink.done.wait, 30)
        return sink, await _wait_idle(engine)

    try:
        sink, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert sink.items[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in sink.items) < 1000
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_submit_sinks_get_the_error_when_the_core_dies(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256)
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    async def main():
        sinks = [_Sink() for _ in range(3)]
        for i, sink in enumerate(sinks):
            await engine.submit(f"dies {i}", params, f"d{i}", sink)
        for sink in sinks:                     # every one has produced a token
            assert await asyncio.to_thread(sink.started.wait, 30)
        os.kill(engine.core.pid, signal.SIGKILL)
        for sink in sinks:
            assert await asyncio.to_thread(sink.done.wait, 10)
        return sinks

    try:
        sinks = asyncio.run(main())
    finally:
        engine.shutdown()
    for s in sinks:
        assert isinstance(s.items[-1], EngineDeadError), s.items[-1]
        assert "killed by signal 9" in str(s.items[-1])
        assert sum(isinstance(i, BaseException) for i in s.items) == 1


@pytest.mark.parametrize("abort", [False, True])
def test_submit_tells_a_request_waiting_for_the_tokenizer_once_when_the_core_dies(model_dir,
                                                                               abort):
    """The core dies while a submitted prompt waits for the tokenizer (aborted meanwhile, or
    not): the caller hears of it once, through the sink (submit used to raise as well, and an
    aborted one got the error and then an abort)."""
    died = threading.Event()
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                         tokenizer_process=False, on_dead=lambda reason: died.set())
    gate = threading.Event()
    sink = _Sink()

    async def main():
        engine._tokenizer_thread.submit(gate.wait)      # the tokenizer thread is busy
        task = asyncio.create_task(engine.submit("word " * 100, SamplingParams(max_tokens=4),
                                                 "r", sink))
        await until(lambda: engine._batch_tokenizer._pending, "the prompt queued")
        if abort:
            engine.abort_nowait("r")
        os.kill(engine.core.pid, signal.SIGKILL)
        assert await asyncio.to_thread(died.wait, 10)
        gate.set()
        return await asyncio.wait_for(task, 10)

    try:
        returned = asyncio.run(main())
    finally:
        gate.set()
        engine.shutdown()
    assert returned is None
    assert len(sink.items) == 1 and isinstance(sink.items[0], EngineDeadError), sink.items
    assert "killed by signal 9" in str(sink.items[0])


def test_core_start_failure_is_raised_with_its_message(model_dir):
    with pytest.raises(RuntimeError, match="cannot hold one sequence"):
        AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=2,
                    max_model_len=1024)


@pytest.mark.parametrize("tokenizer_process", [True, False], ids=["process", "thread"])
def test_loop_keeps_ticking_while_a_1m_character_prompt_is_tokenized(model_dir,
                                                                     tokenizer_process):
    gaps_ms, tokens_during, error, tokenize_ms = _tokenize_huge_prompt_beside_streams(
        model_dir, inline=False, tokenizer_process=tokenizer_process)
    assert "max_model_len" in error                     # 1M characters is far too long
    # Judged against the tokenization itself, not a fixed bound: on a loaded 2-core machine
    # the OS alone can keep the loop's thread off a CPU for tens of ms, and the tokenization
    # (at SCHED_IDLE in its process) then takes longer too. Inline, the loop stalls for the
    # whole of it (the next test); here no gap comes near that.
    assert max(gaps_ms) < tokenize_ms / 5, (
        f"the loop stalled {max(gaps_ms):.0f} ms of a {tokenize_ms:.0f} ms tokenization")
    assert min(tokens_during) >= 3, (                   # and the streams kept going
        f"{tokens_during} tokens in a {tokenize_ms:.0f} ms tokenization")


def test_core_process_on_cpu_leaves_cores_to_the_rest(model_dir, capfd):
    # torch's default (a thread per core) stalled the streams of the test above for whole
    # tokenizations on a busy CI machine: a step every ~250 ms.
    from engine.core_process import default_cpu_threads

    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    engine.shutdown()
    want = max(1, len(os.sched_getaffinity(0)) // 2)
    assert default_cpu_threads() == default_cpu_threads("cpu") == want
    assert default_cpu_threads("cuda") == 1     # a GPU core's host work: staging copies
    assert f"on cpu, {want} threads (torch.float32)" in capfd.readouterr().err


def test_the_tick_test_sees_a_stall_when_tokenizing_inline(model_dir):
    # The same measurement with tokenization forced onto the loop: proves it can fail.
    gaps_ms, _, error, tokenize_ms = _tokenize_huge_prompt_beside_streams(model_dir,
                                                                          inline=True)
    assert "max_model_len" in error
    assert max(gaps_ms) > tokenize_ms / 2


def _tokenize_huge_prompt_beside_streams(model_dir, inline, tokenizer_process=True):
    inline_max = {"tokenize_inline_max_chars": 2_000_000} if inline else {}   # else default
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=256,
                         tokenizer_process=tokenizer_process, **inline_max)
    huge = ("The quick brown fox jumps over the lazy dog. " * 25000)[:1_000_000]
    params = SamplingParams(max_tokens=5000, temperature=0, ignore_eos=True)

    async def main():
        gaps, stamps = [], [[] for _ in range(2)]
        done = asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append((now - last) * 1000)
                last = now

        async def stream(i):
            async for _ in engine.generate(f"short stream {i}", params, f"s{i}"):
                stamps[i].append(time.perf_counter())
                if done.is_set():
                    return

        streams = [asyncio.create_task(stream(i)) for i in range(2)]
        await until(lambda: all(stamps), "both streams' first tokens", timeout_s=30,
                    poll_s=0.01)
        tick = asyncio.create_task(ticker())
        await until(lambda: len(gaps) >= 5, "the ticker's first gaps (a baseline)", poll_s=0.005)
        start = time.perf_counter()
        try:
            await _collect(engine, huge, SamplingParams(max_tokens=1), "huge")
            error = ""
        except ValueError as e:
            error = str(e)
        end = time.perf_counter()
        done.set()
        await asyncio.gather(tick, *streams)
        return (gaps, [sum(start < t < end for t in s) for s in stamps], error,
                1e3 * (end - start))

    try:
        assert (engine._batch_tokenizer.process is not None) == tokenizer_process
        return asyncio.run(main())
    finally:
        engine.shutdown()


# ---- The API as a vLLM user expects it: request ids, aborts, parameters changed after
# they were built (a review's findings; each test failed before its fix).


# SamplingParams are checked when built, never again: an instance whose field was set to an
# out-of-range value afterwards (`params.max_tokens = budget` that came out 0, a temperature
# of -1) passes AsyncEngine's request checks, and then the core (which rebuilds and checks the
# params from the ADD frame) or the sender thread (struct.pack of a negative max_tokens) fails:
# the whole engine dies and every other running stream ends with EngineDeadError.
# vLLM: a bad request is that request's error (or, unchecked, just that request's odd output);
# the README's contract: a bad value raises ValueError naming the parameter, others unaffected.
@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -1),
                                         ("temperature", -1.0)])
def test_a_bad_params_instance_fails_its_request_only(model_dir, field, value):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)

    async def main():
        other_params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        other = engine.generate("a request minding its own business", other_params, "other")
        first = await other.__anext__()
        bad = SamplingParams(max_tokens=8, temperature=0)
        setattr(bad, field, value)          # e.g. max_tokens = max_model_len - prompt length
        bad_error = None
        try:
            await asyncio.wait_for(
                _drain(engine.generate("bad", bad, "bad")), 30)
        except Exception as e:      # noqa: BLE001
            bad_error = e
        try:
            rest = await asyncio.wait_for(_drain(other), 30)
            other_result = sum(len(o.outputs[0].token_ids) for o in [first, *rest])
        except Exception as e:      # noqa: BLE001
            other_result = e
        return bad_error, other_result

    async def _drain(gen):
        return [o async for o in gen]

    try:
        bad_error, other_result = asyncio.run(main())
        alive = engine.is_alive
    finally:
        engine.shutdown()
    assert other_result == 30 and alive, (
        f"{field}={value!r}: the bad request got {bad_error!r}; the other request got "
        f"{other_result!r}; engine alive: {alive}")
    assert isinstance(bad_error, ValueError) and field in str(bad_error), bad_error


# A request id reused right after its previous stream was closed early (aclose / break /
# cancel: the request was aborted) gets the OLD request's outputs that the core reader thread
# had already handed to the loop (_dispatch looks streams up by request_id, not by the core's
# index). vLLM: a new request with a free id gets only its own outputs.
def _block_loop_until(cond, what, timeout=30.0):
    # Deliberately blocks the event loop thread (the reader thread keeps working).
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


async def _old_output_pending(engine, gen, rid):
    """Takes the first output of `gen`, then holds the loop until the reader thread has
    processed one more step of that request (so a _dispatch of it is queued on the loop)."""
    first = await gen.__anext__()
    channel = engine._streams.get(rid)
    state = engine._processor.states.get(channel.index) if channel is not None else None
    if state is None:           # finished already: its last output was handed to the loop
        return first
    index = channel.index
    n0 = len(first.outputs[0].token_ids)
    _block_loop_until(lambda: len(state.token_ids) > n0 or index not in engine._processor.states,
                      "the reader thread to process another step of the old request")
    with engine._outputs_lock:      # that step's _process_outputs has returned: dispatch queued
        pass
    return first


def test_reused_id_after_aclose_gets_only_its_own_tokens(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=128)
    old_params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    new_params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    new_prompt = "a completely different prompt"

    async def main():
        want = [t async for o in engine.generate(new_prompt, new_params, "ref")
                for t in o.outputs[0].token_ids]
        gen = engine.generate("the old request", old_params, "x")
        await _old_output_pending(engine, gen, "x")
        await gen.aclose()              # the consumer leaves: the old request is aborted
        got = [t async for o in engine.generate(new_prompt, new_params, "x")
               for t in o.outputs[0].token_ids]
        return want, got

    try:
        want, got = asyncio.run(main())
    finally:
        engine.shutdown()
    assert got == want, f"the new request 'x' got {got}, its own tokens are {want}"


def test_reused_id_is_not_ended_by_the_old_requests_final_output(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=128)
    old_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    new_params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main():
        gen = engine.generate("the old request", old_params, "x")
        await _old_output_pending(engine, gen, "x")     # its last output: finished
        await gen.aclose()
        outs = [o async for o in engine.generate("the new request", new_params, "x")]
        stats = await engine.stats()
        return outs, stats

    try:
        outs, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n == 40, (f"the new request's stream ended after {n} token(s) with "
                     f"finish_reason={outs[-1].outputs[0].finish_reason!r}, while "
                     f"{stats.num_running + stats.num_waiting} request(s) are still in the core "
                     f"(running {stats.num_running}, waiting {stats.num_waiting})")


# Once a request's finished output has been handed out, its id is free again in vLLM (the
# request state is dropped when the final output is made). Here the id stays 'in use' until
# the consumer's generator object is closed, e.g. after `break` on the finished output (the
# usual loop `if out.finished: break`), or while the generator is still referenced.
def test_id_is_free_once_the_finished_output_was_received(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def main():
        gen = engine.generate("first", params, "x")
        async for out in gen:
            if out.finished:
                break                    # got everything; the generator is kept (or not yet
                                         # finalized)
        assert out.finished
        try:
            return [o async for o in engine.generate("second", params, "x")]
        finally:
            await gen.aclose()

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs[-1].finished


def test_id_is_free_after_break_on_the_finished_output(model_dir):
    """The same without keeping the generator: `break` drops it, but asyncio closes a dropped
    async generator only later (its finalizer schedules aclose() as a task)."""
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def main():
        async for out in engine.generate("first", params, "x"):
            if out.finished:
                break
        return [o async for o in engine.generate("second", params, "x")]

    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outs[-1].finished


# submit() refuses a request whose stop strings need a tokenizer (skip_tokenizer_init) with a
# ValueError, raised from _send_to_core, outside submit's cleanup: the request id stays in
# _streams for good ('already in use' on a retry), and on shutdown the sink of that refused
# request is called with EngineDeadError (submit's contract: a request refused first never has
# its sink called).
def test_a_refused_submit_leaves_nothing_behind(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                         skip_tokenizer_init=True)
    calls = []

    async def main():
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            await engine.submit([5, 6, 7], SamplingParams(max_tokens=3, stop=["x"]), "r",
                                calls.append)
        leftover = dict(engine._streams)
        # A retry of the same id, now without stop strings: must be accepted.
        retry_error = None
        try:
            await engine.submit([5, 6, 7], SamplingParams(max_tokens=3), "r", lambda out: None)
        except ValueError as e:
            retry_error = e
        return leftover, retry_error

    try:
        leftover, retry_error = asyncio.run(main())
    finally:
        engine.shutdown()
    problems = []
    if leftover:
        problems.append(f"the refused request is still registered: {sorted(leftover)}")
    if retry_error is not None:
        problems.append(f"retrying the id failed: {retry_error!r}")
    if calls:
        problems.append(f"the refused request's sink was called at shutdown: {calls!r}")
    assert not problems, "; ".join(problems)


# vLLM's AsyncLLM.abort takes `request_id: str | Iterable[str]`; here a list of ids raises
# TypeError (unhashable list) and aborts nothing.
def test_abort_takes_a_list_of_ids(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)

    async def run(rid, started):
        outs = []
        async for o in engine.generate(f"prompt {rid}", params, rid):
            outs.append(o)
            started.set()
        return outs

    async def main():
        events = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(run(r, e)) for r, e in zip(["a", "b"], events)]
        for e in events:
            await asyncio.wait_for(e.wait(), 30)
        try:
            await engine.abort(["a", "b"])
        except BaseException:
            for t in tasks:                  # the abort failed: end them here
                t.cancel()
            raise
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(r[-1].outputs[0].finish_reason == "abort" for r in results)


# vLLM clones a request's SamplingParams as it takes it (Processor.process_inputs): a caller
# may change and reuse one object for its next request at once. Here the sender thread packed
# the ADD frame later, from the caller's object: an earlier request ran with a later request's
# seed, or, given a later request's bad value, the core refused the frame and stopped for all.
class _Done:
    def __init__(self):
        self.ids, self.error, self.event = [], None, threading.Event()

    def __call__(self, item):
        if isinstance(item, BaseException):
            self.error = item
            self.event.set()
            return
        self.ids.extend(item.outputs[0].token_ids)
        if item.finished:
            self.event.set()


def test_a_params_object_changed_after_submit_leaves_the_submitted_requests_as_they_were(
        model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=128)

    async def run(reuse):
        shared = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
        sinks = []
        for seed in range(4):
            if reuse:
                shared.seed = seed          # the next request's seed, set on the same object
            params = shared if reuse else SamplingParams(max_tokens=12, temperature=1.0,
                                                         ignore_eos=True, seed=seed)
            sinks.append(_Done())
            await engine.submit("Tell me a story", params, f"{reuse}-{seed}", sinks[-1])
        if reuse:
            shared.max_tokens = 0           # the caller's next request: a bad value
            with pytest.raises(ValueError, match="max_tokens"):
                await engine.submit("Another one", shared, "bad", _Done())
        for sink in sinks:
            assert await asyncio.to_thread(sink.event.wait, 30)
        return [(s.ids, s.error) for s in sinks]

    try:
        fresh = asyncio.run(run(False))
        reused = asyncio.run(run(True))
        alive = engine.is_alive
    finally:
        engine.shutdown()
    assert len({tuple(ids) for ids, _ in fresh}) > 1     # the seeds do make different tokens
    assert reused == fresh and alive, (reused, engine.dead_reason)


def test_a_cancelled_stats_call_leaves_the_engine_running(model_dir):
    """`await engine.stats()` cancelled (a timeout, an app's shutdown) before the core's answer
    came: the late answer used to meet a cancelled future on the reader thread, which took the
    error for a front-end failure and killed the core."""
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)

    async def main():
        os.kill(engine.core.pid, signal.SIGSTOP)        # it answers after the timeout
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(engine.stats(), 0.2)
        finally:
            os.kill(engine.core.pid, signal.SIGCONT)
        stats = await asyncio.wait_for(engine.stats(), 30)   # answered after the late one
        outs = await _collect(engine, "still alive?", SamplingParams(
            max_tokens=4, temperature=0, ignore_eos=True), "r")
        return stats, outs

    try:
        stats, outs = asyncio.run(main())
        dead = engine.dead_reason
    finally:
        engine.shutdown()
    assert dead is None, dead
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and outs[-1].finished


def test_a_cancelled_generate_drops_its_prompt_queued_for_the_tokenizer(model_dir):
    """Leaving generate early aborts its request, also while its prompt waits for the
    tokenizer: the prompt is dropped unread (it used to be tokenized for nobody, holding up
    the prompts behind it)."""
    engine, seen = _engine_noting_what_it_tokenizes(model_dir)
    gate = threading.Event()
    long_prompt = "word " * 100                 # past tokenize_inline_max_chars: queued
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        engine._tokenizer_thread.submit(gate.wait)      # the tokenizer thread is busy
        task = asyncio.create_task(_collect(engine, long_prompt + "cancelled", params, "c"))
        await until(lambda: len(engine._batch_tokenizer._pending) == 1, "the prompt queued")
        task.cancel()                                    # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        # A later request: once it is answered, the tokenizer thread has been through its queue.
        return await _collect(engine, long_prompt + "later", params, "l")

    try:
        later = asyncio.run(main())
    finally:
        gate.set()
        engine.shutdown()
    assert seen == [long_prompt + "later"] and later[-1].finished


def test_a_generate_waiting_for_the_tokenizer_ends_within_a_second_of_the_core_dying(
        model_dir):
    """README: if the core dies, every in-flight request ends with an error naming the cause
    within a second, also one whose prompt waits for the tokenizer (it heard of it only once
    its prompt was tokenized, behind whatever the tokenizer was busy with)."""
    died = threading.Event()
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                         tokenizer_process=False, on_dead=lambda reason: died.set())
    gate = threading.Event()

    async def main():
        engine._tokenizer_thread.submit(gate.wait)      # busy with someone's long prompt
        task = asyncio.create_task(_collect(engine, "word " * 100,
                                            SamplingParams(max_tokens=4), "r"))
        await until(lambda: engine._batch_tokenizer._pending, "the prompt queued")
        killed = time.monotonic()
        os.kill(engine.core.pid, signal.SIGKILL)
        done, _ = await asyncio.wait([task], timeout=5)
        ended = time.monotonic()
        gate.set()
        with pytest.raises(EngineDeadError, match="killed by signal 9"):
            await task
        return bool(done), ended - killed

    try:
        in_time, after = asyncio.run(main())
    finally:
        gate.set()
        engine.shutdown()
    assert in_time and died.is_set(), f"still waiting {after:.1f} s after the core died"


def _refusing_decode(tokenizer, bad_id):
    """The tokenizer, its decode raising for `bad_id` (as a slow SentencePiece tokenizer raises
    IndexError for an id past its vocabulary, which a model with a padded vocabulary samples)."""
    base = type(tokenizer)

    class Refusing(base):
        def decode(self, ids, *args, **kwargs):
            if bad_id in ([ids] if isinstance(ids, int) else list(ids)):
                raise IndexError(f"piece id {bad_id} is out of range")
            return super().decode(ids, *args, **kwargs)
    tokenizer.__class__ = Refusing
    return tokenizer


@pytest.mark.parametrize("fault", ["decode", "sink"])
def test_one_requests_output_fault_ends_that_request_alone(model_dir, monkeypatch, fault):
    """A request whose output could not be made (its tokens' decode raising) or whose sink
    raised: the exception reached the core reader thread, which took it for the front end's
    failure and killed the core: every request failed, and the engine refused all later ones.
    Now that request alone ends (RequestFailed; a raising sink's request is aborted) and the
    others, later ones too, run as without it."""
    import engine.async_engine as ae
    bad_id = 1000
    real_load = ae.load_tokenizer
    monkeypatch.setattr(ae, "load_tokenizer",
                        lambda config: _refusing_decode(real_load(config), bad_id))
    settings = dict(dtype="float32", device="cpu", num_kv_blocks=256, cpu_threads=1)
    good = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = LLM(model_dir, **settings).generate(["A good prompt"], good)[0].outputs[0]
    assert bad_id not in expected.token_ids
    engine = AsyncEngine(model=model_dir, **settings)

    async def main():
        loop = asyncio.get_running_loop()
        first = asyncio.Event()
        outs = []

        async def run_good():
            async for out in engine.generate("A good prompt", good, "good"):
                outs.append(out)
                first.set()
        task = asyncio.create_task(run_good())
        await first.wait()                                   # under way
        if fault == "decode":
            with pytest.raises(Exception, match="piece id 1000 is out of range") as failed:
                await _collect(engine, [5, bad_id, 7], SamplingParams(max_tokens=8), "bad")
            assert type(failed.value).__name__ == "RequestFailed", failed.value
        else:
            done = loop.create_future()

            def sink(out):
                if not isinstance(out, BaseException) and out.outputs[0].token_ids:
                    loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
                    raise RuntimeError("the consumer broke")
            await engine.submit("A bad consumer", SamplingParams(max_tokens=400, temperature=0,
                                                                 ignore_eos=True), "bad", sink)
            await done
        await task
        later = await _collect(engine, "A good prompt", good, "later")
        return outs, later, await _wait_idle(engine), engine.is_alive

    try:
        outs, later, stats, alive = asyncio.run(main())
    finally:
        engine.shutdown()
    assert alive
    assert [t for o in outs for t in o.outputs[0].token_ids] == expected.token_ids
    assert [t for o in later for t in o.outputs[0].token_ids] == expected.token_ids
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("failing", [0, 1], ids=["batch tokenizer", "inline tokenizer"])
def test_an_engine_that_fails_to_start_after_its_core_leaves_no_process(model_dir, monkeypatch,
                                                                          failing):
    """A step of start-up after the core's (the tokenizers') that raises: the core and the
    tokenizer process already started are stopped, not left to the threads that hold them."""
    from engine import async_engine
    started, made = [], []
    real_core, real_tokenizer = async_engine.CoreClient, async_engine.BatchTokenizer

    def core(*args, **kwargs):
        started.append(real_core(*args, **kwargs))
        return started[-1]

    def tokenizer(*args, **kwargs):
        if len(made) == failing:
            raise RuntimeError("this tokenizer fails")
        made.append(real_tokenizer(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(async_engine, "CoreClient", core)
    monkeypatch.setattr(async_engine, "BatchTokenizer", tokenizer)
    processes = []
    try:
        with pytest.raises(RuntimeError, match="this tokenizer fails"):
            AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                        tokenizer_process=True, tokenize_inline_max_chars=256)
        processes = [started[0].process] + [t.process.process for t in made]
        assert len(processes) == 1 + failing            # the tokenizer had a process to stop
        for process in processes:
            assert process.wait(30) is not None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
