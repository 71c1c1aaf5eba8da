"""Sampler tests: references are eager fp64 torch or hand-computed numbers."""
import random

import pytest
import torch

import engine.sampler as sampler_module
from engine.sampler import (Sampler, SamplerOutput, SamplingMetadata, _row_seed, apply_penalties,
                            bad_word_bans)
from kernels.exp_noise import exponential_noise_ref
from kernels.race_sample import race_sample_ref
from engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ATOL, RTOL = 1e-4, 1.3e-6  # fp32


def _meta(params, device="cpu", outputs=None, prompts=None, eos=()):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[0] for _ in params]
    return SamplingMetadata.from_params(params, prompts, outputs, list(eos), device)


def _draws(row_logits, params, num_draws=3000, device="cpu"):
    """`num_draws` independent unseeded samples from one row, reproducible via the sampler seed."""
    logits = torch.as_tensor(row_logits, dtype=torch.float32, device=device)
    logits = logits.expand(num_draws, -1).contiguous()
    out = Sampler(seed=0)(logits, _meta([params] * num_draws, device))
    return out.sampled_token_ids.cpu()


def _log(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


# ------------------------------------------------------------------ greedy and temperature
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_lowest_id_on_ties(device):
    logits = torch.randn(5, 123, generator=torch.Generator().manual_seed(0)).to(device)
    logits[3, 7] = logits[3, 90] = logits[3].max() + 1.0   # tie: the lower id wins
    out = Sampler(seed=0)(logits, _meta([SamplingParams(temperature=0.0)] * 5, device))
    expected = logits.double().cpu().argmax(-1)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids.cpu(), expected)
    assert out.sampled_token_ids[3].item() == 7
    assert out.logprobs is None and out.logprob_token_ids is None
    assert out.sampled_token_ranks is None


@pytest.mark.parametrize("device", DEVICES)
def test_small_temperature_samples_the_argmax(device):
    # Top-2 gaps of 0.05 at temperature 1e-3 leave the runner-up a probability of e^-50.
    gen = torch.Generator().manual_seed(1)
    logits = torch.stack([torch.randperm(100, generator=gen).float() * 0.05 for _ in range(64)])
    params = [SamplingParams(temperature=1e-3, seed=i if i % 2 else None) for i in range(64)]
    out = Sampler(seed=0)(logits.to(device), _meta(params, device))
    assert torch.equal(out.sampled_token_ids.cpu(), logits.argmax(-1))


def test_temperature_below_cutoff_is_greedy():
    meta = _meta([SamplingParams(temperature=1e-7, seed=3), SamplingParams(temperature=0.5)])
    assert meta.temperature.tolist() == [0.0, 0.5]
    assert meta.seeds == [None, None] and not meta.all_greedy and not meta.all_random


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_1_equals_greedy(device):
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(2))
    out = Sampler(seed=0)(logits.to(device),
                          _meta([SamplingParams(temperature=1.5, top_k=1)] * 200, device))
    assert torch.equal(out.sampled_token_ids.cpu(), logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_greedy_rows_take_argmax(device):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(8))
    greedy = [i % 3 == 0 for i in range(64)]
    params = [SamplingParams(temperature=0.0 if g else 5.0, top_p=0.9, seed=i if i % 2 else None)
              for i, g in enumerate(greedy)]
    sampled = Sampler(seed=0)(logits.to(device), _meta(params, device)).sampled_token_ids.cpu()
    mask = torch.tensor(greedy)
    assert torch.equal(sampled[mask], logits.argmax(-1)[mask])
    # At temperature 5 over 50 tokens the random rows rarely hit the argmax.
    assert (sampled[~mask] != logits.argmax(-1)[~mask]).sum() > 20


def test_all_greedy_fast_path_does_not_sort_softmax_or_draw(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("all-greedy batch must not sort, softmax or draw noise")
    for name in ("sort", "softmax", "exponential_"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "sort", boom)
    for name in ("exponential_noise", "exponential_noise_ref", "race_sample"):
        monkeypatch.setattr(sampler_module, name, boom)
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=1)] * 4
    out = Sampler(seed=0)(logits, _meta(params))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


# ------------------------------------------------------------------ top-k / top-p / min-p support
FLAT = [0.1, 0.0, 0.3, -0.1, 0.25, 0.05, 0.2, -0.2]
PROBS_A = [0.10, 0.30, 0.05, 0.25, 0.20, 0.10]   # sorted: 1, 3, 4, 0|5, 2
PROBS_B = [0.40, 0.30, 0.15, 0.10, 0.05]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row_logits, params, allowed", [
    (FLAT, SamplingParams(top_k=3), {2, 4, 6}),
    (FLAT, SamplingParams(top_k=100), set(range(8))),                  # k > V keeps all
    (_log(PROBS_A), SamplingParams(top_p=0.7), {1, 3, 4}),              # .30+.25 < .7 <= .75
    (_log(PROBS_A), SamplingParams(top_p=0.5), {1, 3}),
    # Temperature 2 flattens to p ~ sqrt(p): .233 .213 .190 ..., so 0.5 needs three tokens.
    (_log(PROBS_A), SamplingParams(top_p=0.5, temperature=2.0), {1, 3, 4}),
    (_log(PROBS_B), SamplingParams(min_p=0.3), {0, 1, 2}),              # p >= .12
    # Temperature 2: p ~ sqrt(p) = .632 .548 .387 .316 .224, threshold .4 * .632 = .253.
    (_log(PROBS_B), SamplingParams(min_p=0.4, temperature=2.0), {0, 1, 2, 3}),
    (_log(PROBS_B), SamplingParams(min_p=0.4), {0, 1}),                 # p >= .16
    # top-p is taken over the survivors renormalized: top-2 -> (.545, .455), 0.5 keeps one.
    (_log(PROBS_B), SamplingParams(top_k=2, top_p=0.5), {0}),
    # min-p first: {0,1,2} -> (.47, .35, .18); 0.8 keeps two.
    (_log(PROBS_B), SamplingParams(min_p=0.3, top_p=0.8), {0, 1}),
])
def test_truncation_support(device, row_logits, params, allowed):
    seen = set(_draws(row_logits, params, device=device).tolist())
    assert seen == allowed


@pytest.mark.parametrize("params, row_logits, expected_probs", [
    (SamplingParams(temperature=0.8), [1.0, 0.5, 0.0, -0.5, 2.0, 0.2], None),
    (SamplingParams(temperature=1.0, top_k=3), _log(PROBS_B).tolist(), [0.40 / .85, 0.30 / .85,
                                                                       0.15 / .85, 0.0, 0.0]),
])
def test_frequencies_match_the_distribution(params, row_logits, expected_probs):
    num_draws = 20000
    draws = _draws(row_logits, params, num_draws=num_draws)
    if expected_probs is None:
        expected_probs = (torch.tensor(row_logits, dtype=torch.float64) / params.temperature)
        expected_probs = expected_probs.softmax(-1)
    expected = torch.as_tensor(expected_probs, dtype=torch.float64) * num_draws
    observed = torch.bincount(draws, minlength=len(row_logits)).double()
    support = expected > 0
    assert observed[~support].sum() == 0
    chi2 = ((observed - expected)[support] ** 2 / expected[support]).sum().item()
    # Critical values at p = 0.001 for df = 5 and df = 2; the draws are seeded, so no flakes.
    critical = {5: 20.52, 2: 13.82}[int(support.sum()) - 1]
    assert chi2 < critical, chi2


# ------------------------------------------------------------------ penalties and min_tokens
def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 3)
    before = logits.clone()
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5),
        SamplingParams(),                                  # penalties off: unchanged
        SamplingParams(presence_penalty=-1.0),             # prompt tokens do not count
    ]
    meta = _meta(params, prompts=[[0, 4], [1, 2, 3], [0]], outputs=[[1, 2, 2], [0, 3], [5, 5, 3]])
    got = apply_penalties(logits, meta)
    # Row 0: seen {0,1,2,4} -> 2/2, -1*2, .5/2, -2*2; then counts t1:1, t2:2 (f .25, p .5).
    expected = torch.tensor([
        [1.0, -2.0 - 0.25 - 0.5, 0.25 - 0.5 - 0.5, 3.0, -4.0, 0.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
        [2.0, -1.0, 0.5, 4.0, -2.0, 1.0],
    ])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(logits, before)


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]] * 3)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, frequency_penalty=0.2),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits, _meta(params, prompts=[[0], [2], [2]], outputs=[[], [0], [0]]))
    assert out.sampled_token_ids.tolist() == [1, 1, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_give_what_their_float32_values_give(device):
    """A decode graph hands the sampler its logits in the model's dtype: plain greedy rows take
    the argmax as they are (ties to the lower id, min_tokens masks applied), anything that
    computes on them does it in float32 (logprobs come out float32, the same numbers). Token 0
    sits one bf16 step below token 1; a repetition penalty of 1.003 on token 1 leaves it 0.997,
    still above token 0 in float32 (rounded to bf16 it would tie with token 0, and the tie would
    go to token 0)."""
    row = [0.99609375, 1.0, 0.5, -1.0]
    logits = torch.tensor([row] * 4, dtype=torch.bfloat16, device=device)
    logits[2, 3] = logits[2, 1]                                      # a tie: the lower id
    cases = [
        ([SamplingParams(temperature=0.0)] * 4, None),
        ([SamplingParams(temperature=0.0, repetition_penalty=1.003)] * 4, [[1]] * 4),
        ([SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])] * 4, None),
        ([SamplingParams(temperature=0.0, logprobs=1)] * 4, None),
    ]
    for params, outputs in cases:
        meta = _meta(params, device, outputs=outputs)
        got = Sampler(seed=0)(logits, meta)
        want = Sampler(seed=0)(logits.float(), meta)
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids), params[0]
        if got.logprobs is not None:
            assert got.logprobs.dtype == torch.float32 and torch.equal(got.logprobs, want.logprobs)
    greedy, penalized, masked, _ = (Sampler()(logits, _meta(p, device, outputs=o)).sampled_token_ids.tolist()
                                    for p, o in cases)
    assert greedy == [1, 1, 1, 1] and penalized == [1, 1, 3, 1] and masked == [0, 0, 3, 0]


def test_from_params_min_tokens_masks_eos_and_stop_ids():
    params = [SamplingParams(min_tokens=3, stop_token_ids=[5, 2]),
              SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True),
              SamplingParams(min_tokens=2, stop_token_ids=[5]),
              SamplingParams(stop_token_ids=[5])]
    meta = _meta(params, outputs=[[1], [1], [1, 1], []], eos=[2, 7])
    # EOS is masked under ignore_eos too (vLLM masks all_stop_token_ids, EOS included).
    assert [sorted(ids) for ids in meta.no_stop_token_ids] == [[2, 5, 7], [2, 5, 7], [], []]


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_mask_in_sampler(device):
    logits = torch.tensor([[1.0, 0.0, 9.0, 0.0, 0.0, 8.0, 0.0, 7.0]] * 4, device=device)
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5, 1000]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=1),
              SamplingParams(temperature=0.0, min_tokens=1)]
    meta = _meta(params, device, outputs=[[1], [1], [1], []], eos=[2, 7])
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [0, 0, 2, 5]
    # Random rows never draw a masked id, even where it dominates.
    flat = (logits[:1] * 0.1).expand(2000, -1).contiguous()
    meta = _meta([SamplingParams(min_tokens=1, stop_token_ids=[5])] * 2000, device, eos=[2])
    draws = set(Sampler(seed=0)(flat, meta).sampled_token_ids.tolist())
    assert draws == {0, 1, 3, 4, 6, 7}


# ------------------------------------------------------------------ seeds
def _sample_seeded_row(device, row_logits, seed, output, position, batch_size=16,
                       sampler_seed=0):
    """Put a seeded request at `position` among `batch_size - 1` other random rows."""
    gen = torch.Generator().manual_seed(100 + position)
    logits = torch.randn(batch_size, row_logits.numel(), generator=gen)
    logits[position] = row_logits
    params = [SamplingParams(temperature=0.9, seed=None if i % 2 else 1000 + i)
              for i in range(batch_size)]
    outputs = [[i] * (i % 5) for i in range(batch_size)]
    params[position], outputs[position] = SamplingParams(seed=seed), output
    out = Sampler(seed=sampler_seed)(logits.to(device), _meta(params, device, outputs=outputs))
    return out.sampled_token_ids[position].item()


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_ignores_its_batch_and_row(device):
    row_logits = torch.randn(50, generator=torch.Generator().manual_seed(4)) * 0.1
    for num_generated in range(4):
        output = list(range(num_generated))
        alone = _sample_seeded_row(device, row_logits, 1234, output, 0, batch_size=1,
                                   sampler_seed=0)
        for position in (0, 7, 15):
            # A different sampler seed too: a resumed request gets a fresh shared generator.
            got = _sample_seeded_row(device, row_logits, 1234, output, position,
                                     sampler_seed=position + 1)
            assert got == alone, (num_generated, position)


@pytest.mark.parametrize("device", DEVICES)
def test_different_seeds_and_positions_draw_differently(device):
    row_logits = torch.zeros(50)
    by_seed = {_sample_seeded_row(device, row_logits, s, [], 0, batch_size=1) for s in range(20)}
    by_step = {_sample_seeded_row(device, row_logits, 7, [0] * k, 0, batch_size=1)
               for k in range(20)}
    # 20 uniform draws over 50 tokens: chance of <= 5 distinct values is negligible.
    assert len(by_seed) > 5 and len(by_step) > 5


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_same_after_greedy_or_random_rows(device):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    tokens = {}
    for neighbours in ("greedy", "random"):
        temperature = 0.0 if neighbours == "greedy" else 1.0
        sampler, seq = Sampler(seed=0), []
        for k in range(8):
            params = [SamplingParams(temperature=temperature),
                      SamplingParams(temperature=temperature, seed=99),
                      SamplingParams(seed=42)]
            outputs = [[1] * k, [2] * k, seq]
            out = sampler(logits.to(device), _meta(params, device, outputs=outputs))
            seq = seq + [out.sampled_token_ids[2].item()]
        tokens[neighbours] = seq
    assert tokens["greedy"] == tokens["random"]
    assert len(set(tokens["greedy"])) > 1


# ------------------------------------------------------------------ logprobs
@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_sorted_and_ranked(device):
    logits = torch.randn(6, 37, generator=torch.Generator().manual_seed(6)) * 3
    params = [SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=2, presence_penalty=1.0),
              SamplingParams(temperature=1.3, top_k=4, seed=3),
              SamplingParams(temperature=2.0, logprobs=0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=5.0, top_p=0.9)]
    meta = _meta(params, device, prompts=[[0, 1]] * 6, outputs=[[2, 3]] * 6)
    out: SamplerOutput = Sampler(seed=0)(logits.to(device), meta)

    reference = logits.double().log_softmax(-1)                 # before penalties/temperature
    sampled = out.sampled_token_ids.cpu()
    order = reference.argsort(-1, descending=True)
    assert out.logprob_token_ids.shape == out.logprobs.shape == (6, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0].cpu(), sampled)
    assert torch.equal(out.logprob_token_ids[:, 1:].cpu(), order[:, :5])
    torch.testing.assert_close(out.logprobs.cpu().double(),
                               reference.gather(1, out.logprob_token_ids.cpu()),
                               atol=ATOL, rtol=RTOL)
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    expected_ranks = (order == sampled[:, None]).int().argmax(-1) + 1
    assert torch.equal(out.sampled_token_ranks.cpu(), expected_ranks)
    assert out.sampled_token_ranks[1].item() != 0  # greedy row: rank of the penalized argmax
    assert out.sampled_token_ranks.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
def test_a_sampled_token_tied_with_others_is_ranked_after_its_ties_as_in_vllm(device):
    """vLLM (V1) ranks the sampled token by the entries whose raw logprob is >= its own
    (vllm/v1/sample/ops/logprobs.py, batched_count_greater_than): the strictly greater ones
    plus one gave a tied token a better rank. Raw logits [2, 1, 1, ...]; token 0 is in the
    prompt and a repetition penalty of 4 pushes it under the tie, so greedy takes token 1."""
    logits = torch.tensor([[2.0, 1.0, 1.0, -3.0, -3.0], [0.5, 0.5, 0.5, 0.5, 0.5]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=1),
              SamplingParams(temperature=0.0, logprobs=1)]
    out = Sampler(seed=0)(logits.to(device), _meta(params, device, prompts=[[0], [4]],
                                                   outputs=[[], []]))
    assert out.sampled_token_ids.tolist() == [1, 0]
    assert out.sampled_token_ranks.tolist() == [3, 5]


def test_logprobs_zero_gives_only_the_sampled_column():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(7))
    out = Sampler(seed=0)(logits, _meta([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    assert out.logprobs.shape == (2, 1)
    assert torch.equal(out.logprob_token_ids[:, 0], logits.argmax(-1))
    assert out.sampled_token_ranks.tolist() == [1, 1]


# ------------------------------------------------------------------ from_params
def test_from_params_leaves_unused_features_none():
    meta = _meta([SamplingParams(), SamplingParams(temperature=0.0, top_k=5, top_p=0.5,
                                                   min_p=0.2, seed=3)])
    assert meta.temperature.dtype == torch.float32 and meta.temperature.tolist() == [1.0, 0.0]
    for name in ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "prompt_token_ids", "max_num_logprobs"):
        assert getattr(meta, name) is None, name
    # An all-greedy batch copies no temperatures to the device: only the argmax reads it.
    assert _meta([SamplingParams(temperature=0.0), SamplingParams(temperature=1e-7)]).temperature is None
    assert meta.seeds == [None, None]
    assert meta.no_stop_token_ids == [[], []]
    assert (meta.all_greedy, meta.all_random) == (False, False)
    assert _meta([SamplingParams(temperature=0.0)]).all_greedy
    assert _meta([SamplingParams(temperature=0.3)]).all_random


def test_a_top_k_of_the_vocabulary_or_more_is_off():
    """vLLM's clients send top_k = vocabulary size (or more) for "keep every token": as its k
    it made the sampler take the top V of every row at every step (almost a sort)."""
    def meta(*ks):
        return SamplingMetadata.from_params([SamplingParams(top_k=k) for k in ks],
                                            [[0]] * len(ks), [[]] * len(ks), [], "cpu",
                                            vocab_size=100)
    both = meta(100, 2**31 - 1, 5)
    assert both.top_k.tolist() == [0, 0, 5] and both.max_top_k == 5
    off = meta(100, 10**6)
    assert off.top_k is None and off.max_top_k == 0
    assert meta(99).top_k.tolist() == [99]


def test_from_params_builds_used_features():
    params = [SamplingParams(top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.1,
                             presence_penalty=0.5, frequency_penalty=-0.5, logprobs=3, seed=7),
              SamplingParams(logprobs=5)]
    prompts = [[1, 2], [3]]
    meta = _meta(params, prompts=prompts, outputs=[[4], []])
    assert meta.top_k.dtype == torch.int64 and meta.top_k.tolist() == [5, 0]
    torch.testing.assert_close(meta.top_p, torch.tensor([0.9, 1.0]))
    torch.testing.assert_close(meta.min_p, torch.tensor([0.1, 0.0]))
    torch.testing.assert_close(meta.repetition_penalty, torch.tensor([1.1, 1.0]))
    torch.testing.assert_close(meta.presence_penalty, torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(meta.frequency_penalty, torch.tensor([-0.5, 0.0]))
    assert all(t.dtype == torch.float32 for t in (meta.top_p, meta.min_p, meta.presence_penalty))
    assert meta.prompt_token_ids == prompts and meta.output_token_ids == [[4], []]
    assert meta.max_num_logprobs == 5 and meta.seeds == [7, None]
    assert meta.all_random and not meta.all_greedy


def test_output_counts_stand_in_for_outputs_without_penalties():
    """Without penalties the sampler reads only how many tokens each row has generated (the
    seed position, min_tokens): counts give what the outputs give, and the runner copies no
    row's outputs each step. A penalty with counts only is a clear error."""
    params = [SamplingParams(temperature=0.9, seed=11, top_p=0.9),
              SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[3]),
              SamplingParams(temperature=1.0, seed=5)]
    outputs = [[7] * 5, [1, 2], []]
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    logits[1, 3] = 50.0                          # the stop token wins unless masked
    by_lists = SamplingMetadata.from_params(params, [[0]] * 3, outputs, [2], "cpu")
    by_counts = SamplingMetadata.from_params(params, [[0]] * 3, None, [2], "cpu",
                                             num_output_tokens=[5, 2, 0])
    assert by_counts.output_token_ids is None and by_counts.num_output_tokens == [5, 2, 0]
    assert by_counts.no_stop_token_ids == by_lists.no_stop_token_ids == [[], [2, 3], []]
    a = Sampler(seed=1)(logits, by_lists).sampled_token_ids
    b = Sampler(seed=1)(logits, by_counts).sampled_token_ids
    assert a.tolist() == b.tolist() and b[1] != 3
    penalized = SamplingMetadata.from_params([SamplingParams(presence_penalty=0.5)], [[0]],
                                             None, [], "cpu", num_output_tokens=[1])
    with pytest.raises(AssertionError, match="output_token_ids"):
        apply_penalties(logits[:1], penalized)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_rows,top_k,top_p", [(70, 0, 1.0), (70, 20, 0.9), (5, 0, 0.8), (5, 0, 1.0)])
def test_a_draw_is_the_race_over_the_kept_tokens(device, num_rows, top_k, top_p):
    """Whichever way the device goes (on CUDA kernels/race_sample.py with a cut or from 64 rows,
    else the sort and softmax), a seeded row samples the kept token with the largest p / q, q the
    Exp(1) noise keyed by its (seed, position) (kernels/exp_noise.py's reference): the race's
    reference, fed here by hand."""
    vocab, temperature = 3000, 0.7
    logits = (torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(9)) * 3).to(device)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=50 + i)
              for i in range(num_rows)]
    got = Sampler(seed=0)(logits, _meta(params, device)).sampled_token_ids
    keys = [_row_seed(50 + i, 0) for i in range(num_rows)]
    noise = exponential_noise_ref(torch.tensor([k - (1 << 64) if k >> 63 else k for k in keys], device=device),
                                  torch.zeros(num_rows, dtype=torch.int32, device=device), vocab)
    scaled = logits / torch.full((num_rows,), temperature, device=device).unsqueeze(1)
    rows = torch.full((num_rows,), 1, device=device)
    want = race_sample_ref(scaled, noise, rows * top_k if top_k else None,
                           (rows * top_p).float() if top_p < 1.0 else None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernels", [False, True])
def test_top_k_keeps_the_tokens_tied_with_the_kth_as_vllm_and_hf(kernels):
    """vLLM (`logits < kth` masked) and HF's TopKLogitsWarper keep every token tied with the k-th
    largest logit; the sampler kept exactly k, lowest ids first, so a tied token with a higher
    id was never drawn (ties are common in bf16 logits). Over 64 seeds each tied token comes
    up (the kernel's path on CPU runs under TRITON_INTERPRET)."""
    logits = torch.full((64, 16), -5.0)
    logits[:32, 0], logits[:32, 3], logits[:32, 7] = 3.0, 1.0, 1.0   # top_k 2: 0, a tie second
    logits[32:, 3] = logits[32:, 7] = 2.0                          # top_k 1: a tie first
    params = ([SamplingParams(temperature=1.0, top_k=2, seed=s) for s in range(32)]
              + [SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(32)])
    drawn = Sampler(seed=0, kernels=kernels)(logits.to(DEVICES[-1]),
                                             _meta(params, DEVICES[-1])).sampled_token_ids.tolist()
    assert set(drawn[32:]) == {3, 7}, drawn[32:]
    assert set(drawn[:32]) == {0, 3, 7}, drawn[:32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows,min_p", [(5, 0.05), (70, 0.05), (5, 0.0), (70, 0.0)])
def test_the_kernels_path_draws_what_the_references_draw(num_rows, min_p, dtype, monkeypatch):
    """The sampler's own calls into kernels/exp_noise.py and kernels/race_sample.py (on CUDA, or
    on CPU under TRITON_INTERPRET) against its reference path, on a batch mixing greedy,
    seeded and unseeded rows, top-k on and off (0, past the vocabulary), top-p on and off, min-p:
    the same tokens, call after call (the unseeded rows' key advances alike). Without min-p,
    logits in bf16 (a decode graph's) reach the race as they are, with the temperatures: no fp32
    copy; with min-p on some row, fp32 logits already divided."""
    vocab = 500
    gen = torch.Generator().manual_seed(11)
    params = [SamplingParams(temperature=0.0 if i % 7 == 3 else 0.6 + 0.1 * (i % 4),
                             top_k=(0, 5, 40, vocab + 9)[i % 4], top_p=(1.0, 0.9, 0.5)[i % 3],
                             min_p=min_p if i % 5 == 1 else 0.0, seed=100 + i if i % 2 else None)
              for i in range(num_rows)]
    device = DEVICES[-1]
    meta = _meta(params, device)
    assert meta.top_k is not None and meta.top_p is not None and not meta.all_greedy
    kernels, refs = Sampler(seed=4, kernels=True), Sampler(seed=4, kernels=False)
    raced = []
    race = sampler_module.race_sample
    monkeypatch.setattr(sampler_module, "race_sample", lambda logits, *a, temperature=None, **k: (
        raced.append((logits.dtype, temperature is not None)), race(logits, *a, temperature=temperature, **k))[1])
    for _ in range(2):
        logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(device, dtype)
        got, want = kernels(logits, meta).sampled_token_ids, refs(logits, meta).sampled_token_ids
        assert torch.equal(got, want), (got, want)
    assert raced == ([(torch.float32, False)] if min_p else [(dtype, True)]) * 2


# ------------------------------------------------------------------ logit_bias, allowed_token_ids
def _controlled_ref(logits, params, outputs, prompts):
    """vLLM V1's order, row by row in float64: allowed_token_ids (-inf elsewhere), logit_bias,
    then the penalties as test_penalties_match_hand_computation computes them."""
    out = logits.double().clone()
    for row, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = torch.zeros(out.shape[1], dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            out[row][~keep] = float("-inf")
        for t, b in (p.logit_bias or {}).items():
            out[row, t] += b
        seen = set(prompts[row]) | set(outputs[row])
        for t in range(out.shape[1]):
            v = out[row, t]
            if t in seen and p.repetition_penalty != 1.0:
                v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            c = outputs[row].count(t)
            out[row, t] = v - p.frequency_penalty * c - p.presence_penalty * (c > 0)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_token_controls_apply_before_the_penalties_as_in_vllm(device):
    vocab = 40
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=gen) * 2
    params = [
        SamplingParams(logit_bias={3: 2.5, 7: -100.0, 39: 0.25}),
        SamplingParams(),                                               # no controls: as it was
        SamplingParams(allowed_token_ids=[0, 5, 5, 39]),
        # A bias that turns a negative logit positive, then a repetition penalty on it: the
        # penalty divides (bias first), where penalty-then-bias would have multiplied.
        SamplingParams(logit_bias={1: 4.0}, repetition_penalty=2.0, frequency_penalty=0.5),
        SamplingParams(allowed_token_ids=[1, 2, 3], logit_bias={2: 1.0, 30: 50.0}),
        SamplingParams(logit_bias={}),
    ]
    logits[3, 1] = -1.0
    outputs = [[], [], [], [1, 1], [], []]
    prompts = [[0]] * 6
    meta = _meta(params, device, outputs=outputs, prompts=prompts)
    assert meta.logit_bias is not None and meta.allowed_token_ids is not None
    before = logits.clone()
    got = apply_penalties(sampler_module.apply_token_controls(logits.to(device), meta), meta)
    want = _controlled_ref(logits, params, outputs, prompts)
    torch.testing.assert_close(got.cpu().double(), want, atol=ATOL, rtol=RTOL)
    assert torch.equal(logits, before)
    assert got[3, 1].item() == pytest.approx((-1.0 + 4.0) / 2.0 - 2 * 0.5)
    assert torch.equal(got[1].cpu(), logits[1]) and torch.equal(got[5].cpu(), logits[5])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_random_rows_pick_only_allowed_tokens_and_follow_the_bias(device):
    vocab = 64
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(32, vocab, generator=gen).to(device)
    allowed = [5, 17, 60]
    params = ([SamplingParams(temperature=0.0, allowed_token_ids=allowed)] * 8
              + [SamplingParams(temperature=1.0, allowed_token_ids=allowed, seed=i) for i in range(8)]
              + [SamplingParams(temperature=0.0, logit_bias={33: 100.0})] * 8
              + [SamplingParams(temperature=0.8, top_k=5, logit_bias={33: 100.0})] * 8)
    # The kernels on CUDA, or on CPU where no GPU is (TRITON_INTERPRET, as the test above).
    for kernels in (False, True) if device == DEVICES[-1] else (False,):
        out = Sampler(seed=0, kernels=kernels)(logits, _meta(params, device)).sampled_token_ids.cpu()
        sub = logits[:8, allowed].cpu()
        assert out[:8].tolist() == [allowed[i] for i in sub.argmax(-1).tolist()]
        assert set(out[8:16].tolist()) <= set(allowed)
        assert out[16:].tolist() == [33] * 16
    # Random rows draw every allowed token in proportion, not only the best one.
    draws = _draws([0.0] * vocab, SamplingParams(allowed_token_ids=allowed), 3000, device)
    assert set(draws.tolist()) == set(allowed)
    assert min((draws == t).sum().item() for t in allowed) > 850


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_stay_the_raw_models_under_token_controls(device):
    """vLLM's default (raw logprobs): computed before any control, so a biased or masked token's
    logprob and the top-n are the model's own."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 30, generator=gen).to(device)
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={4: 100.0}),
              SamplingParams(temperature=0.0, logprobs=3, allowed_token_ids=[4])]
    out = Sampler(seed=0)(logits, _meta(params, device))
    raw = logits.float().log_softmax(-1)
    assert out.sampled_token_ids.tolist() == [4, 4]
    torch.testing.assert_close(out.logprobs[:, 0], raw[:, 4])
    torch.testing.assert_close(out.logprobs[:, 1:], raw.topk(3, dim=-1).values)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_with_a_small_bias_are_biased_in_float32(device):
    """A decode graph's logits come in bf16: a bias is added in float32 (as vLLM, which casts
    first), so a bias below bf16's step at 1.0 (2^-7) still decides a near tie."""
    logits = torch.tensor([[1.0, 0.99609375, -3.0]], dtype=torch.bfloat16, device=device)
    params = [SamplingParams(temperature=0.0, logit_bias={1: 0.005})]
    assert Sampler()(logits, _meta(params, device)).sampled_token_ids.tolist() == [1]


def test_from_params_builds_controls_only_for_rows_that_have_them():
    assert _meta([SamplingParams(), SamplingParams(logit_bias={})]).logit_bias is None
    assert _meta([SamplingParams()]).allowed_token_ids is None
    meta = _meta([SamplingParams(), SamplingParams(logit_bias={7: 1.5, 2: -1.0}),
                  SamplingParams(allowed_token_ids=[4, 1]), SamplingParams(allowed_token_ids=[9])])
    rows, ids, biases = meta.logit_bias
    assert (rows.tolist(), ids.tolist(), biases.tolist()) == ([1, 1], [7, 2], [1.5, -1.0])
    rows, local, ids = meta.allowed_token_ids
    assert (rows.tolist(), local.tolist(), ids.tolist()) == ([2, 3], [0, 0, 1], [4, 1, 9])
    # The caller's own RowControls (the model runner keeps them a request) give the same.
    controls = [sampler_module.RowControls.of(p, "cpu") for p in
                [SamplingParams(), SamplingParams(logit_bias={7: 1.5, 2: -1.0})]]
    assert controls[0] is None
    kept = SamplingMetadata.from_params([SamplingParams()] * 2, [[0]] * 2, [[]] * 2, [], "cpu",
                                        controls=controls)
    assert [t.tolist() for t in kept.logit_bias] == [[1, 1], [7, 2], [1.5, -1.0]]


# ------------------------------------------------------------------ bad_words
def _bans_ref(words, output):
    """vLLM's rule on the whole output: a word's last token is banned where the output ends in
    the word's other tokens."""
    return {w[-1] for w in words if len(w) - 1 <= len(output)
            and (len(w) == 1 or output[len(output) - len(w) + 1:] == w[:-1])}


def test_bad_word_bans_are_vllms_rule_with_or_without_a_token_in_flight():
    """With the output's last token still in flight (unknown to the host), a ban that hangs on
    it is handed on as `needs`: whatever that token turns out to be, the bans that apply are
    the rule's on the whole output."""
    rng = random.Random(4)
    for _ in range(3000):
        words = [[rng.randrange(4) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 4))]
        output = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        want = _bans_ref(words, output)
        assert {t for t, needs in bad_word_bans(words, output, False) if needs < 0} == want
        assert all(needs < 0 for _, needs in bad_word_bans(words, output, False))
        if output:
            *known, last = output
            got = {t for t, needs in bad_word_bans(words, known, True) if needs in (-1, last)}
            assert got == want, (words, output)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_words_ban_in_the_sampler_with_tokens_in_flight(device):
    """Rows 0-1: from output_token_ids; rows 2-3: bans and the tokens in flight as the model
    runner gives them, decided on the device. Unbanned logits keep their bits."""
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(3)).to(device)
    words = [[7], [1, 2, 9], [4, 5]]
    params = [SamplingParams(temperature=0.0, bad_words_token_ids=words)] * 4
    meta = _meta(params, device, outputs=[[1, 2], [0, 4], [], []])
    rows, tokens, banned = meta.bad_words
    got = sampler_module.apply_token_controls(logits, meta)
    expect = logits.clone()
    expect[0, [7, 9]] = float("-inf")
    expect[1, [7, 5]] = float("-inf")
    assert torch.equal(got[:2], expect[:2])
    # Known outputs [1] and [0]; in flight: 2 (completes [1, 2] -> ban 9) and 3 (nothing).
    bans = [bad_word_bans(words, [1], True), bad_word_bans(words, [0], True)]
    pending = torch.tensor([2, 3], device=device)
    meta = SamplingMetadata.from_params(params[:2], [[0]] * 2, None, [], device, [2, 2],
                                        bans=bans, pending_tokens=pending)
    got = sampler_module.apply_token_controls(logits[2:], meta)
    expect = logits[2:].clone()
    expect[0, [7, 9]] = float("-inf")
    expect[1, 7] = float("-inf")
    assert torch.equal(got, expect)
    out = Sampler(seed=0)(logits[2:], meta).sampled_token_ids.tolist()
    assert out[0] not in (7, 9) and out[1] != 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks CUDA host syncs: needs a GPU")
def test_on_cuda_token_controls_never_wait_for_the_gpu():
    """Under torch's sync debug mode ("error": a call that makes the host wait for the device
    raises), with the stream busy: each row's controls built as the model runner builds them,
    a step's metadata with bad words waiting on tokens in flight, and the sampler."""
    vocab = 128256
    logits = torch.randn(4, vocab, device="cuda")
    params = [SamplingParams(temperature=0.0, logit_bias={5: 3.0, 9: -100.0}),
              SamplingParams(temperature=0.8, seed=1, allowed_token_ids=list(range(0, vocab, 7))),
              SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5], [6]]),
              SamplingParams(temperature=0.7, top_p=0.9, allowed_token_ids=[1, 2, 3],
                             logit_bias={2: 1.0})]
    in_flight = torch.tensor([4, 0, 4, 0], device="cuda")
    sampler = Sampler(seed=0)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)          # the stream stays busy while the host goes on
    torch.cuda.set_sync_debug_mode("error")
    try:
        controls = [sampler_module.RowControls.of(p, "cuda") for p in params]
        bans = [bad_word_bans(p.bad_words_token_ids or [], [], True) for p in params]
        meta = SamplingMetadata.from_params(params, [[]] * 4, None, [], "cuda", [1] * 4,
                                            controls=controls, bans=bans,
                                            pending_tokens=in_flight)
        out = sampler(logits, meta)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens = out.sampled_token_ids.tolist()
    assert tokens[1] % 7 == 0 and tokens[2] not in (5, 6) and tokens[3] in (1, 2, 3)
