import math

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers
from transformers import PreTrainedTokenizerFast

from engine.sampling_params import (CHILD_SEED_FOR_MINUS_ONE, FLOAT32_MAX, MAX_ALLOWED_TOKEN_IDS,
                                    MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_CHARS,
                                    MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams)


def test_defaults():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.stop == [] and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_stop_string_becomes_list_and_top_k_minus_one_is_off():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0


def test_a_top_k_below_minus_one_is_refused_as_in_vllm():
    for off in (-1, 0):
        assert SamplingParams(top_k=off).top_k == 0
    with pytest.raises(ValueError, match=r"top_k must be -1 or 0 \(no top-k\) or a positive "
                                         r"integer, got -5"):
        SamplingParams(top_k=-5)


def test_max_tokens_none_is_no_limit_and_json_null_is_the_default_elsewhere():
    """vLLM: max_tokens None runs until the context ends. Triton's vLLM backend reads a null
    sampling parameter as the key's default."""
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None
    p = SamplingParams.from_json('{"max_tokens": null, "temperature": null, "top_k": null, '
                                 '"stop": null, "seed": null, "logprobs": null, "ignore_eos": null}')
    assert p == SamplingParams(max_tokens=None)
    assert SamplingParams.from_json('{"temperature": null}') == SamplingParams()
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_json('{"temperture": null}')       # a misspelt key stays an error


def test_a_top_k_beyond_int32_keeps_every_token_as_int32_max():
    assert SamplingParams(top_k=10**30).top_k == SamplingParams(top_k=2**31).top_k == 2**31 - 1


@pytest.mark.parametrize("field,value,hint", [
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", 2.5, "integer"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", "hot", "number"),
    ("top_p", 0.0, "> 0"),
    ("top_p", 1.5, "<= 1"),
    ("top_k", 1.5, "integer"),
    ("min_p", 1.2, "<= 1"),
    ("seed", "x", "integer"),
    ("stop", [""], "non-empty"),
    ("stop_token_ids", [-1], "non-negative"),
    ("ignore_eos", 1, "true or false"),
    ("min_tokens", -1, ">= 0"),
    ("repetition_penalty", 0.0, ">= 1.17"),
    ("presence_penalty", 3.0, "<= 2"),
    ("frequency_penalty", -3.0, ">= -2"),
    ("logprobs", 21, "<= 20"),
    ("logprobs", -1, ">= 0"),
])
def test_bad_values_name_the_field(field, value, hint):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value) and hint in str(e.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_from_json_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError) as e:
        SamplingParams.from_json('{"max_tokens": 4, "temprature": 0.5}')
    assert "temprature" in str(e.value) and "temperature" in str(e.value)


def test_from_json_bad_json():
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams.from_json('{"max_tokens": ')


def test_from_json_ok():
    p = SamplingParams.from_json('{"max_tokens": 4, "temperature": 0, "stop": ["x"]}')
    assert p.max_tokens == 4 and p.greedy and p.stop == ["x"]


FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_nan_and_infinity_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value,hint", [
    # Beyond float32 (the sampler's type) these became inf, or 0 to divide by.
    ("temperature", 1e308, f"<= {FLOAT32_MAX}"),
    ("temperature", 10**400, f"<= {FLOAT32_MAX}"),
    ("repetition_penalty", 1e308, f"<= {FLOAT32_MAX}"),
    ("repetition_penalty", 1e-308, ">= 1.17"),
    ("seed", 2**64, "<= 9223372036854775807"),
    ("seed", -(2**63) - 1, ">= -9223372036854775808"),
    ("logprobs", 10**6, f"<= {MAX_LOGPROBS}"),
    ("stop", ["x"] * 10_000, f"at most {MAX_STOP_STRINGS}"),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)], f"1 to {MAX_STOP_STRING_CHARS} characters"),
    ("stop", {"a": 1}, "a string or a list of strings"),
    ("stop", 5, "a string or a list of strings"),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), f"at most {MAX_STOP_TOKEN_IDS}"),
    ("stop_token_ids", "12", "a list of token ids"),
    ("stop_token_ids", [1.5], "non-negative integers"),
    ("top_k", "abc", "integer"),
    ("max_tokens", "64", "integer"),
    ("logit_bias", [1, 2], "an object of token id -> bias"),
    ("logit_bias", {"x": 1.0}, "non-negative token ids"),
    ("logit_bias", {-1: 1.0}, "non-negative token ids"),
    ("logit_bias", {"٣": 1.0}, "non-negative token ids"),      # digits, but not ASCII ones
    ("logit_bias", {1: 100.5}, ">= -100.0 and <= 100.0"),
    ("logit_bias", {1: -1e30}, ">= -100.0 and <= 100.0"),
    ("logit_bias", {1: "2"}, "must be a number"),
    ("logit_bias", {1: 1.0, "1": 2.0}, "names token id 1 twice"),
    ("logit_bias", {i: 0.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS}"),
    ("allowed_token_ids", [], "at least one token id"),
    ("allowed_token_ids", [3, -3], "non-negative integers"),
    ("allowed_token_ids", 5, "a list of token ids"),
    ("allowed_token_ids", list(range(MAX_ALLOWED_TOKEN_IDS + 1)), f"at most {MAX_ALLOWED_TOKEN_IDS}"),
])
def test_limits_name_the_field_and_the_range(field, value, hint):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field) and hint in str(e.value), str(e.value)
    assert len(str(e.value)) < 200                  # a huge value is not echoed back whole


def test_values_at_the_limits_are_accepted():
    p = SamplingParams(temperature=FLOAT32_MAX, repetition_penalty=FLOAT32_MAX, seed=2**63 - 1,
                       logprobs=MAX_LOGPROBS, stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                       stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    assert len(p.stop) == MAX_STOP_STRINGS and p.seed == 2**63 - 1
    # No upper bound on max_tokens: a request also ends at the model's max_model_len.
    assert SamplingParams(max_tokens=10**12, min_tokens=10**12).max_tokens == 10**12


HOSTILE_VALUES = [None, True, -1, 0, 10**30, -(10**30), 1e308, -1e308, math.nan, math.inf, "",
                  "abc", "1", [], [None], ["a"] * 100, [-1], [10**30], {}, {"a": [1]}, [[1]]]


@pytest.mark.parametrize("field", [f for f in SamplingParams.field_names()])
def test_hostile_values_give_a_value_error_naming_the_field_or_a_valid_object(field):
    for value in HOSTILE_VALUES:
        try:
            p = SamplingParams(**{field: value})
        except ValueError as e:
            assert field in str(e), (value, str(e))
        else:
            p.validate()                                 # what was accepted is consistent


@pytest.mark.parametrize("text,needle", [
    ("[1, 2]", "JSON object ({\"key\": value, ...}), got an array"),
    ("null", "got null"),
    ('"max_tokens"', "got a string"),
    ("[" * 100_000, "nested too deeply"),
    ('{"a": ' * 100_000, "nested too deeply"),
    ('{"max_tokens": ' + "9" * 5000 + "}", "cannot be read"),
])
def test_from_json_refuses_what_is_not_an_object(text, needle):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_json(text)
    assert str(e.value).startswith("sampling_parameters") and needle in str(e.value)


def test_from_json_nan_is_refused_by_field():
    with pytest.raises(ValueError, match="^temperature must be a finite number, got nan"):
        SamplingParams.from_json('{"temperature": NaN}')


def test_many_unknown_keys_are_listed_briefly():
    text = "{" + ", ".join(f'"k{i}": 1' for i in range(10_000)) + "}"
    with pytest.raises(ValueError) as e:
        SamplingParams.from_json(text)
    assert "and 9995 more" in str(e.value) and len(str(e.value)) < 1000


def test_numpy_scalars_are_the_numbers_they_hold():
    """vLLM takes NumPy scalars; they used to be refused as 'must be an integer, got 8'."""
    import numpy as np
    p = SamplingParams(max_tokens=np.int64(8), temperature=np.float64(0.5), top_k=np.int32(4),
                       seed=np.uint16(3), stop_token_ids=[np.int64(5), 6],
                       ignore_eos=np.bool_(True), logprobs=np.int8(2))
    assert p == SamplingParams(max_tokens=8, temperature=0.5, top_k=4, seed=3,
                               stop_token_ids=[5, 6], ignore_eos=True, logprobs=2)
    assert all(type(v) in (int, float, bool) for v in
               (p.max_tokens, p.temperature, p.top_k, p.seed, p.ignore_eos, p.logprobs,
                *p.stop_token_ids))
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=np.int64(0))


def test_n_completions_are_children_seeded_seed_plus_k():
    assert SamplingParams(n=1) == SamplingParams()
    assert SamplingParams.from_json('{"n": 3, "max_tokens": 3}').n == 3
    p = SamplingParams(n=3, seed=10, temperature=0.5)
    assert [p.child(k) for k in range(3)] == [SamplingParams(seed=10 + k, temperature=0.5)
                                              for k in range(3)]
    assert SamplingParams(n=2).child(1) == SamplingParams()           # unseeded stays so
    assert SamplingParams(n=2, seed=2**63 - 1).child(1).seed == -(2**63)   # int64 wraps
    # seed + k = -1 would read as "no seed" (vLLM's spelling), and the completion would come
    # out differently each time (found by review): it is seeded all the same.
    children = [SamplingParams(n=3, seed=-2).child(k) for k in range(3)]
    assert [c.seed for c in children] == [-2, CHILD_SEED_FOR_MINUS_ONE, 0]
    assert children[1].clone().seed == CHILD_SEED_FOR_MINUS_ONE
    for bad in (0, MAX_N + 1):
        with pytest.raises(ValueError, match=f"n must be"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=1.5)


def test_vllms_seed_minus_one_and_logprobs_true_read_as_vllm_reads_them():
    """vLLM's SamplingParams: seed -1 is no seed; logprobs=True is 1."""
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2
    assert SamplingParams(logprobs=True).logprobs == 1


def test_vllms_spellings_set_after_building_are_taken_by_validate():
    """The engine checks a request's parameters again as it takes them (validate()): the
    spellings the constructor takes, set on the object later, mean the same there."""
    sp = SamplingParams()
    sp.top_k, sp.stop, sp.stop_token_ids, sp.logprobs, sp.seed = -1, "end", None, True, -1
    sp.validate()
    assert (sp.top_k, sp.stop, sp.stop_token_ids, sp.logprobs, sp.seed) == (0, ["end"], [], 1, None)


def test_logit_bias_takes_json_string_keys_and_a_copy_of_the_callers_values():
    """OpenAI's API and JSON send logit_bias keys as strings: they are the ids they spell. A
    request keeps its own copies (clone), which the caller's later changes do not reach."""
    p = SamplingParams.from_json('{"logit_bias": {"50256": -100, " 7 ": 2.5}, '
                                 '"allowed_token_ids": [1, 2]}')
    assert p.logit_bias == {50256: -100, 7: 2.5} and p.allowed_token_ids == [1, 2]
    bias, allowed = {np.int64(3): np.float32(0.5)}, [np.int32(4)]
    q = SamplingParams(logit_bias=bias, allowed_token_ids=allowed)
    assert q.logit_bias == {3: 0.5} and type(next(iter(q.logit_bias))) is int
    assert q.allowed_token_ids == [4] and type(q.allowed_token_ids[0]) is int
    kept = q.clone()
    q.logit_bias[3] = 99.0
    q.allowed_token_ids.append(5)
    assert kept.logit_bias == {3: 0.5} and kept.allowed_token_ids == [4]
    # null is the default (no controls); an empty bias is no bias.
    assert SamplingParams.from_json('{"logit_bias": null, "allowed_token_ids": null}').logit_bias is None
    assert SamplingParams(logit_bias={}).logit_bias == {}
    assert SamplingParams(logit_bias={1: 100, 2: -100.0},
                          allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS))).logit_bias == {1: 100, 2: -100.0}


# Found by a mutation review: validation edges the suite left open.
@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
@pytest.mark.parametrize("value", [[True], [5, False]])
def test_booleans_are_not_token_ids(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be non-negative integers"):
        SamplingParams(**{field: value})


def test_one_stop_string_past_the_cap_is_refused():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))


def _llama2_style_tokenizer():
    """Llama-2's structure in a small vocabulary: '▁' put before the text and for spaces, byte
    fallback for what the vocabulary lacks."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


def test_a_256_character_bad_word_is_taken_from_a_sentencepiece_tokenizer():
    """The longest word the limits allow, 256 four-byte characters, spelt with byte fallback and
    a SentencePiece '▁' before it (Llama-2, Mistral): 1,025 ids, taken (found by review: it was
    refused naming the internal field)."""
    tok = _llama2_style_tokenizer()
    assert tok.encode("\U0001F600", add_special_tokens=False) == [3, 0xF0 + 4, 0x9F + 4,
                                                                   0x98 + 4, 0x80 + 4]
    word = "\U0001F600" * 256          # 256 characters: within the README's bad_words limits
    params = SamplingParams(bad_words=[word])
    params.tokenize_bad_words(tok)      # vLLM takes it
    assert params.bad_words_token_ids[0][-1] == 0x80 + 4
