"""Prefix groups and cascade attention through the whole engine, on tiny random models in float32
on CPU: the same greedy tokens with and without them, every prefix computed once, every block
back in the pool at the end."""
import random

import pytest

from engine import LLM, SamplingParams
from kernels.cascade_cost import CascadeCostRule
from scripts.greedy_checks import shared_prefix_workload
from scripts.make_tiny_model import make_tiny_model

ARCHS = ["llama", "qwen2", "mistral"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=1)) for arch in ARCHS}


def force_cascade(llm):
    """Every shared block worth a group: the tiny model's bytes never reach the real thresholds."""
    runner = llm.core.runner
    runner.cascade.rule = CascadeCostRule(runner.cascade.num_q_heads, runner.cascade.num_kv_heads,
                                          runner.cascade.head_dim, kv_dtype_bytes=4,
                                          min_prefix_len=0, min_saved_bytes=0, per_group_bytes=0)
    return llm


def generate(model, prompts, groups, cascade, caching=True, **settings):
    llm = LLM(model, dtype="float32", device="cpu", enable_prefix_caching=caching,
              enable_prefix_groups=groups, enable_cascade_attention=cascade, **settings)
    if cascade:
        force_cascade(llm)
    outs = llm.generate(prompts, GREEDY)
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "blocks left held after generate"
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.mark.parametrize("arch", ARCHS)
def test_same_tokens_with_groups_and_cascade_chunked_and_preempted(tiny_models, arch):
    prompts = shared_prefix_workload(seed=ARCHS.index(arch))
    # 40 blocks of 16 for 24 prompts of up to 260 tokens; 64-token steps: prompts go in chunks
    # and requests are preempted (and pinned prefixes released) along the way.
    settings = dict(block_size=16, max_num_batched_tokens=64, num_kv_blocks=40,
                    max_model_len=320, max_num_seqs=12)
    plain, plain_stats = generate(tiny_models[arch], prompts, groups=False, cascade=False,
                                  caching=False, **settings)
    grouped, stats = generate(tiny_models[arch], prompts, groups=True, cascade=True, **settings)
    assert stats.num_preemptions > 0 and plain_stats.num_preemptions > 0
    assert stats.num_steps > stats.num_computed_prompt_tokens // 64      # prompts in chunks
    assert stats.num_cascade_rows > 0
    assert grouped == plain


def test_cascade_alone_finds_shared_blocks_and_keeps_the_tokens(tiny_models):
    """Without groups (as served traffic) prefix caching gives equal prefixes the same blocks;
    the runner groups rows by them."""
    prompts = shared_prefix_workload(seed=7)
    plain, _ = generate(tiny_models["llama"], prompts, groups=False, cascade=False,
                        num_kv_blocks=256)
    cascaded, stats = generate(tiny_models["llama"], prompts, groups=False, cascade=True,
                               num_kv_blocks=256)
    assert stats.num_cascade_rows > 0
    assert cascaded == plain


def test_decode_graph_path_with_cascade_equals_eager(tiny_models):
    """On CPU the CUDA-graph path runs its padded buffers eagerly: cascade decode steps through
    them (capacity padding, empty groups, padding rows) give what the eager path gives."""
    prompts = shared_prefix_workload(seed=3)
    eager, _ = generate(tiny_models["qwen2"], prompts, groups=True, cascade=True,
                        num_kv_blocks=256, enforce_eager=True)
    llm = force_cascade(LLM(tiny_models["qwen2"], dtype="float32", device="cpu",
                            num_kv_blocks=256, max_num_seqs=20))
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.core.runner.decode_graphs.num_cascade_runs > 0
    assert graphed == eager


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_pinned_prefix_never_keeps_a_long_member_going_round(tiny_models, async_scheduling):
    """Prefix caching off, the least pool (max_model_len), prompts longer than a step: a member of
    one group needs more blocks than the other group's pin leaves. The engine once preempted and
    readmitted it chunk by chunk forever (tests/test_scheduler_groups.py has the scheduler's
    side); now the pins go, and the tokens are those without groups."""
    p1, p2 = [11] * 8, [12] * 8
    prompts = [p1 + [13] * 14, p1 + [14] * 7, p2 + [15] * 14, p2 + [16] * 14]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 3, 1, 2)]
    outputs = {}
    for groups in (False, True):
        llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=6,
                  block_size=4, max_model_len=24, max_num_batched_tokens=8, max_num_seqs=3,
                  enable_prefix_caching=False, enable_prefix_groups=groups,
                  async_scheduling=async_scheduling)
        step, steps = llm.core.step, []

        def counted(step=step, steps=steps):
            steps.append(1)
            assert len(steps) <= 500, f"no end after 500 steps, groups={groups}"
            return step()
        llm.core.step = counted
        outputs[groups] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert [len(t) for t in outputs[True]] == [1, 3, 1, 2]
    assert outputs[True] == outputs[False]


def test_shuffled_order_computes_each_prefix_once(tiny_models):
    """Prefix caching alone, in shuffled order with a small pool, evicts prefixes between the
    members of a group and computes them again; groups compute each one once."""
    rng = random.Random(11)
    prefixes = [[rng.randrange(3, 1000) for _ in range(96)] for _ in range(4)]
    prompts = [p + [rng.randrange(3, 1000) for _ in range(rng.randint(4, 20))]
               for p in prefixes for _ in range(6)]
    rng.shuffle(prompts)
    settings = dict(num_kv_blocks=20, max_num_seqs=2, max_model_len=160)
    _, apc = generate(tiny_models["llama"], prompts, groups=False, cascade=False, **settings)
    tokens, grouped = generate(tiny_models["llama"], prompts, groups=True, cascade=False,
                               **settings)
    minimum = 4 * 96 + sum(len(p) - 96 for p in prompts)
    assert grouped.num_computed_prompt_tokens == minimum
    assert apc.num_computed_prompt_tokens > minimum + 96, "the pool was meant to evict prefixes"


def test_sliding_window_models_keep_the_plain_kernel(tmp_path):
    model = str(make_tiny_model(tmp_path / "m", arch="mistral", seed=2, sliding_window=32))
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64)
    assert not llm.core.runner.cascade.enabled


@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
@pytest.mark.parametrize("chunk,chunks_alone", [(None, False), (24, False), (24, True)])
def test_triton_kernels_interpreted_same_tokens(tiny_models, chunk, chunks_alone, monkeypatch):
    """The engine with the Triton kernels (TRITON_INTERPRET=1 on CPU): cascade vs the plain
    paged-attention kernel, a small shared-prefix workload with groups and lone rows. chunk: a
    small token budget, so that prompt chunks run beside decode rows: the cascade own pass then
    runs the decode rows apart from the chunks (own_decode_seqs / own_prompt_seqs).
    chunks_alone: prefix tiles of two rows (the GPU's hold 32), so that prompt chunks stay out
    of groups and their launch runs without the partials' fold (prompt_prefixes=False); on CPU
    the rule counts one prefix read a group, and chunks join groups."""
    from engine.models.attention import triton_backend
    from tests.kernel_support import load_kernels, require_runnable
    ca = load_kernels("kernels.cascade_attention")
    require_runnable(ca)
    apart = []
    kernel = ca.cascade_attention

    folds = []

    def counted(*args, own_decode_seqs=None, own_prompt_seqs=None, prompt_prefixes=True, **kwargs):
        apart.append(own_decode_seqs is not None)
        if own_decode_seqs is not None:
            folds.append(prompt_prefixes)
        return kernel(*args, own_decode_seqs=own_decode_seqs, own_prompt_seqs=own_prompt_seqs,
                      prompt_prefixes=prompt_prefixes, **kwargs)
    monkeypatch.setattr(ca, "cascade_attention", counted)
    rng = random.Random(5)
    prefix = [rng.randrange(3, 1000) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 9))]
               for _ in range(3)] + [[rng.randrange(3, 1000) for _ in range(12)]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    budget = {} if chunk is None else {"max_num_batched_tokens": chunk}
    results = []
    for cascade in (False, True):
        llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64,
                  enable_cascade_attention=cascade, enforce_eager=True, **budget)
        backend = triton_backend()
        for layer in llm.core.runner.model.layers:
            layer.self_attn.attn.backend = backend
        if cascade:
            force_cascade(llm)
            if chunks_alone:
                monkeypatch.setattr(llm.core.runner.cascade, "_rows_per_tile", lambda rows: 2)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert (llm.get_stats().num_cascade_rows > 0) == cascade
    assert results[0] == results[1]
    assert any(apart) == (chunk is not None), apart
    # Launches apart: with the fold where a chunk is in a group, without where none is.
    assert (False in folds) == chunks_alone, folds
    assert (True in folds) == (chunk is not None and not chunks_alone), folds


def test_cpu_default_settings_group_shared_prefixes(tiny_models):
    """On CPU the H200-fitted rule is replaced by 'any shared block': with default settings,
    shared prefixes run through cascade and the tokens do not change."""
    prompts = shared_prefix_workload(seed=9)
    plain, _ = generate(tiny_models["llama"], prompts, groups=False, cascade=False,
                        num_kv_blocks=256)
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=256)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.get_stats().num_cascade_rows > 0
    assert got == plain


def test_served_path_counts_cascade_rows_across_the_process_boundary(tiny_models):
    """AsyncEngine (the core in its own process, no prefix groups: requests arrive one by one):
    concurrent requests sharing a prefix are grouped by their blocks, the count reaches the
    front end's stats, and the tokens are the plain engine's."""
    import asyncio

    from engine import AsyncEngine
    rng = random.Random(12)
    prefix = [rng.randrange(3, 1000) for _ in range(80)]
    prompts = [prefix + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 12))]
               for _ in range(6)]
    plain, _ = generate(tiny_models["llama"], prompts, groups=False, cascade=False,
                        num_kv_blocks=128)
    engine = AsyncEngine(model=tiny_models["llama"], dtype="float32", device="cpu",
                         num_kv_blocks=128)

    async def one(i, p):
        return [t async for o in engine.generate(p, GREEDY, f"s{i}") for t in o.outputs[0].token_ids]

    async def main():
        first = await one(0, prompts[0])          # its blocks are cached for the others
        rest = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts[1:], 1)))
        return [first] + rest, await engine.stats()

    try:
        got, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert stats.num_cascade_rows > 0
    assert got == plain


def test_each_output_says_how_much_of_its_prompt_the_cache_held(tiny_models):
    """RequestOutput.num_cached_tokens, with groups: each group's first request computes the
    prefix (none cached), the others find its whole blocks cached, preemptions along the way
    change nothing; with prefix caching alone the counts are whatever the cache held. Either
    way they add up to the engine's count."""
    rng = random.Random(13)
    prefixes = [[rng.randrange(3, 1000) for _ in range(96)] for _ in range(4)]
    prompts = [p + [rng.randrange(3, 1000) for _ in range(rng.randint(4, 20))]
               for p in prefixes for _ in range(6)]
    rng.shuffle(prompts)
    for groups in (True, False):
        llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=24,
                  max_num_seqs=8, max_model_len=160, max_num_batched_tokens=64,
                  enable_prefix_groups=groups)
        outs = llm.generate(prompts, GREEDY)
        stats = llm.get_stats()
        cached = [o.num_cached_tokens for o in outs]
        assert sum(cached) == stats.num_cached_prompt_tokens > 0
        if groups:
            assert stats.num_preemptions > 0
            by_prefix: dict[tuple, list[int]] = {}
            for p, c in zip(prompts, cached):
                by_prefix.setdefault(tuple(p[:96]), []).append(c)
            assert sorted(map(sorted, by_prefix.values())) == [[0] + [96] * 5] * 4
