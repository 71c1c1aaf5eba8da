"""engine/penalty_rows.py: the penalties' per-request rows kept on the device, against the
sampler's list-based form, and the runner's use of them (no wait for the step in flight)."""
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.penalty_rows import SINK, PenaltyRows
from engine.sampler import SamplingMetadata, apply_penalties
from scripts.make_tiny_model import make_tiny_model

V = 50


def counts_of(ids):
    return torch.bincount(torch.tensor(ids, dtype=torch.int64), minlength=V).to(torch.int32)


def test_rows_count_outputs_mark_prompts_and_are_reused_zeroed():
    rows = PenaltyRows(V, "cpu", capacity=2)
    a = rows.add([1, 2, 2], [3, 3, 4])
    counts, seen, index = rows.rows_for([a])
    assert torch.equal(counts[0], counts_of([3, 3, 4]))
    assert seen[0].nonzero().flatten().tolist() == [1, 2]
    rows.record(index, torch.tensor([4]))
    assert torch.equal(rows.rows_for([a])[0][0], counts_of([3, 3, 4, 4]))
    # Past the capacity the pool grows and keeps every row it had.
    b, c = rows.add([7], []), rows.add([], [9])
    assert len({a, b, c, SINK}) == 4
    assert torch.equal(rows.rows_for([a])[0][0], counts_of([3, 3, 4, 4]))
    assert rows.rows_for([b])[1][0].nonzero().flatten().tolist() == [7]
    rows.remove(a)
    d = rows.add([], [])
    assert d == a and not rows.rows_for([d])[0].any() and not rows.rows_for([d])[1].any()


def test_record_counts_each_rows_own_token():
    rows = PenaltyRows(V, "cpu")
    ids = [rows.add([], []) for _ in range(3)]
    counts, _, index = rows.rows_for([ids[2], SINK, ids[0]])
    rows.record(index, torch.tensor([5, 6, 5]))
    rows.record(index, torch.tensor([5, 6, 7]))
    assert torch.equal(rows.rows_for([ids[2]])[0][0], counts_of([5, 5]))
    assert torch.equal(rows.rows_for([ids[0]])[0][0], counts_of([5, 7]))
    assert not rows.rows_for([ids[1]])[0].any()


@pytest.mark.parametrize("seed", range(4))
def test_penalties_from_rows_equal_penalties_from_lists(seed):
    """The same penalised logits, bitwise, whether the penalties read lists or rows; rows
    without penalties read the sink (which holds other rows' tokens) and come out unchanged."""
    rng = random.Random(seed)
    num_rows = 7
    logits = torch.randn(num_rows, V, generator=torch.Generator().manual_seed(seed)) * 3
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(0, 30))] for _ in range(num_rows)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 30))] for _ in range(num_rows)]
    params = []
    for i in range(num_rows):
        kind = rng.randrange(4)
        params.append(SamplingParams(
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]) if kind in (0, 3) else 1.0,
            presence_penalty=rng.choice([0.0, 0.5, -0.4]) if kind in (1, 3) else 0.0,
            frequency_penalty=rng.choice([0.0, 0.3, -0.2]) if kind in (1, 3) else 0.0))
    lists = SamplingMetadata.from_params(params, prompts, outputs, [], "cpu")
    want = apply_penalties(logits, lists)

    pool = PenaltyRows(V, "cpu", capacity=2)
    sink_index = pool.rows_for([SINK] * 3)[2]
    pool.record(sink_index, torch.tensor([1, 2, 1]))      # the sink holds tokens of no one row
    penalised = [p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params]
    row_of = [pool.add(prompts[i], outputs[i]) if penalised[i] else SINK for i in range(num_rows)]
    counts, seen, _ = pool.rows_for(row_of)
    from_rows = SamplingMetadata.from_params(params, [[]] * num_rows, None, [], "cpu",
                                             [len(o) for o in outputs], output_counts=counts, prompt_seen=seen)
    got = apply_penalties(logits, from_rows)
    assert torch.equal(got, want)
    for i in range(num_rows):
        if not penalised[i]:
            assert torch.equal(got[i], logits[i])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks CUDA host syncs: needs a GPU")
def test_on_cuda_the_rows_and_the_penalised_sampler_never_wait_for_the_gpu():
    """Under torch's sync debug mode ("error": a call that makes the host wait for the device
    raises), with the stream busy: adding rows (the pool growing), reading them, sampling with
    every penalty and recording the tokens."""
    from engine.sampler import Sampler
    vocab = 128256
    rows = PenaltyRows(vocab, "cuda", capacity=2)
    logits = torch.randn(4, vocab, device="cuda")
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.1),
              SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=0.9)]
    sampler = Sampler(seed=0)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)          # the stream stays busy while the host goes on
    torch.cuda.set_sync_debug_mode("error")
    try:
        a = rows.add(list(range(0, 3000, 3)), [5, 6, 6])
        b, c = rows.add([1], []), rows.add([2, 9], [3])        # past the capacity: the pool grows
        counts, seen, index = rows.rows_for([a, SINK, b, c])
        meta = SamplingMetadata.from_params(params, [[]] * 4, None, [], "cuda", [3, 0, 0, 1],
                                            output_counts=counts, prompt_seen=seen)
        out = sampler(logits, meta)
        rows.record(index, out.sampled_token_ids)
        rows.remove(b)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert int(rows.rows_for([a])[0].sum()) == 4 and int(rows.rows_for([c])[0].sum()) == 2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=3))


def test_penalties_leave_the_step_in_flight_alone_and_the_pool_whole(model):
    """With async scheduling a step with penalties launches while the one before is still in
    flight (launch never collects it), and gives the tokens of one step at a time. Every
    penalty row goes back to the pool when the runner hears its request ended (preempted ones
    included)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 40, 17, 90, 3, 64)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.4),
              SamplingParams(max_tokens=9, temperature=0.0),
              SamplingParams(max_tokens=15, temperature=0.9, seed=4, presence_penalty=0.6,
                             frequency_penalty=0.4),
              SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=1.0),
              SamplingParams(max_tokens=11, temperature=0.7, seed=2),
              SamplingParams(max_tokens=13, temperature=0.0, repetition_penalty=0.7, presence_penalty=0.2)]
    settings = dict(dtype="float32", device="cpu", num_kv_blocks=14, block_size=16,
                    max_num_batched_tokens=32, max_model_len=160)     # chunks and preemptions
    want = [o.outputs[0].token_ids
            for o in LLM(model, async_scheduling=False, **settings).generate(prompts, params)]

    llm = LLM(model, async_scheduling=True, **settings)
    runner = llm.core.runner
    launch, collect = runner.launch, runner.collect
    in_launch, collected_in_launch, overlapped = [False], [], []

    def spy_launch(sched):
        overlapped.append(runner._uncollected is not None)
        in_launch[0] = True
        try:
            return launch(sched)
        finally:
            in_launch[0] = False

    def spy_collect(handle):
        if in_launch[0]:
            collected_in_launch.append(handle)
        return collect(handle)
    runner.launch, runner.collect = spy_launch, spy_collect
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert any(overlapped), "no step launched with the one before in flight"
    assert collected_in_launch == []
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
    pool = runner.penalties
    held = [s.penalty_row for s in runner.requests.values() if s.penalty_row != SINK]
    assert sorted(pool.free + held) == list(range(1, pool.counts.shape[0]))
    # The runner hears of the last requests' end with the next step: then their rows go too.
    llm.generate([prompts[0]], params[1])
    assert sorted(pool.free) == list(range(1, pool.counts.shape[0]))
