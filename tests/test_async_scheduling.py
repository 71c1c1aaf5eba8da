"""Async scheduling (engine/engine_core.py): step N+1 is planned and launched before step N's
tokens reach the host. It must change nothing a caller sees: the same tokens, logprobs and
finish reasons as one step at a time, for every sampling option, through chunked prefill,
preemption, prefix groups and aborts, with the KV pool whole afterwards."""
import random

import pytest

from engine import LLM, SamplingParams
from scripts.make_tiny_model import make_tiny_model

VOCAB = 1000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=1))


def prompts(n=12, seed=0):
    rng = random.Random(seed)
    lengths = [1, 90, 2, 17, 64, 5, 128, 33, 9, 70, 3, 47][:n]
    return [[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths]


def mixed_params(stop_ids: list[int]) -> list[SamplingParams]:
    """Every sampling feature: greedy, seeded random with filters, logprobs, min_tokens,
    penalties (read from rows kept on the device: engine/penalty_rows.py), stop tokens that
    end requests while a step for them is already in flight, and several lengths."""
    return [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, top_k=40, seed=7),
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=7, temperature=0.0, stop_token_ids=stop_ids),
        SamplingParams(max_tokens=10, temperature=0.7, min_p=0.05, seed=3, logprobs=1),
        SamplingParams(max_tokens=11, temperature=0.0, min_tokens=6, stop_token_ids=stop_ids),
        SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=13, temperature=1.0, seed=11, presence_penalty=0.5,
                       frequency_penalty=0.3),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=15, temperature=0.0, stop_token_ids=stop_ids),
        SamplingParams(max_tokens=6, temperature=0.8, seed=5),
        SamplingParams(max_tokens=14, temperature=0.0),
    ]


def run(model, ps, params, async_scheduling, **settings):
    llm = LLM(model, dtype="float32", device="cpu", async_scheduling=async_scheduling,
              **settings)
    outs = llm.generate(ps, params)
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "blocks left held"
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
            for o in outs], stats


def stop_ids_hit_midway(model, ps):
    """Tokens the greedy requests produce in their first few steps: as stop tokens they end
    requests early, at different steps."""
    got, _ = run(model, ps, SamplingParams(max_tokens=6, temperature=0.0), False,
                 num_kv_blocks=256)
    return sorted({toks[k] for k, (toks, _, _) in enumerate(got) for k in (2, 4) if
                   k < len(toks)})[:6]


SETTINGS = {
    "plain": dict(num_kv_blocks=256),
    # Prompts in chunks of 32 beside decode rows, and a pool too small for every request at
    # once: preemptions while tokens are in flight.
    "chunked_preempted": dict(num_kv_blocks=14, block_size=16, max_num_batched_tokens=32,
                              max_model_len=160),
    "no_caching_no_groups": dict(num_kv_blocks=256, enable_prefix_caching=False,
                                 enable_prefix_groups=False),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_same_outputs_as_one_step_at_a_time(model, name):
    ps = prompts()
    params = mixed_params(stop_ids_hit_midway(model, ps))
    sync, sync_stats = run(model, ps, params, False, **SETTINGS[name])
    asyn, async_stats = run(model, ps, params, True, **SETTINGS[name])
    for i, (a, b) in enumerate(zip(asyn, sync)):
        assert a[:2] == b[:2], f"request {i} ({params[i]}) differs"
        # Logprobs: the same tokens and ranks; the values to float32 rounding (rows are
        # batched differently when steps are planned at other moments: preemptions, chunks).
        assert (a[2] is None) == (b[2] is None), i
        for la, lb in zip(a[2] or [], b[2] or []):
            assert [(t, x.rank) for t, x in la.items()] == [(t, x.rank) for t, x in lb.items()]
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la), (i, la, lb)
    assert any(reason == "stop" for _, reason, _ in sync), "no request ended by a stop token"
    if name == "chunked_preempted":
        assert async_stats.num_preemptions > 0 and sync_stats.num_preemptions > 0
    assert async_stats.num_generated_tokens == sync_stats.num_generated_tokens


def test_shared_prefix_groups_same_outputs(model):
    rng = random.Random(3)
    prefix = [rng.randrange(3, VOCAB) for _ in range(48)]
    ps = [prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 20))]
          for _ in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    sync, _ = run(model, ps, params, False, num_kv_blocks=128)
    asyn, stats = run(model, ps, params, True, num_kv_blocks=128)
    assert asyn == sync
    assert stats.num_cached_prompt_tokens > 0


def _record_schedules(core):
    """Wraps the scheduler: every step's {request id: scheduled tokens}."""
    seen = []
    schedule = core.scheduler.schedule

    def wrapped():
        out = schedule()
        seen.append(dict(out.num_scheduled_tokens))
        return out
    core.scheduler.schedule = wrapped
    return seen


def test_no_step_is_spent_past_max_tokens_and_at_most_one_past_a_stop(model):
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64)
    core = llm.core
    seen = _record_schedules(core)
    ps = prompts(3, seed=4)
    core.add_request(core.make_request("len", ps[1], SamplingParams(max_tokens=5,
                                                                    temperature=0.0)))
    first = None
    while core.has_unfinished_requests():
        for out in core.step():
            first = out.new_token_ids[0] if first is None else first
    # A 90-token prompt in one step, then 4 decode steps: the 5th token ends it by length,
    # and the step planned while it was sampled does not run the request again.
    assert [s.get("len") for s in seen if "len" in s] == [90, 1, 1, 1, 1]

    # A stop token known only once sampled: the next step was already planned with the
    # request in it (one wasted row), and nothing after that.
    seen.clear()
    core.add_request(core.make_request("stop", ps[1], SamplingParams(
        max_tokens=50, temperature=0.0, stop_token_ids=[first])))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert [o.new_token_ids for o in outs] == [[first]] and outs[0].finish_reason == "stop"
    # (The prompt is mostly a prefix-cache hit now: its first step computes the rest.)
    assert [s.get("stop") for s in seen if "stop" in s] == [90 - 80, 1]
    assert core.kv.num_free_blocks == core.kv.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_steps_counted_are_those_that_ran(model, async_scheduling):
    """num_steps (llm_engine_steps_total, beside llm_engine_graph_steps_total) counts the steps
    that ran something; async scheduling's last call for a batch only collects the last step's
    tokens, and was counted as a step."""
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
              async_scheduling=async_scheduling)
    for _ in range(3):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0))
    # 3 requests, each a prompt step and 7 decode steps.
    assert llm.get_stats().num_steps == llm.core.times.steps == 24


def test_aborts_with_a_token_in_flight_free_everything_and_spare_the_rest(model):
    ps = prompts(8, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def staggered(async_scheduling, abort_at):
        llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64,
                  async_scheduling=async_scheduling)
        core = llm.core
        got: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        step = 0
        for i, p in enumerate(ps):
            core.add_request(core.make_request(str(i), p, params))
        while core.has_unfinished_requests():
            outs = core.step()
            step += 1
            if step in abort_at:      # a step for these was just launched and not collected
                outs += core.abort_requests(abort_at[step])
            for o in outs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
        assert core.kv.num_free_blocks == core.kv.num_blocks
        return got, reasons

    abort_at = {3: ["1", "5"], 6: ["2"]}
    got, reasons = staggered(True, abort_at)
    plain, plain_reasons = staggered(False, {})
    aborted = {rid for rids in abort_at.values() for rid in rids}
    assert {rid for rid, r in reasons.items() if r == "abort"} == aborted
    for rid in plain:
        if rid not in aborted:
            assert got[rid] == plain[rid] and reasons[rid] == plain_reasons[rid], rid
        else:                         # what came out before the abort is a prefix
            assert plain[rid][:len(got.get(rid, []))] == got.get(rid, []), rid


def test_a_request_preempted_while_its_token_was_sampled_keeps_it_and_may_finish():
    """The scheduler plans step 2 before step 1's tokens are known: B, whose token is still
    being sampled, is preempted to make room for A. B's token, when it comes, is appended
    (it is B's next token whatever happens to its KV); being a stop token it ends B from
    the waiting queue, and every block comes back."""
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request, RequestStatus
    from engine.scheduler import ModelRunnerOutput, Scheduler
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=3), eos_token_ids=[])
    b = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=3, stop_token_ids=[99]),
                eos_token_ids=[])
    sched.add_request(a)
    sched.add_request(b)
    step1 = sched.schedule()
    assert step1.num_scheduled_tokens == {"a": 4, "b": 4}
    assert a.num_output_placeholders == b.num_output_placeholders == 1
    step2 = sched.schedule()            # A's token 5 needs a block: B (the newest) goes
    assert step2.num_scheduled_tokens == {"a": 1} and b.status == RequestStatus.PREEMPTED
    assert "b" in step2.finished_request_ids and b.num_output_placeholders == 1
    outs = sched.update_from_output(step1, ModelRunnerOutput(["a", "b"], [10, 99]))
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [
        ("a", [10], None), ("b", [99], "stop")]
    assert b.output_token_ids == [99] and "b" not in sched.requests and not sched.waiting
    outs = sched.update_from_output(step2, ModelRunnerOutput(["a"], [11]))
    while sched.has_unfinished_requests():
        step = sched.schedule()
        outs += sched.update_from_output(step, ModelRunnerOutput(
            list(step.num_scheduled_tokens), [12] * len(step.num_scheduled_tokens)))
    assert a.output_token_ids == [10, 11, 12] and outs[-1].finish_reason == "length"
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_next_turn_finds_the_block_the_last_token_filled(model, async_scheduling):
    """A 15-token prompt and 2 outputs: the first output's KV fills block 0, in the request's
    last step. Async scheduling allocates that step's slots before the token is on the host and
    never schedules the request again, so only its end can register the block."""
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128,
              async_scheduling=async_scheduling, enable_prefix_groups=False)
    prompt = list(range(10, 25))
    [out] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    follow = prompt + out.outputs[0].token_ids + [7, 8, 9]
    [again] = llm.generate(follow, SamplingParams(max_tokens=1, temperature=0.0))
    assert again.num_cached_tokens == 16
    assert llm.core.kv.num_free_blocks == 64


@pytest.mark.parametrize("how", ["stop", "abort"])
def test_a_request_id_used_again_gets_only_its_own_tokens(model, how):
    """An id is free again once its request ends, but with async scheduling the step launched
    before that end still carries a row for it: its token must not go to a new request that
    took the id (it got the old one's token and lost its own last one)."""
    first, second = [5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45, 46]

    def run(async_scheduling):
        llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64,
                  async_scheduling=async_scheduling, enable_prefix_caching=False)
        core = llm.core
        if how == "stop":       # its first token stops it: known after the next step launched
            [out] = llm.generate([first], SamplingParams(max_tokens=1, temperature=0.0))
            core.add_request(core.make_request("x", first, SamplingParams(
                max_tokens=20, temperature=0.0, stop_token_ids=out.outputs[0].token_ids)))
            while "x" in core.scheduler.requests:
                core.step()
        else:
            core.add_request(core.make_request("x", first, SamplingParams(max_tokens=20, temperature=0.0)))
            core.step()
            core.step()
            core.abort_requests(["x"])          # a step for it is in flight (async)
        core.add_request(core.make_request("x", second, SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True)))
        tokens, reasons = [], []
        while core.has_unfinished_requests():
            for o in core.step():
                assert o.request_id == "x"
                tokens += o.new_token_ids
                reasons.append(o.finish_reason)
        assert core.kv.num_free_blocks == core.kv.num_blocks
        return tokens, reasons[-1]

    want = run(False)
    assert len(want[0]) == 4 and want[1] == "length"
    assert run(True) == want
