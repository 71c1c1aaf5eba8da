import json

import numpy as np
import pytest

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.protocol import (MAX_INPUT_IDS, MAX_SAMPLING_PARAMETERS_BYTES, MAX_TEXT_INPUT_BYTES,
                             REQUEST_PARAMETERS, OUTPUT_NAMES, bls_inner_inputs,
                             bls_inner_outputs, error_code, make_response,
                             parse_request, tag_error_kind, untag_error_kind,
                             with_request_parameters)
from engine.sampling_params import MAX_STOP_STRINGS


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


def test_whole_numbers_written_as_floats_are_integers():
    """Python's json writes a float max_tokens as 64.0; vLLM's OpenAI server and its Triton
    backend take it. A fraction stays an error naming the field."""
    req = parse_request({"text_input": s("x"), "sampling_parameters": s(
        '{"max_tokens": 8.0, "top_k": "4.0", "seed": 3.0, "n": 2.0, "min_tokens": 1e0}')})
    p = req.params
    assert (p.max_tokens, p.top_k, p.seed, p.n, p.min_tokens) == (8, 4, 3, 2, 1)
    assert all(type(v) is int for v in (p.max_tokens, p.top_k, p.seed, p.n, p.min_tokens))
    for bad in ('{"max_tokens": 8.5}', '{"top_k": "4.5"}', '{"seed": Infinity}'):
        with pytest.raises(ValueError, match="must be an integer"):
            parse_request({"text_input": s("x"), "sampling_parameters": s(bad)})


@pytest.mark.parametrize("inputs,needle", [
    ({}, "text_input"),
    ({"text_input": s("")}, "text_input"),
    ({"text_input": s(b"\xff\xfe")}, "UTF-8"),
    ({"text_input": s("x"), "sampling_parameters": s("{bad")}, "not valid JSON"),
    ({"text_input": s("x"), "sampling_parameters": s("[1]")}, "JSON object"),
    ({"text_input": s("x"), "sampling_parameters": s('{"best_of": 2}')},
     "unknown sampling parameter"),
    ({"text_input": s("x"), "sampling_parameters": s('{"n": 0}')}, "n must be >= 1"),
    ({"text_input": s("x"), "sampling_parameters": s('{"temperature": -1}')}, "temperature"),
    ({"text_input": s("x"), "sampling_parameters": s('{"max_tokens": "1.5"}')}, "max_tokens"),
    ({"text_input": s("x"), "stream": np.array([1], dtype=np.int32)}, "stream"),
    ({"input_ids": np.array([1.5])}, "input_ids"),
    ({"input_ids": np.array([], dtype=np.int32)}, "input_ids is empty"),
    ({"input_ids": np.zeros(MAX_INPUT_IDS + 1, dtype=np.int32)}, f"at most {MAX_INPUT_IDS}"),
    ({"input_ids": np.array([1], dtype=np.int32), "text_input": s("x")},
     "text_input or input_ids, not both"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)},
     "text_input must hold exactly one value, got 2"),
    ({"text_input": s(b"x" * (MAX_TEXT_INPUT_BYTES + 1))},
     f"text_input is {MAX_TEXT_INPUT_BYTES + 1} bytes long; at most {MAX_TEXT_INPUT_BYTES}"),
    ({"text_input": s("x"), "sampling_parameters": s(" " * (MAX_SAMPLING_PARAMETERS_BYTES + 1))},
     "sampling_parameters is"),
    ({"text_input": s("x"), "sampling_parameters": s("null")}, "JSON object"),
    ({"text_input": s("x"), "sampling_parameters": s("[" * 100_000)}, "nested too deeply"),
    ({"text_input": s("x"), "sampling_parameters": s('{"top_p": NaN}')},
     "top_p must be a finite number"),
    ({"text_input": s("x"), "sampling_parameters": s('{"temperature": "inf"}')},
     "temperature must be a finite number"),
    ({"text_input": s("x"), "sampling_parameters": s('{"top_k": "abc"}')}, "top_k"),
    ({"text_input": s("x"), "sampling_parameters": s('{"seed": ' + str(2**64) + "}")}, "seed"),
])
def test_bad_inputs_name_the_problem(inputs, needle):
    with pytest.raises(ValueError, match=needle):
        parse_request(inputs)


def test_large_numbers_that_fit_are_kept():
    req = parse_request({"input_ids": np.array([7], dtype=np.int32), "sampling_parameters": s(
        '{"max_tokens": 1000000000000, "top_k": 100000000000000000000}')})
    assert req.prompt == [7] and req.params.max_tokens == 10**12


HOSTILE_TENSORS = [
    np.array([], dtype=np.object_), np.array([b"a", b"b"], dtype=np.object_),
    np.array([[b"a"]], dtype=np.object_), np.array([None], dtype=np.object_),
    np.array([1.5]), np.array([np.nan]), np.array([True]), np.array([2**31 - 1], np.int32),
    np.array([-1], np.int64), np.array([b"\xff"], dtype=np.object_),
    np.array(["text"], dtype=np.object_), np.array([b"[1]"], dtype=np.object_),
    np.array([b'{"stop": [1, 2]}'], dtype=np.object_), np.array([3], dtype=np.uint64),
]


@pytest.mark.parametrize("name", ["text_input", "input_ids", "sampling_parameters", "stream",
                                  "return_logprobs", REQUEST_PARAMETERS, "stop_words",
                                  "bad_words"])
def test_any_tensor_in_any_input_is_parsed_or_a_value_error(name):
    """The server answers only ValueErrors with an error response: nothing else may escape."""
    for arr in HOSTILE_TENSORS:
        inputs = {"text_input": s("x"), name: arr}
        if name == "input_ids":
            del inputs["text_input"]
        try:
            parse_request(inputs)
        except ValueError:
            pass
        try:
            bls_inner_inputs(inputs)
        except ValueError:
            pass


@pytest.mark.parametrize("inputs,needle", [
    ({"text_input": s("x"), "temperature": np.array([np.nan], dtype=np.float32)},
     "temperature must be a finite number"),
    ({"text_input": s("x"), "max_tokens": np.array([-5], dtype=np.int32)}, "max_tokens"),
    ({"text_input": s("x"), "stop_words": np.array([b"w"] * (MAX_STOP_STRINGS + 1),
                                                   dtype=np.object_)},
     f"stop_words holds {MAX_STOP_STRINGS + 1} strings"),
    ({"text_input": s(b"x" * (MAX_TEXT_INPUT_BYTES + 1))}, "text_input is"),
    ({"input_ids": np.array([1], dtype=np.int32), "text_input": s("x")}, "not both"),
])
def test_bls_refuses_what_llm_would_refuse_before_forwarding_it(inputs, needle):
    with pytest.raises(ValueError, match=needle):
        bls_inner_inputs(inputs)


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


def test_llm_bls_asks_llm_only_for_the_outputs_llm_sends_for_the_request():
    """llm_bls asked llm for every output its client asked for, which is all of llm_bls's where
    the client names none: an llm config without one of them (trimmed on one side) failed every
    llm_bls request, even those whose flags never ask for it."""
    plain = bls_inner_inputs({"text_input": s("x")})
    assert bls_inner_outputs(plain, list(OUTPUT_NAMES)) == ["text_output"]
    flagged = bls_inner_inputs({"text_input": s("x"), "return_logprobs": b(True),
                                "return_finish_reason": b(True)})
    assert bls_inner_outputs(flagged, list(OUTPUT_NAMES)) == ["text_output", "finish_reason",
                                                              "logprobs"]
    assert bls_inner_outputs(flagged, ["logprobs"]) == ["logprobs"]
    # Only outputs llm will not send: llm is asked for its text, which the server then drops.
    assert bls_inner_outputs(plain, ["finish_reason"]) == ["text_output"]
    by_parameter = bls_inner_inputs(with_request_parameters(
        {"text_input": s("x")}, '{"return_num_output_tokens": true}'))
    assert bls_inner_outputs(by_parameter, list(OUTPUT_NAMES)) == ["text_output",
                                                                   "num_output_tokens"]


def test_request_parameters_are_sampling_parameters_and_flags_under_the_inputs():
    """Triton's generate endpoint puts its "parameters" object (and any key that is not an
    input) into the request's parameters, where Triton's vLLM backend reads its sampling
    parameters when the sampling_parameters input is absent."""
    req = parse_request(with_request_parameters(
        {"text_input": s("x")},
        '{"temperature": 0, "max_tokens": "3", "stream": true, "return_finish_reason": "true"}'))
    assert req.params.greedy and req.params.max_tokens == 3
    assert req.stream and req.return_finish_reason
    # The inputs win where both say something; the rest is merged.
    req = parse_request(with_request_parameters(
        {"text_input": s("x"), "sampling_parameters": s('{"max_tokens": 5}'), "stream": b(False)},
        '{"max_tokens": 3, "top_k": 7, "stream": true}'))
    assert req.params.max_tokens == 5 and req.params.top_k == 7 and not req.stream
    assert REQUEST_PARAMETERS not in with_request_parameters({"text_input": s("x")}, "{}")
    assert REQUEST_PARAMETERS not in with_request_parameters({"text_input": s("x")}, "")


@pytest.mark.parametrize("parameters,needle", [
    ('{"bogus_key": 1, "temperature": 0}', r"unknown request parameter\(s\) \['bogus_key'\]"),
    ('{"min_p": 2.0}', "min_p"),
    ('{"stream": 1}', "parameters: stream must be true or false, got 1"),
    ('{"temperature": 0', "parameters is not valid JSON"),
    ('[1]', "parameters must be a JSON object"),
])
def test_bad_request_parameters_are_named(parameters, needle):
    for parse in (parse_request, bls_inner_inputs):
        with pytest.raises(ValueError, match=needle):
            parse(with_request_parameters({"text_input": s("x")}, parameters))


def test_beside_sampling_parameters_unknown_request_parameters_are_left_alone():
    """Where the sampling_parameters input is given, the vLLM backend ignores the request's
    parameters: a key that is neither a sampling parameter nor a flag (e.g. a header the server
    forwards) is left alone there; the known ones still count."""
    inputs = with_request_parameters(
        {"text_input": s("x"), "sampling_parameters": s('{"max_tokens": 5}')},
        '{"x-request-id": "abc", "top_k": 7, "return_finish_reason": true}')
    for req in (parse_request(inputs), parse_request(bls_inner_inputs(inputs))):
        assert req.params.max_tokens == 5 and req.params.top_k == 7 and req.return_finish_reason


def test_bls_folds_the_request_parameters_into_llms_inputs():
    inner = bls_inner_inputs(with_request_parameters(
        {"text_input": s("x"), "sampling_parameters": s('{"top_k": 3}'),
         "max_tokens": np.array([9], dtype=np.int32)},
        '{"max_tokens": 2, "temperature": 0, "top_k": 1, "return_finish_reason": true}'))
    assert REQUEST_PARAMETERS not in inner
    assert json.loads(inner["sampling_parameters"][0]) == {"max_tokens": 9, "temperature": 0,
                                                           "top_k": 3}
    assert inner["return_finish_reason"][0] == np.True_
    req = parse_request(inner)
    assert req.return_finish_reason and req.params.greedy and req.params.max_tokens == 9


def test_a_stream_carries_no_prompt_and_llm_bls_answers_with_the_streams_text():
    """Triton's vLLM backend: a stream's responses carry only new text (asking for the prompt
    is an error). llm_bls answers a stream=true request with one response: the stream's text,
    joined, so no prompt unless exclude_input_in_output says otherwise."""
    for parse in (parse_request, bls_inner_inputs):
        with pytest.raises(ValueError, match="exclude_input_in_output=false is not allowed with "
                                             "stream=true"):
            parse({"text_input": s("x"), "stream": b(True), "exclude_input_in_output": b(False)})
    assert not parse_request({"text_input": s("x"), "stream": b(False),
                              "exclude_input_in_output": b(False)}).exclude_input_in_output
    inner = bls_inner_inputs({"text_input": s("x"), "stream": b(True)})
    req = parse_request(inner)
    assert not req.stream and req.exclude_input_in_output
    inner = bls_inner_inputs(with_request_parameters({"text_input": s("x")}, '{"stream": true}'))
    assert parse_request(inner).exclude_input_in_output
    for inputs in ({"text_input": s("x")}, {"text_input": s("x"), "stream": b(False)}):
        assert not parse_request(bls_inner_inputs(inputs)).exclude_input_in_output


def test_stop_words_are_checked_by_their_name_and_added_to_stop():
    inner = bls_inner_inputs({"text_input": s("x"), "sampling_parameters": s('{"stop": "A"}'),
                              "stop_words": np.array([b"B", b"A"], dtype=np.object_)})
    assert parse_request(inner).params.stop == ["A", "B"]
    inner = bls_inner_inputs({"text_input": s("x"), "sampling_parameters": s('{"stop": ["A"]}'),
                              "stop_words": np.array([b"C"], dtype=np.object_)})
    assert parse_request(inner).params.stop == ["A", "C"]
    for words, needle in (([b"w" * 300], "stop_words must be strings of at most 256 "
                                         "characters, got one of 300"),
                          ([b"w%d" % i for i in range(MAX_STOP_STRINGS)],
                           f"stop and stop_words hold {MAX_STOP_STRINGS + 1} strings together")):
        with pytest.raises(ValueError, match=needle):
            bls_inner_inputs({"text_input": s("x"), "sampling_parameters": s('{"stop": "A"}'),
                              "stop_words": np.array(words, dtype=np.object_)})
    with pytest.raises(ValueError, match="stop must be a string or a list"):
        bls_inner_inputs({"text_input": s("x"), "sampling_parameters": s('{"stop": 5}'),
                          "stop_words": np.array([b"B"], dtype=np.object_)})


@pytest.mark.parametrize("words", [[b""], [b"", b""], np.array(b"")])
def test_empty_stop_words_are_skipped_as_tensorrt_llm_does(words):
    """TensorRT-LLM's README sends `"stop_words": ""` and its preprocessing skips empty words."""
    inner = bls_inner_inputs({"text_input": s("x"), "sampling_parameters": s('{"stop": "A"}'),
                              "stop_words": np.array(words, dtype=np.object_)})
    assert parse_request(inner).params.stop == ["A"]
    inner = bls_inner_inputs({"text_input": s("x"),
                              "stop_words": np.array([b"", b"B"], dtype=np.object_)})
    assert parse_request(inner).params.stop == ["B"]


def test_bad_words_are_checked_by_their_name_and_added_to_bad_words():
    """TensorRT-LLM's bad_words input joins the JSON's bad_words (vLLM's) as stop_words joins
    stop; empty words mean none (its README's request sends `"bad_words": ""`)."""
    for words in ([b""], [b"", b""], b""):
        inner = bls_inner_inputs({"text_input": s("x"), "max_tokens": np.array([20], np.int32),
                                  "bad_words": np.array(words, dtype=np.object_),
                                  "stop_words": np.array([b""], dtype=np.object_)})
        assert "bad_words" not in inner
        req = parse_request(inner)
        assert req.params.max_tokens == 20 and req.params.bad_words == []
    inner = bls_inner_inputs({"text_input": s("x"), "sampling_parameters": s('{"bad_words": ["A"]}'),
                              "bad_words": np.array([b"", b"evil", b"A"], dtype=np.object_)})
    assert parse_request(inner).params.bad_words == ["A", "evil"]
    for words, needle in (([b"w" * 300], "bad_words must be strings of at most 256 characters"),
                          ([b"w%d" % i for i in range(MAX_STOP_STRINGS + 1)],
                           f"bad_words holds {MAX_STOP_STRINGS + 1} strings"),
                          ([b"  "], "bad_words must be a list of strings that are not blank")):
        with pytest.raises(ValueError, match=needle):
            bls_inner_inputs({"text_input": s("x"), "bad_words": np.array(words, dtype=np.object_)})


@pytest.mark.parametrize("inputs,parameters", [
    ({"sampling_parameters": s("{oops")}, None),                    # and bad JSON
    ({"exclude_input_in_output": b(True)}, '{"max_tokenz": 4}'),    # and a misspelt parameter
    ({"max_tokens": np.array([-5], np.int32)}, None),               # and a bad scalar input
    ({"stop_words": np.array([b"w" * 300], dtype=np.object_)}, None),
    ({"bad_words": np.array([b"w" * 300], dtype=np.object_)}, None),
    ({"input_ids": np.array([], np.int32), "sampling_parameters": s("{oops")}, None),
], ids=["bad-json", "unknown-parameter", "bad-scalar", "long-stop-word", "long-bad-word",
        "empty-input-ids"])
def test_a_request_without_a_prompt_gets_llms_error_from_llm_bls(inputs, parameters):
    """Both check the prompt first: a request with several faults is told the same one."""
    inputs = with_request_parameters(inputs, parameters)
    with pytest.raises(ValueError) as llm:
        parse_request(inputs)
    with pytest.raises(ValueError) as bls:
        bls_inner_inputs(inputs)
    assert str(bls.value) == str(llm.value)
    assert "missing input: give text_input" in str(llm.value) or "input_ids is empty" in str(
        llm.value)


def test_logprobs_go_out_in_the_vllm_backends_layout():
    req = parse_request({"text_input": s("Hello"), "return_logprobs": b(True)})
    steps = [{7: Logprob(-0.5, 2, " wor"), 3: Logprob(-0.25, 1, "x")}, {8: Logprob(-1.0, 1, "ld")}]
    t = make_response(req, _out(), " world", [7, 8], steps)
    assert json.loads(t["logprobs"][0]) == [
        {"7": {"logprob": -0.5, "rank": 2, "decoded_token": " wor"},
         "3": {"logprob": -0.25, "rank": 1, "decoded_token": "x"}},
        {"8": {"logprob": -1.0, "rank": 1, "decoded_token": "ld"}}]
    # Asked for, but the sampling parameters asked for no logprobs: "null", as the backend.
    assert make_response(req, _out(), " world", [7, 8], None)["logprobs"][0] == b"null"
    plain = parse_request({"text_input": s("Hello")})
    assert "logprobs" not in make_response(plain, _out(), " world", [7, 8], steps)


def test_cumulative_logprob_is_fp32_and_nan_when_no_logprobs_were_asked_for():
    req = parse_request({"text_input": s("Hello"), "return_cumulative_logprob": b(True)})
    out = _out()
    out.outputs[0].cumulative_logprob = -1.25
    t = make_response(req, out, " world", [7, 8], None)
    assert t["cumulative_logprob"].dtype == np.float32 and t["cumulative_logprob"].tolist() == [-1.25]
    assert np.isnan(make_response(req, _out(), " world", [7, 8], None)["cumulative_logprob"][0])
    plain = parse_request({"text_input": s("Hello")})
    assert "cumulative_logprob" not in make_response(plain, out, " world", [7, 8], None)


def _out(finished=True):
    return RequestOutput("r", "Hello", [1, 2, 3],
                         [CompletionOutput(0, " world", [7, 8], "length" if finished else None)],
                         finished)


def test_response_non_streaming_includes_prompt_unless_excluded():
    req = parse_request({"text_input": s("Hello"), "return_finish_reason": b(True),
                         "return_num_input_tokens": b(True),
                         "return_num_output_tokens": b(True), "return_output_ids": b(True)})
    t = make_response(req, _out(), " world", [7, 8], None)
    assert t["text_output"][0] == b"Hello world"
    assert t["finish_reason"][0] == b"length"
    assert t["num_input_tokens"][0] == 3 and t["num_output_tokens"][0] == 2
    assert t["output_ids"].tolist() == [7, 8] and t["output_ids"].dtype == np.int32
    req.exclude_input_in_output = True
    assert make_response(req, _out(), " world", [7, 8], None)["text_output"][0] == b" world"


def test_response_gives_the_cached_prompt_tokens_only_when_asked():
    out = _out()
    out.num_cached_tokens = 48
    asked = parse_request({"text_input": s("Hello"), "return_num_cached_tokens": b(True)})
    t = make_response(asked, out, " world", [7, 8], None)
    assert t["num_cached_tokens"].tolist() == [48] and t["num_cached_tokens"].dtype == np.uint32
    plain = parse_request({"text_input": s("Hello")})
    assert "num_cached_tokens" not in make_response(plain, out, " world", [7, 8], None)


def test_streaming_response_carries_only_new_text_and_its_own_token_count():
    """As Triton's vLLM backend: num_output_tokens counts the response's tokens (a stream's
    add up to the request's) and finish_reason is "None" until the last response."""
    req = parse_request({"text_input": s("Hello"), "stream": b(True),
                         "return_finish_reason": b(True), "return_num_output_tokens": b(True)})
    t = make_response(req, _out(finished=False), " wor", [7], None)
    assert t["text_output"][0] == b" wor" and t["finish_reason"][0] == b"None"
    assert t["num_output_tokens"].tolist() == [1]
    t = make_response(req, _out(), "ld", [8, 9], None)
    assert t["finish_reason"][0] == b"length" and t["num_output_tokens"].tolist() == [2]


class _Codes:
    INVALID_ARG, CANCELLED, UNAVAILABLE, INTERNAL = "400", "499", "503", "500"


@pytest.mark.parametrize("kind,code", [("invalid", "400"), ("cancelled", "499"),
                                       ("unavailable", "503"), ("internal", "500"),
                                       (None, "500"), ("unheard-of", "500")])
def test_an_error_kind_tagged_for_llm_bls_comes_back_whole(kind, code):
    """llm tags what it sends llm_bls with the error's kind (BLS drops the code); llm_bls gets
    the message back as it was, and the kind's code. A message that names a kind in its own
    text keeps it."""
    message = "prompt is 9 tokens [kind of], more than max_model_len 8"
    back, got_kind = untag_error_kind(tag_error_kind(message, kind))
    assert back == message and got_kind == (kind or "internal")
    assert error_code(_Codes, got_kind) == code
    assert untag_error_kind(message) == (message, None)
    assert untag_error_kind(message + " [llm error kind: invalid") == (
        message + " [llm error kind: invalid", None)
