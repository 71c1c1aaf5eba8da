import pytest

from engine.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.stop == [] and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_stop_string_becomes_list_and_top_k_minus_one_is_off():
    p = SamplingParams(stop="###", top_k=-1)
    assert p.stop == ["###"] and p.top_k == 0


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
    ("repetition_penalty", 0.0, "> 0"),
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
