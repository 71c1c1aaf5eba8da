"""Per-request options through the whole engine: stop strings and ids, max_tokens, EOS,
ignore_eos, min_tokens, logprobs, seeds, finish reasons."""
import json
import os
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from scripts.make_tiny_model import make_tiny_model

PROMPT = "Once upon a time, in a quiet town by the sea,"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=2))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=256)


@pytest.fixture(scope="module")
def greedy_ref(llm):
    """A long greedy completion with no stop conditions but max_tokens."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))[0]
    return out.outputs[0]


def with_eos(model_dir, tmp_path, eos_id):
    """The same model, but with `eos_id` as its end-of-sequence token."""
    d = tmp_path / f"eos{eos_id}"
    shutil.copytree(model_dir, d)
    for name in ("config.json", "generation_config.json"):
        path = d / name
        if path.exists():
            cfg = json.load(open(path))
            cfg["eos_token_id"] = eos_id
            json.dump(cfg, open(path, "w"))
    return str(d)


def test_max_tokens_none_runs_to_max_model_len(model_dir):
    """vLLM's meaning of max_tokens=None: until the context ends ("length" at max_model_len)."""
    llm = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=40)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"
    assert llm.get_stats().num_free_kv_blocks == 64


def test_max_tokens_gives_length(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 7
    assert out.outputs[0].finish_reason == "length" and out.finished


def test_stop_token_id(llm, greedy_ref):
    stop_id = greedy_ref.token_ids[5]
    first = greedy_ref.token_ids.index(stop_id)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                              stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == greedy_ref.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # As vLLM: the stop token's text is not in the output text unless asked for.
    tok = llm.tokenizer
    assert out.text == tok.decode(greedy_ref.token_ids[:first], skip_special_tokens=True)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                              stop_token_ids=[stop_id],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert out.text == tok.decode(greedy_ref.token_ids[:first + 1], skip_special_tokens=True)


def _token_texts(tok, ids):
    return [tok.decode(ids[:i + 1]) for i in range(len(ids))]


def test_stop_string_split_across_two_tokens(llm, greedy_ref):
    tok = llm.tokenizer
    ids = greedy_ref.token_ids
    full = tok.decode(ids, skip_special_tokens=True)
    assert full == greedy_ref.text
    prefixes = _token_texts(tok, ids)
    # Find a boundary between tokens k and k+1, each contributing >= 1 char, such that a
    # 2-4 char string straddling it first occurs there.
    for k in range(3, len(ids) - 2):
        cut = len(prefixes[k])
        if cut < 2 or len(prefixes[k + 1]) - cut < 1 or len(prefixes[k]) - len(prefixes[k - 1]) < 1:
            continue
        stop = full[cut - 1:cut + 1]
        if full.find(stop) == cut - 1 and "\ufffd" not in stop:
            break
    else:
        pytest.fail("no token boundary to test on")
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                              stop=[stop]))[0].outputs[0]
    assert out.text == full[:cut - 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # The engine stopped as soon as the string was complete: at token k+1.
    assert out.token_ids == ids[:k + 2]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                              stop=[stop], include_stop_str_in_output=True)
                       )[0].outputs[0]
    assert out.text == full[:cut + 1]


def test_stop_string_not_found_runs_to_length(llm, greedy_ref):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                              stop=["\u2603never\u2603"]))[0].outputs[0]
    assert out.text == greedy_ref.text and out.finish_reason == "length"


def test_eos_stops_and_ignore_eos_does_not(model_dir, greedy_ref, tmp_path):
    eos = greedy_ref.token_ids[3]
    first = greedy_ref.token_ids.index(eos)
    llm = LLM(with_eos(model_dir, tmp_path, eos), dtype="float32", device="cpu",
              num_kv_blocks=64)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=48, temperature=0))[0].outputs[0]
    assert out.token_ids == greedy_ref.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0,
                                              ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy_ref.token_ids[:20] and out.finish_reason == "length"
    # min_tokens: EOS cannot be produced before min_tokens tokens.
    out = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0,
                                              min_tokens=first + 3))[0].outputs[0]
    assert len(out.token_ids) >= first + 3
    assert eos not in out.token_ids[:first + 3]
    assert out.token_ids[:first] == greedy_ref.token_ids[:first]


def test_logprobs_match_hf_log_softmax(llm, model_dir, greedy_ref):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                              logprobs=3))[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 6
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + comp.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    n = len(out.prompt_token_ids)
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[n - 1 + i]
        assert len(lp) == 3                        # greedy: the sampled token is the top-1
        assert lp[tok].rank == 1
        top = torch.topk(row, 3)
        assert list(lp) == top.indices.tolist()
        for tid, entry in lp.items():
            assert entry.logprob == pytest.approx(row[tid].item(), abs=1e-4)
            assert entry.decoded_token == llm.tokenizer.decode([tid])


def test_seed_gives_same_output_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    rng = random.Random(0)
    others = [SamplingParams(max_tokens=rng.randint(4, 20), temperature=0.8,
                             seed=rng.choice([None, rng.randrange(1000)]), ignore_eos=True)
              for _ in range(15)]
    prompts = [f"Story number {i}: " + "la " * i for i in range(15)]
    batch = llm.generate(prompts[:7] + [PROMPT] + prompts[7:], others[:7] + [params] + others[7:])
    assert batch[7].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9,
                                                     seed=99, ignore_eos=True))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_seeded_output_survives_preemption(model_dir):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    prompts = [[(i * 37 + j) % 900 + 3 for j in range(60 + 10 * i)] for i in range(8)]
    big = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=256)
    small = LLM(model_dir, dtype="float32", device="cpu", num_kv_blocks=20, block_size=16,
                max_model_len=256, max_num_batched_tokens=64)
    a = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.get_stats().num_preemptions > 0
    assert a == b


def test_streamed_text_never_breaks_utf8(llm):
    # Prompts of multi-byte characters make the model emit byte-level pieces of them.
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    outs = llm.generate(["日本語のテキスト 中文 ", "Zürich naïve café — Ελληνικά 🙂"], params)
    for o in outs:
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids,
                                                         skip_special_tokens=True)


def test_repetition_penalty_matches_hf(llm, model_dir):
    """HF's repetition penalty covers prompt and output tokens, as ours does."""
    prompt = llm.tokenizer.encode(PROMPT)
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                repetition_penalty=1.5))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=16, min_new_tokens=16, repetition_penalty=1.5)
    assert out.token_ids == gen[0, len(prompt):].tolist()
    plain = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                  ignore_eos=True))[0].outputs[0]
    assert plain.token_ids != out.token_ids          # the penalty did something
