"""The engine against HF transformers, end to end, on tiny random models in float32 on CPU."""
import gc
import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from scripts.make_tiny_model import make_tiny_model

ARCHS = ["llama", "qwen2", "mistral"]
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=1)) for arch in ARCHS}


def staggered_tokens(core, prompts, params) -> list[list[int]]:
    """Runs the prompts on an EngineCore one new request per step (later prompts' chunks
    share steps with earlier requests' decode rows); each request's generated ids."""
    got: dict[str, list[int]] = {}

    def step():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(core.make_request(str(i), p, sp))
        step()
    while core.has_unfinished_requests():
        step()
    return [got[str(i)] for i in range(len(prompts))]


def mixed_prompts(vocab_size, n=16, seed=0):
    """Lengths from 1 to 300 tokens, random ids (specials excluded)."""
    rng = random.Random(seed)
    lengths = [1, 300, 2, 17, 64, 255, 5, 128, 33, 200, 9, 96, 150, 3, 47, 280][:n]
    return [[rng.randrange(3, vocab_size) for _ in range(n_tok)] for n_tok in lengths]


def hf_greedy(model_dir, prompts, max_tokens=MAX_TOKENS):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="session")
def hf_outputs(tiny_models):
    cache = {}

    def get(arch):
        if arch not in cache:
            llm_vocab = json.load(open(f"{tiny_models[arch]}/config.json"))["vocab_size"]
            prompts = mixed_prompts(llm_vocab)
            cache[arch] = (prompts, hf_greedy(tiny_models[arch], prompts))
        return cache[arch]
    return get


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(tiny_models, hf_outputs, arch):
    prompts, expected = hf_outputs(arch)
    llm = LLM(tiny_models[arch], dtype="float32", device="cpu", num_kv_blocks=512)
    outs = llm.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) differs"
    assert [o.prompt_token_ids for o in outs] == prompts
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_chunked_prefill_and_preemption(tiny_models, hf_outputs, arch):
    prompts, expected = hf_outputs(arch)
    # 30 blocks of 16 = 480 tokens for 16 requests of up to 332 tokens: preemption is forced.
    llm = LLM(tiny_models[arch], dtype="float32", device="cpu", block_size=16,
              max_num_batched_tokens=64, num_kv_blocks=30, max_model_len=400)
    outs = llm.generate(prompts, GREEDY)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small for all requests"
    assert stats.num_steps > sum(len(p) for p in prompts) // 64   # prompts went in chunks
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} (len {len(prompts[i])}) differs"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_greedy_matches_hf_with_guaranteed_no_evict_in_a_small_pool(tiny_models, hf_outputs):
    """The pool of the test above: requests wait for room to finish instead of being
    preempted; the same tokens."""
    prompts, expected = hf_outputs("llama")
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", block_size=16,
              max_num_batched_tokens=64, num_kv_blocks=30, max_model_len=400,
              capacity_scheduler_policy="guaranteed_no_evict")
    outs = llm.generate(prompts, GREEDY)
    stats = llm.get_stats()
    assert stats.num_preemptions == 0
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} (len {len(prompts[i])}) differs"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_allowed_token_ids_and_logit_bias_match_hf_in_a_mixed_batch(tiny_models, hf_outputs):
    """vLLM's token controls against HF's own processors on the same prompts: allowed_token_ids
    as `prefix_allowed_tokens_fn`, logit_bias as `sequence_bias` on one-token sequences. Rows
    with controls share the batch (chunked prefill, preemption) with rows without, which give
    what they give alone; the pool ends whole."""
    prompts, plain = hf_outputs("llama")
    vocab = json.load(open(f"{tiny_models['llama']}/config.json"))["vocab_size"]
    rng = random.Random(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    params, expected = [], []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        kwargs = {}
        if i % 3 == 0:
            allowed = rng.sample(range(vocab), 12)
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                         allowed_token_ids=allowed))
            kwargs["prefix_allowed_tokens_fn"] = lambda batch_id, ids, allowed=allowed: allowed
        elif i % 3 == 1:
            # Pushes toward the tokens plain greedy would not take at once, and away from the one it does.
            bias = {t: rng.choice([4.0, 8.0]) for t in rng.sample(range(vocab), 6)}
            bias[plain[i][0]] = -100.0
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=bias))
            kwargs["sequence_bias"] = {(t,): b for t, b in bias.items()}
        else:
            params.append(GREEDY)
            expected.append(plain[i])
            continue
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=0, **kwargs)
        expected.append(gen[0, len(p):].tolist())
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", block_size=16,
              max_num_batched_tokens=64, num_kv_blocks=30, max_model_len=400)
    outs = llm.generate(prompts, params)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({'allowed' if i % 3 == 0 else 'bias' if i % 3 == 1 else 'plain'}) differs"
    for i in range(0, len(prompts), 3):
        assert set(got[i]) <= set(params[i].allowed_token_ids)
    for i in range(1, len(prompts), 3):
        assert got[i] != plain[i] and got[i][0] != plain[i][0]
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_token_controls_out_of_the_vocabulary_are_refused_naming_them(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64)
    vocab = json.load(open(f"{tiny_models['llama']}/config.json"))["vocab_size"]
    for params, name in ((SamplingParams(logit_bias={vocab: 1.0}), "logit_bias keys"),
                         (SamplingParams(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=rf"{name} must be in \[0, {vocab}\)"):
            llm.generate([[1, 2, 3]], params)
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


class _OutputBadWords:
    """HF logits processor, the reference for bad_words: vLLM's rule on the generated tokens
    (a word's last token is banned where the output ends in its other tokens; HF's own
    `bad_words_ids` matches the prompt too)."""

    def __init__(self, words, prompt_len):
        self.words, self.prompt_len = words, prompt_len

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len:].tolist()
        for w in self.words:
            if len(w) - 1 <= len(out) and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1]):
                scores[0, w[-1]] = float("-inf")
        return scores


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_match_the_reference_with_the_next_token_in_flight(tiny_models, hf_outputs,
                                                                     async_scheduling):
    """Bad words of 1 to 3 tokens taken from what plain greedy says, so that they bite: with
    async scheduling a word's next-to-last token is still in flight when its last one would be
    sampled (the ban is decided on the device). In a batch with plain rows, chunked prefill and
    preemption; the pool ends whole."""
    from transformers import LogitsProcessorList
    prompts, plain = hf_outputs("llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    params, expected = [], []
    for i, (p, g) in enumerate(zip(prompts, plain)):
        if i % 2:
            params.append(GREEDY)
            expected.append(g)
            continue
        words = [[g[2]], [g[5], g[6]], [g[9], g[10], g[11]], [g[20], g[21]]]
        params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                     bad_words_token_ids=words))
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=0,
                                 logits_processor=LogitsProcessorList([_OutputBadWords(words, len(p))]))
        expected.append(gen[0, len(p):].tolist())
        assert expected[-1] != g
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", block_size=16,
              max_num_batched_tokens=64, num_kv_blocks=30, max_model_len=400,
              async_scheduling=async_scheduling)
    outs = llm.generate(prompts, params)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} differs"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does(tiny_models):
    """Each word, leading spaces dropped, as the tokenizer spells it alone, and after a space
    where that starts with another token and takes as many. A word given as text is never
    sampled in that spelling."""
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64)
    tok = llm.get_tokenizer()
    words = ["the", "  of", "machine learning", "☃"]
    params = SamplingParams(bad_words=words)
    params.tokenize_bad_words(tok)
    want = []
    for w in words:
        alone = tok.encode(w.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        want.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            want.append(spaced)
    assert params.bad_words_token_ids == want
    assert len(want) > len(words)          # some word is also banned after a space
    # Generated: a token plain greedy says, given as text whose spellings include that token
    # alone, is never sampled, and no word's spelling appears in the output.
    prompt = "Once upon a time"
    plain = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    for t in plain:
        check = SamplingParams(bad_words=[tok.decode([t])])
        check.tokenize_bad_words(tok)
        if [t] in check.bad_words_token_ids:
            break
    else:
        pytest.fail("no token of the plain output is a bad word's spelling on its own")
    banned = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, bad_words=check.bad_words)
    out = llm.generate(prompt, banned)[0].outputs[0].token_ids
    assert t not in out and out != plain
    for w in check.bad_words_token_ids:
        assert not any(out[k:k + len(w)] == w for k in range(len(out))), w
    with pytest.raises(ValueError, match="bad_words needs the tokenizer"):
        SamplingParams(bad_words=["x"]).tokenize_bad_words(None)


WINDOW = 40


def cap_steps(llm, limit: int) -> None:
    """A step of llm.core past `limit` fails the test (an engine going round without
    finishing would otherwise hang it)."""
    real_step, steps = llm.core.step, [0]

    def step():
        steps[0] += 1
        assert steps[0] <= limit, f"no end after {limit} steps"
        return real_step()
    llm.core.step = step


def track_peak_blocks(llm) -> list[int]:
    """[the most blocks any running request has held after a step], kept up to date as
    llm.core steps (blocks given back behind a sliding window not counted)."""
    real_step, peak = llm.core.step, [0]

    def step():
        out = real_step()
        for r in llm.core.scheduler.running:
            held = sum(b is not None for b in llm.core.kv.block_ids(r.request_id))
            peak[0] = max(peak[0], held)
        return out
    llm.core.step = step
    return peak


@pytest.fixture(scope="session")
def windowed_mistral(tmp_path_factory):
    """A Mistral 7B v0.1-shaped tiny model (every layer windowed), its prompts, HF's tokens."""
    model = str(make_tiny_model(tmp_path_factory.mktemp("windowed"), arch="mistral", seed=3,
                                sliding_window=WINDOW))
    prompts = mixed_prompts(json.load(open(f"{model}/config.json"))["vocab_size"])
    return model, prompts, hf_greedy(model, prompts)


@pytest.mark.parametrize("caching,async_scheduling", [(True, False), (False, False),
                                                      (True, True)])
def test_a_sliding_window_model_gives_back_blocks_behind_the_window_with_hfs_tokens(
        windowed_mistral, caching, async_scheduling):
    """Blocks wholly behind every layer's window go back to the pool as the window moves on
    (64-token chunks, blocks of 8, a pool of 48 for 16 prompts of up to 300 tokens): HF's
    tokens, no request holding more than its window and a chunk span, and fewer preemptions
    than when the engine keeps every block."""
    model, prompts, expected = windowed_mistral
    preemptions = {}
    for give_back in (True, False):
        llm = LLM(model, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=64,
                  num_kv_blocks=48, max_model_len=384, enable_prefix_caching=caching,
                  async_scheduling=async_scheduling)
        assert llm.core.kv.sliding_window == WINDOW
        if not give_back:
            llm.core.kv.sliding_window = None
        peak = track_peak_blocks(llm)
        outs = llm.generate(prompts, GREEDY)
        for i, (o, e) in enumerate(zip(outs, expected)):
            assert o.outputs[0].token_ids == e, f"give back {give_back}: prompt {i} differs"
        stats = llm.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        preemptions[give_back] = stats.num_preemptions
        if give_back:
            assert peak[0] <= -(-(WINDOW - 1 + 64) // 8) + 3, peak[0]
        else:
            assert peak[0] > 30
    assert preemptions[True] < preemptions[False], preemptions


def prompts_on_two_prefixes(model, seed, num):
    """`num` prompts, each one of two random 120-token prefixes and 1-30 tokens of its own."""
    rng = random.Random(seed)
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    prefixes = [[rng.randrange(3, vocab) for _ in range(120)] for _ in range(2)]
    return [rng.choice(prefixes) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
            for _ in range(num)]


@pytest.mark.parametrize("groups", [False, True])
def test_a_sliding_window_model_sharing_prefixes_in_a_small_pool_gives_hfs_tokens(
        windowed_mistral, groups):
    """Prompts on two 120-token prefixes, three seats, a pool that evicts: prefix-cache hits
    that skip blocks behind the window (groups off), or pinned prefixes (groups on)."""
    model = windowed_mistral[0]
    prompts = prompts_on_two_prefixes(model, seed=7, num=10)
    expected = hf_greedy(model, prompts)
    llm = LLM(model, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=64,
              num_kv_blocks=48, max_model_len=384, max_num_seqs=3, enable_prefix_groups=groups)
    outs = llm.generate(prompts, GREEDY)
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} differs"
    stats = llm.get_stats()
    assert stats.num_cached_prompt_tokens > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


@pytest.mark.parametrize("caching,async_scheduling", [(True, True), (False, False)])
def test_a_sliding_window_model_runs_in_a_pool_of_its_window_and_a_step(
        windowed_mistral, caching, async_scheduling):
    """A pool of 15 blocks of 8 (the window's 39 keys and a 64-token step, a block of
    alignment each side) for a max_model_len of 384 (48 blocks): as vLLM sizes a windowed
    model, it starts, and every prompt, up to 300 tokens, runs to HF's tokens; one block
    fewer is refused naming what it must hold."""
    model, prompts, expected = windowed_mistral
    settings = dict(dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=64,
                    max_model_len=384, enable_prefix_caching=caching,
                    async_scheduling=async_scheduling)
    llm = LLM(model, num_kv_blocks=15, **settings)
    cap_steps(llm, 3000)                         # ~200-300 steps needed
    outs = llm.generate(prompts, GREEDY)
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} (len {len(prompts[i])}) differs"
    stats = llm.get_stats()
    assert stats.num_preemptions > 0, "the pool was meant to hold about one request"
    assert stats.num_free_kv_blocks == stats.num_kv_blocks == 15
    with pytest.raises(ValueError, match=r"cannot hold one sequence's sliding window \(40 "
                                         r"tokens\) and a step's max_num_batched_tokens=64 "
                                         r"\(15 blocks\): raise num_kv_blocks"):
        LLM(model, num_kv_blocks=14, **settings)


def test_guaranteed_no_evict_still_needs_a_whole_sequence_of_a_windowed_model(windowed_mistral):
    """guaranteed_no_evict admits a request only when its whole final length fits: a pool
    smaller than that would never admit a long one, so it is refused at start-up."""
    with pytest.raises(ValueError, match=r"cannot hold one sequence of max_model_len=384 "
                                         r"\(48 blocks\)"):
        LLM(windowed_mistral[0], dtype="float32", device="cpu", block_size=8,
            max_num_batched_tokens=64, max_model_len=384, num_kv_blocks=47,
            capacity_scheduler_policy="guaranteed_no_evict")


def test_a_windowed_group_in_a_pool_of_its_window_and_a_step_gives_hfs_tokens(windowed_mistral):
    """Prompts on two 120-token prefixes (longer than the window) in the smallest pool: each
    group's leader gives back its prefix's blocks behind its window as it goes, and the pin
    holds the rest: HF's tokens, the pool whole."""
    model = windowed_mistral[0]
    prompts = prompts_on_two_prefixes(model, seed=8, num=8)
    expected = hf_greedy(model, prompts)
    llm = LLM(model, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=64,
              num_kv_blocks=15, max_model_len=384)
    cap_steps(llm, 3000)                         # ~200-300 steps needed
    outs = llm.generate(prompts, GREEDY)
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} differs"
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_a_windowed_group_whose_leader_prompt_was_run_before_gives_the_same_tokens(
        windowed_mistral):
    """(Found by review.) The same long prompt run twice, the second time as a group's leader
    with three members on its 64-token prefix: the leader's hit stops at the prefix, so the
    pin holds the blocks the members' windows read (their tokens differed before)."""
    model = windowed_mistral[0]
    rng = random.Random(5)
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    prefix = [rng.randrange(3, vocab) for _ in range(64)]
    long_prompt = prefix + [rng.randrange(3, vocab) for _ in range(100)]
    members = [prefix + [rng.randrange(3, vocab) for _ in range(3 + i)] for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    settings = dict(dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=64,
                    max_model_len=384, num_kv_blocks=60)
    plain = LLM(model, enable_prefix_caching=False, enable_prefix_groups=False, **settings)
    want = [o.outputs[0].token_ids for o in plain.generate([long_prompt] + members, params)]
    llm = LLM(model, **settings)
    llm.generate([long_prompt], params)
    got = [o.outputs[0].token_ids for o in llm.generate([long_prompt] + members, params)]
    assert got == want
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_only_a_model_windowed_in_every_layer_gives_back_blocks(tmp_path):
    """Qwen2 with its window in some layers only: the others read every key, so every block is
    kept."""
    model = make_tiny_model(tmp_path / "q", arch="qwen2", seed=3, use_sliding_window=True,
                            sliding_window=16, max_window_layers=1)
    llm = LLM(str(model), dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.core.runner.model_config.sliding_window_layers != ()
    assert llm.core.kv.sliding_window is None


def test_greedy_matches_hf_with_prompts_held_for_fuller_steps(tiny_models, hf_outputs):
    """prefill_hold_steps: prompts that come in one a step while others decode wait for more
    prompts or their steps; the same tokens as HF, in more steps than without holding."""
    prompts, expected = hf_outputs("llama")
    steps = {}
    for hold in (0, 3):
        llm = LLM(tiny_models["llama"], dtype="float32", device="cpu",
                  max_num_batched_tokens=512, prefill_hold_steps=hold)
        got = staggered_tokens(llm.core, prompts, [GREEDY] * len(prompts))
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"hold {hold}: prompt {i} (len {len(prompts[i])}) differs"
        stats = llm.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        steps[hold] = stats.num_steps
    assert steps[3] > steps[0]                  # the prompts did wait


def test_prefix_caching_skips_shared_prefix_with_identical_output(tiny_models):
    model = tiny_models["llama"]
    rng = random.Random(5)
    prefix = [rng.randrange(3, 1000) for _ in range(200)]
    first = [prefix + [rng.randrange(3, 1000) for _ in range(10)] for _ in range(2)]
    second = [prefix + [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))]
              for _ in range(8)]

    def run(caching):
        # Prefix groups would share the prefix within one call even without the cache.
        llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=256,
                  enable_prefix_caching=caching, enable_prefix_groups=caching)
        llm.generate(first, GREEDY)
        before = llm.get_stats().num_computed_prompt_tokens
        outs = llm.generate(second, GREEDY)
        stats = llm.get_stats()
        return [o.outputs[0].token_ids for o in outs], \
            stats.num_computed_prompt_tokens - before, stats

    with_cache, computed_cached, stats = run(True)
    without_cache, computed_plain, _ = run(False)
    assert with_cache == without_cache
    assert computed_plain == sum(len(p) for p in second)
    # 12 of the 200 shared tokens' blocks (192 tokens) come from the cache for each request.
    assert computed_cached == computed_plain - 8 * 192
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_text_and_token_prompts_agree(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=128)
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.tokenizer.encode(text)
    a, b = llm.generate([text, ids], GREEDY)
    assert a.prompt_token_ids == ids and a.prompt == text and b.prompt is None
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids,
                                                     skip_special_tokens=True)
    # One prompt of NumPy ids, as a list or an array, and a 2-D array as a batch.
    import numpy as np
    for one in ([np.int64(t) for t in ids], np.array(ids)):
        (c,) = llm.generate(one, GREEDY)
        assert c.prompt_token_ids == ids and c.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(llm.generate(np.array([ids, ids]), GREEDY)) == 2


def test_vllm_prompt_dicts_and_call_forms(tiny_models):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, are the prompts they hold (a
    lone dict used to be read as a list of its keys), and vLLM's generate() keywords work."""
    import numpy as np
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=128)
    text = "The quick brown fox jumps over the lazy dog."
    ids = llm.tokenizer.encode(text)
    (want,) = llm.generate(text, GREEDY)
    forms = [{"prompt": text}, {"prompt": text, "multi_modal_data": None},
             {"prompt_token_ids": ids}, {"prompt_token_ids": np.array(ids)}]
    for form in forms:
        (got,) = llm.generate(form, GREEDY, use_tqdm=False)
        assert got.prompt_token_ids == ids and got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.prompt == (text if "prompt" in form else None)
    outs = llm.generate(forms, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [want.outputs[0].token_ids] * len(forms)
    # vLLM's shapes: RequestOutput.finished an attribute, CompletionOutput.finished() a method.
    assert want.finished is True and want.outputs[0].finished() is True
    with pytest.raises(ValueError, match=r"\['multi_modal_data'\] are not supported"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": 1}}, GREEDY)
    with pytest.raises(ValueError, match="must hold one of"):
        llm.generate({}, GREEDY)
    # Each key holds what it names: text was silently tokenized as token ids' stand-in and
    # ids taken as text's.
    with pytest.raises(ValueError, match="prompt_token_ids must be token ids"):
        llm.generate({"prompt_token_ids": text}, GREEDY)
    with pytest.raises(ValueError, match="prompt must be text, got list"):
        llm.generate({"prompt": ids}, GREEDY)
    # Settings as a dict (not SamplingParams(**settings)) failed on `.n` of its keys, or
    # counted them against the prompts.
    for prompts, bad in ((text, {"max_tokens": 2}), ([text, text], {"a": 1, "b": 2}),
                         ([text], [{"max_tokens": 2}]), ([text], "abc")):
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a "
                                            "list of them"):
            llm.generate(prompts, bad)
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(text, GREEDY, lora_request=object())
    assert llm.get_tokenizer() is llm.tokenizer


def test_n_completions_are_the_seeded_requests_and_share_the_prompts_blocks(tiny_models):
    """vLLM's parallel sampling: outputs[k] is what the prompt gives alone with seed + k; the
    completions share the prompt's KV blocks (computed once, in a group); the pool ends whole."""
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=256)
    prompt = list(range(3, 67))                 # 64 tokens: four whole blocks to share
    sampled = SamplingParams(n=4, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    before = llm.get_stats()
    out, greedy = llm.generate([prompt, "Hello"], [sampled, SamplingParams(
        n=2, temperature=0.0, max_tokens=8, ignore_eos=True)])
    stats = llm.get_stats()
    assert out.request_id != greedy.request_id and out.prompt_token_ids == prompt
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    alone = [llm.generate(prompt, sampled.child(k))[0].outputs[0] for k in range(4)]
    assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert [c.text for c in out.outputs] == [a.text for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1     # seeds 11..14 differ here
    assert [c.token_ids for c in greedy.outputs] == [greedy.outputs[0].token_ids] * 2
    # The 64 shared tokens are computed once for the four (the rest of each prompt is its own).
    computed = stats.num_computed_prompt_tokens - before.num_computed_prompt_tokens
    assert computed <= len(prompt) + 4 * 16, computed     # a block of its own each at most
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    # Seed -2, n 3: the completion whose seed + k is -1 ("no seed") is seeded all the same
    # (found by review: it came out differently in each call, served or not).
    minus = SamplingParams(n=3, seed=-2, temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = [[c.token_ids for c in llm.generate(prompt, minus)[0].outputs] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2] and len({tuple(c) for c in runs[0]}) == 3


def test_generate_without_sampling_params_takes_the_generation_config(tiny_models, tmp_path):
    """As vLLM (generation_config "auto"): the checkpoint's generation_config.json sampling
    fields are the defaults of a generate() given no SamplingParams."""
    model = tmp_path / "m"
    shutil.copytree(tiny_models["llama"], model)
    prompts = ["The quick brown fox", "Once upon a time"]
    llm = LLM(str(model), dtype="float32", device="cpu", num_kv_blocks=128)
    assert llm.get_default_sampling_params() == SamplingParams()
    gen = json.loads((model / "generation_config.json").read_text())
    gen.update({"do_sample": True, "temperature": 0.7, "top_k": 1, "max_new_tokens": 5})
    (model / "generation_config.json").write_text(json.dumps(gen))
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.7, top_k=1,
                                                               max_tokens=5)
    # top_k 1 at any temperature is greedy: the same 5 tokens every time.
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))
    for _ in range(2):
        outs = llm.generate(prompts)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]
    gen["top_p"] = 2.0
    (model / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        llm.generate(prompts)


def test_prompt_longer_than_max_model_len_is_rejected(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64,
              max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 65], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**7]], GREEDY)
    for too_big in (2**63, -2**63 - 1):       # past int64: the check on the list names them
        with pytest.raises(ValueError, match="token ids"):
            llm.generate([[5, too_big]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="not valid text: surrogates not allowed at character 3"):
        llm.generate(["ok \ud800"], GREEDY)                # a lone surrogate: no text
    # The engine still works afterwards, and the collector paused for the intake is back on.
    assert gc.isenabled()
    assert llm.generate([[5] * 10], GREEDY)[0].outputs[0].finish_reason in ("length", "stop")


def test_token_array_is_the_ids_in_int64_or_none_past_it():
    import numpy as np

    from engine.llm import token_array
    got = token_array([5, 0, 128_255, -1])
    assert got.dtype == np.int64 and got.tolist() == [5, 0, 128_255, -1]
    assert token_array([]).tolist() == []
    assert token_array([1, 2**63]) is None and token_array([-2**63 - 1]) is None


def test_gc_paused_restores_the_collector_as_it_found_it():
    from engine.llm import gc_paused
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("a bad prompt")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()      # off before, off after: the caller's choice kept
    finally:
        gc.enable()


def passes_of(fn) -> list[tuple[int, int]]:
    """(generation, full-pass threshold then) of each collector pass while fn() runs, under
    thresholds (50, 1, 1): a pass every few allocations, a full one as often as allowed."""
    passes = []

    def on_gc(phase, info):
        if phase == "start":
            passes.append((info["generation"], gc.get_threshold()[2]))
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)
    gc.callbacks.append(on_gc)
    try:
        fn()
        n = len(passes)      # no allocation since fn returned: every pass so far was fn's
        assert gc.get_threshold() == (50, 1, 1)
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)
    return passes[:n]


def test_gc_young_only_puts_off_full_passes_and_freezes_nothing_after():
    from engine.llm import gc_young_only
    keep = []

    def make_long_lived():
        keep.append([[] for _ in range(200_000)])   # enough to set off full passes

    gc.collect()
    assert 2 in {g for g, _ in passes_of(make_long_lived)}
    gc.collect()
    frozen = gc.get_freeze_count()

    def inside():
        with gc_young_only():
            assert gc.get_freeze_count() > frozen
            make_long_lived()
    assert {g for g, _ in passes_of(inside)} == {0, 1}
    assert gc.get_freeze_count() == 0


def test_generate_steps_collect_young_objects_only(tiny_models):
    """A full pass walks every prompt's ids: generate's steps run under gc_young_only."""
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=256)
    prompts = mixed_prompts(llm.core.vocab_size, n=8)
    passes = passes_of(lambda: llm.generate(prompts, GREEDY))
    in_steps = [g for g, t2 in passes if t2 == 2 ** 31 - 1]    # the rest: before and after them
    assert len(in_steps) > len(passes) / 2 and set(in_steps) == {0, 1}, passes
    assert gc.get_freeze_count() == 0


def test_no_collector_pass_walks_the_intake(tiny_models):
    """generate freezes what its intake made before the collector is back on: from the call to
    its first step, no pass runs (one would walk every prompt taken in)."""
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=256)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, llm.core.vocab_size) for _ in range(4)] for _ in range(300)]
    at_first_step = []
    step = llm.core.step

    def first_step():
        if not at_first_step:
            at_first_step.append(gc.get_stats()[0]["collections"])
        return step()
    llm.core.step = first_step
    thresholds = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        gc.collect()
        before = gc.get_stats()[0]["collections"]
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))
    finally:
        gc.set_threshold(*thresholds)
    # The intake's allocations alone would set off a pass (checked by freezing after it).
    assert at_first_step == [before]


def test_fp8_kv_cache_holds_four_times_the_fp32_blocks(tiny_models):
    """kv_cache_dtype="fp8": one byte a value, so a block takes a quarter of float32's bytes and a
    CPU budget holds 4x the blocks."""
    plain = LLM(tiny_models["llama"], dtype="float32", device="cpu", cpu_kv_cache_gb=0.01)
    fp8 = LLM(tiny_models["llama"], dtype="float32", device="cpu", cpu_kv_cache_gb=0.01, kv_cache_dtype="fp8")
    assert 4 * fp8.core.runner.block_bytes == plain.core.runner.block_bytes
    plain_blocks, fp8_blocks = plain.get_stats().num_kv_blocks, fp8.get_stats().num_kv_blocks
    assert plain_blocks > 0 and 4 * plain_blocks <= fp8_blocks < 4 * (plain_blocks + 1)   # whole blocks only
    assert {c.dtype for pair in fp8.core.runner.kv_caches for c in pair} == {torch.float8_e4m3fn}
    assert {c.dtype for pair in plain.core.runner.kv_caches for c in pair} == {torch.float32}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp8_kv_cache_greedy_is_the_same_through_chunked_prefill_and_preemption(tiny_models, hf_outputs, arch):
    """With an FP8 cache the engine's own paths agree: prompts whole in a large pool, or in
    64-token chunks in a pool so small that requests are preempted and recomputed (their K/V
    rounded to FP8 again), give the same tokens; no block leaks."""
    prompts, expected = hf_outputs(arch)
    whole = LLM(tiny_models[arch], dtype="float32", device="cpu", num_kv_blocks=512, kv_cache_dtype="fp8")
    small = LLM(tiny_models[arch], dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=64,
                num_kv_blocks=30, max_model_len=400, kv_cache_dtype="fp8")
    got_whole = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY)]
    got_small = [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY)]
    stats = small.get_stats()
    assert stats.num_preemptions > 0 and stats.num_steps > sum(len(p) for p in prompts) // 64
    assert got_small == got_whole
    assert got_whole != expected        # the rounding shows (HF's own greedy ids, float32 K/V)
    for llm in (whole, small):
        assert llm.get_stats().num_free_kv_blocks == llm.get_stats().num_kv_blocks


def test_bad_kv_cache_dtype_is_named(tiny_models):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\], got 'int8'"):
        LLM(tiny_models["llama"], device="cpu", kv_cache_dtype="int8")


def test_bad_engine_settings(tiny_models):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_models["llama"], device="cpu", max_model_len=10**6)
    with pytest.raises(ValueError, match="raise num_kv_blocks or lower max_model_len"):
        LLM(tiny_models["llama"], device="cpu", num_kv_blocks=2, max_model_len=512)
    # Sized from memory, the message names that setting (it said num_kv_blocks, unset).
    with pytest.raises(ValueError, match="raise cpu_kv_cache_gb or lower max_model_len"):
        LLM(tiny_models["llama"], device="cpu", cpu_kv_cache_gb=1e-6, max_model_len=512)


def test_a_linear_rope_models_context_is_its_positions_times_the_factor(tmp_path):
    """As vLLM: max_model_len defaults to max_position_embeddings x the linear RoPE factor and
    may be set that high, and a prompt past max_position_embeddings gives HF's greedy tokens."""
    model = str(make_tiny_model(tmp_path / "m", arch="llama", seed=1, max_position_embeddings=64,
                                rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)))
    assert LLM(model, dtype="float32", device="cpu", num_kv_blocks=64).core.max_model_len == 128
    with pytest.raises(ValueError, match=r"max_model_len \(129\) must be <= the model's context "
                                         r"length \(128: max_position_embeddings 64 x linear RoPE factor 2\)"):
        LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=129)
    prompt = [random.Random(0).randrange(3, 1000) for _ in range(80)]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=8, min_new_tokens=0)[0, 80:].tolist()
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=128)
    got = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert got.outputs[0].token_ids == want


def test_unsupported_architecture_is_a_clear_error(tiny_models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_models["llama"], bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(bad), device="cpu")


def test_skip_tokenizer_init_works_on_token_ids(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64,
              skip_tokenizer_init=True)
    ref = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64)
    prompt = [5, 17, 99, 250]
    out = llm.generate([prompt], GREEDY)[0].outputs[0]
    assert out.token_ids == ref.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], GREEDY)
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([prompt], SamplingParams(max_tokens=4, stop=["x"]))


def test_token_id_prompts_are_checked_by_type_and_copied():
    import numpy as np

    from engine.llm import encode_prompt
    ids = [5, 7, 11]
    text, got = encode_prompt(None, ids)
    assert text is None and got == ids and got is not ids
    assert encode_prompt(None, (5, 7))[1] == [5, 7]
    got = encode_prompt(None, [np.int64(5), 7, np.int32(3)])[1]
    assert got == [5, 7, 3] and all(type(t) is int for t in got)
    assert encode_prompt(None, [])[1] == []
    for bad in ([1, True], [True], [1, 2.0], [np.bool_(True)], ["1"], [[1]], {1, 2}):
        with pytest.raises(ValueError, match="a string or a list of token ids"):
            encode_prompt(None, bad)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        encode_prompt(None, "hello")


def test_an_eos_id_besides_the_tokenizers_ends_with_it_as_stop_reason(tmp_path):
    """vLLM: the tokenizer's EOS is the primary one (stop_reason None); the generation
    config's other EOS ids are stop token ids, so ending on one gives stop_reason = that id."""
    prompt = "Once upon a time, in a quiet town by the sea,"
    src = make_tiny_model(tmp_path / "llama", arch="llama", seed=2)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ref = LLM(str(src), dtype="float32", device="cpu",
              num_kv_blocks=64).generate(prompt, greedy)[0].outputs[0].token_ids
    dst = tmp_path / "two_eos"
    shutil.copytree(src, dst)
    with open(dst / "generation_config.json") as f:
        generation = json.load(f)
    with open(dst / "generation_config.json", "w") as f:
        json.dump({**generation, "eos_token_id": [ref[2], 1]}, f)    # the tokenizer's: 1
    llm = LLM(str(dst), dtype="float32", device="cpu", num_kv_blocks=64)
    assert llm.tokenizer.eos_token_id == 1 and ref[2] != 1
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ref[:3], "stop", ref[2])
    # A min_tokens request masks every EOS id, under ignore_eos as well (vLLM's rule).
    masked = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, min_tokens=3,
                                                 ignore_eos=True))[0].outputs[0]
    assert ref[2] not in masked.token_ids[:3] and 1 not in masked.token_ids[:3]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_generate_interrupted_midway_leaves_nothing_behind(tiny_models, hf_outputs,
                                                             async_scheduling):
    """Ctrl-C (or any exception) in the middle of generate: its requests are aborted, their
    KV blocks free; they used to stay in the engine and run inside the next generate call,
    holding its blocks and steps for outputs nobody would read."""
    prompts, expected = hf_outputs("llama")
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=512,
              async_scheduling=async_scheduling)
    real_step, calls = llm.core.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step()
    llm.core.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY)
    llm.core.step = real_step
    assert not llm.core.scheduler.has_unfinished_requests()
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    steps_before = stats.num_steps
    outs = llm.generate(prompts[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    # Only the two prompts' steps: one prompt step, then a decode step per further token.
    assert llm.get_stats().num_steps - steps_before <= MAX_TOKENS + 1


class _InterruptAt:
    """Stands in for a model runner method: raises KeyboardInterrupt (Ctrl-C landing inside a
    step, where the time goes) at its `at`-th call."""

    def __init__(self, real, at):
        self.real, self.at, self.calls = real, at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_generate_interrupted_inside_a_step_leaves_nothing_behind(tiny_models, hf_outputs,
                                                                    async_scheduling):
    """Ctrl-C in the forward pass or the sampler: the step the scheduler planned never ran, so
    its outputs never come (each interrupted request stayed in Scheduler._draining for good),
    and the prompt blocks it registered in the prefix cache hold KV it never wrote (the same
    prompt sent again took them as a hit and generated from garbage)."""
    prompts, expected = hf_outputs("llama")
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=512,
              async_scheduling=async_scheduling)
    runner = llm.core.runner
    # The prompt step's forward pass and sampler, a decode step's sampler.
    for method, at in (("_forward_eager", 1), ("sampler", 1), ("sampler", 5)):
        setattr(runner, method, _InterruptAt(getattr(runner, method), at))
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY)
        delattr(runner, method) if method == "_forward_eager" else setattr(
            runner, method, getattr(runner, method).real)
        scheduler = llm.core.scheduler
        assert not scheduler.has_unfinished_requests() and not scheduler._draining, method
        stats = llm.get_stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
        outs = llm.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == expected, (method, at)
        assert not llm.core.scheduler._draining


def test_params_changed_after_they_were_built_are_read_as_when_built(tiny_models):
    """vLLM's examples take llm.get_default_sampling_params() and set fields on it: top_k -1
    (no top-k) or None set so was refused ("top_k must be >= 0"), stop None raised TypeError;
    n set to 0 let every other prompt run and then raised IndexError, n above 128 ran; and
    generate(None) raised TypeError "object of type 'NoneType' has no len()"."""
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64)
    want = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0]
    for field, value in (("top_k", -1), ("top_k", None), ("stop", None),
                         ("stop_token_ids", None), ("seed", -1)):
        sp = llm.get_default_sampling_params()
        sp.max_tokens, sp.temperature = 4, 0.0
        setattr(sp, field, value)
        got = llm.generate("Hello", sp)[0].outputs[0]
        assert got.token_ids == want.token_ids, (field, value)
    good = SamplingParams(max_tokens=3, temperature=0.0)
    for n in (0, 129):
        bad = SamplingParams(max_tokens=3, temperature=0.0)
        bad.n = n
        steps = llm.get_stats().num_steps
        with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]|n must be"):
            llm.generate(["Hello", "World"], [good, bad])
        assert llm.get_stats().num_steps == steps         # nothing ran
    for prompts in (None, 5):
        with pytest.raises(TypeError, match="prompts must be text, token ids, a prompt dict"):
            llm.generate(prompts, good)
    stats = llm.get_stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if not (loop.last and continue_final_message) %}<|end|>{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_renders_each_conversation_with_the_template_and_generates_from_it(tiny_models):
    """vLLM's LLM.chat: a conversation, or a list of them, rendered by the chat template (the
    tokenizer's, or `chat_template`) and generated greedily as its token ids are by generate:
    the template's BOS once (not a second from the tokenizer), the rendered text as the
    output's prompt; add_generation_prompt / continue_final_message reach the template."""
    from transformers import AutoTokenizer
    model = tiny_models["llama"]
    tok = AutoTokenizer.from_pretrained(model)
    talk = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    other = [{"role": "user", "content": "what is 2 + 2?"},
             {"role": "assistant", "content": "it is"}]
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def rendered(conversation, **kw):
        text = tok.apply_chat_template(conversation, chat_template=CHAT_TEMPLATE, tokenize=False,
                                       **kw)
        return text, tok.apply_chat_template(conversation, chat_template=CHAT_TEMPLATE,
                                             tokenize=True, **kw)["input_ids"]

    one = llm.chat(talk, params, chat_template=CHAT_TEMPLATE)
    text, ids = rendered(talk, add_generation_prompt=True)
    assert text.endswith("<|assistant|>") and ids.count(tok.bos_token_id) == 1
    assert [(o.prompt, o.prompt_token_ids) for o in one] == [(text, ids)]
    assert one[0].outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids
    both = llm.chat([talk, other], params, chat_template=CHAT_TEMPLATE,
                    add_generation_prompt=False, continue_final_message=True)
    for out, conversation in zip(both, [talk, other]):
        text, ids = rendered(conversation, add_generation_prompt=False,
                             continue_final_message=True)
        assert (out.prompt, out.prompt_token_ids) == (text, ids)
        assert out.outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids
    assert both[1].prompt.endswith("it is")                 # continued, not closed
    # The tokenizer's own template, where it has one.
    tok.chat_template = CHAT_TEMPLATE
    llm.tokenizer = tok
    assert [o.prompt for o in llm.chat(talk, params)] == [rendered(talk, add_generation_prompt=True)[0]]
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks


def test_chat_refuses_what_it_cannot_render_naming_why(tiny_models):
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64)
    talk = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="the model's tokenizer has no chat template: give "
                       "chat_template"):
        llm.chat(talk)                  # the tiny model's tokenizer has none
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt "
                       "cannot both be true"):
        llm.chat(talk, chat_template=CHAT_TEMPLATE, continue_final_message=True)
    for bad in ([], "hi", [[]], [talk, "hi"]):
        with pytest.raises(TypeError, match="messages must be a conversation"):
            llm.chat(bad, chat_template=CHAT_TEMPLATE)
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks


def test_reset_prefix_cache_makes_the_next_prompts_compute_whole(tiny_models):
    """vLLM's LLM.reset_prefix_cache; the engine refuses it (False) while a request holds
    blocks, whose cached content it would otherwise drop from under them."""
    llm = LLM(tiny_models["llama"], dtype="float32", device="cpu", num_kv_blocks=64,
              block_size=4, max_model_len=128)
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 36
    assert llm.get_stats().num_cached_kv_blocks > 0
    assert llm.reset_prefix_cache() is True
    assert llm.get_stats().num_cached_kv_blocks == 0
    cold = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0
    assert cold.outputs[0].token_ids == first.outputs[0].token_ids
    core = llm.core
    core.add_request(core.make_request("busy", prompt, params))
    core.step()
    assert core.reset_prefix_cache() is False and llm.get_stats().num_cached_kv_blocks > 0
    while core.has_unfinished_requests():
        core.step()
    assert core.reset_prefix_cache() is True
