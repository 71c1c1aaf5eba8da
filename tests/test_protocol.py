import json

import numpy as np
import pytest

from engine.outputs import CompletionOutput, RequestOutput
from engine.protocol import bls_inner_inputs, make_response, parse_request


def s(text):
    return np.array([text.encode() if isinstance(text, str) else text], dtype=np.object_)


def b(v):
    return np.array([v])


def test_text_prompt_and_defaults():
    req = parse_request({"text_input": s("hi")})
    assert req.prompt == "hi" and not req.stream and req.params.max_tokens == 16


def test_input_ids_prompt():
    req = parse_request({"input_ids": np.array([1, 2, 3], dtype=np.int32)})
    assert req.prompt == [1, 2, 3]


def test_flags_and_sampling_parameters():
    req = parse_request({"text_input": s("x"), "stream": b(True),
                         "sampling_parameters": s('{"max_tokens": 4, "temperature": 0}'),
                         "return_finish_reason": b(True)})
    assert req.stream and req.return_finish_reason and req.params.max_tokens == 4
    assert req.params.greedy


def test_numbers_as_strings_are_accepted():
    req = parse_request({"text_input": s("x"), "sampling_parameters": s(
        '{"max_tokens": "4", "temperature": "0.5", "ignore_eos": "true", "stop": ["a"]}')})
    assert req.params.max_tokens == 4 and req.params.temperature == 0.5
    assert req.params.ignore_eos is True


@pytest.mark.parametrize("inputs,needle", [
    ({}, "text_input"),
    ({"text_input": s("")}, "text_input"),
    ({"text_input": s(b"\xff\xfe")}, "UTF-8"),
    ({"text_input": s("x"), "sampling_parameters": s("{bad")}, "not valid JSON"),
    ({"text_input": s("x"), "sampling_parameters": s("[1]")}, "JSON object"),
    ({"text_input": s("x"), "sampling_parameters": s('{"n": 2}')}, "unknown sampling parameter"),
    ({"text_input": s("x"), "sampling_parameters": s('{"temperature": -1}')}, "temperature"),
    ({"text_input": s("x"), "sampling_parameters": s('{"max_tokens": "1.5"}')}, "max_tokens"),
    ({"text_input": s("x"), "stream": np.array([1], dtype=np.int32)}, "stream"),
    ({"input_ids": np.array([1.5])}, "input_ids"),
])
def test_bad_inputs_name_the_problem(inputs, needle):
    with pytest.raises(ValueError, match=needle):
        parse_request(inputs)


def test_bls_scalars_override_json_and_force_one_response():
    inner = bls_inner_inputs({
        "text_input": s("x"), "stream": b(True),
        "sampling_parameters": s('{"max_tokens": 4, "top_k": 3}'),
        "max_tokens": np.array([9], dtype=np.int32),
        "temperature": np.array([0.25], dtype=np.float32),
        "stop_words": np.array([b"END", b"\n\n"], dtype=np.object_)})
    params = json.loads(inner["sampling_parameters"][0])
    assert params == {"max_tokens": 9, "top_k": 3, "temperature": 0.25, "stop": ["END", "\n\n"]}
    assert inner["stream"][0] == np.False_ and "max_tokens" not in inner
    assert parse_request(inner).params.max_tokens == 9


def _out(finished=True):
    return RequestOutput("r", "Hello", [1, 2, 3],
                         [CompletionOutput(0, " world", [7, 8], "length" if finished else None)],
                         finished)


def test_response_non_streaming_includes_prompt_unless_excluded():
    req = parse_request({"text_input": s("Hello"), "return_finish_reason": b(True),
                         "return_num_input_tokens": b(True),
                         "return_num_output_tokens": b(True), "return_output_ids": b(True)})
    t = make_response(req, _out(), " world", [7, 8], None, 2)
    assert t["text_output"][0] == b"Hello world"
    assert t["finish_reason"][0] == b"length"
    assert t["num_input_tokens"][0] == 3 and t["num_output_tokens"][0] == 2
    assert t["output_ids"].tolist() == [7, 8] and t["output_ids"].dtype == np.int32
    req.exclude_input_in_output = True
    assert make_response(req, _out(), " world", [7, 8], None, 2)["text_output"][0] == b" world"


def test_streaming_response_carries_only_new_text_and_reason_at_the_end():
    req = parse_request({"text_input": s("Hello"), "stream": b(True),
                         "return_finish_reason": b(True)})
    t = make_response(req, _out(finished=False), " wor", [7], None, 1)
    assert t["text_output"][0] == b" wor" and "finish_reason" not in t
