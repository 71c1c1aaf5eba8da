import asyncio
import threading

import pytest

from engine import AsyncEngine, LLM, SamplingParams
from scripts.make_tiny_model import make_tiny_model


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
        s = engine.get_stats()
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
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

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
    assert stats.num_generated_tokens < 200


def test_steps_run_off_the_event_loop_thread(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    threads = set()
    real_step = engine.core.step

    def step():
        threads.add(threading.current_thread().name)
        return real_step()

    engine.core.step = step

    async def main():
        loop_thread = threading.current_thread().name
        await _collect(engine, "hi", SamplingParams(max_tokens=3, temperature=0), "a")
        return loop_thread

    try:
        loop_thread = asyncio.run(main())
    finally:
        engine.shutdown()
    assert threads and loop_thread not in threads


def test_bad_request_is_an_error_for_that_request_only(model_dir):
    engine = AsyncEngine(model=model_dir, dtype="float32", device="cpu", num_kv_blocks=64,
                         max_model_len=32)

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(engine, [5] * 40, SamplingParams(max_tokens=3), "bad")
        outs = await _collect(engine, "ok", SamplingParams(max_tokens=3, temperature=0), "good")
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
