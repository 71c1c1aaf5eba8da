"""The served models against a real tritonserver on free localhost ports, with tritonclient."""
import concurrent.futures
import itertools
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.protocol import MAX_INPUT_IDS, MAX_SAMPLING_PARAMETERS_BYTES, MAX_TEXT_INPUT_BYTES
from engine.sampling_params import (FLOAT32_MAX, MAX_LOGPROBS, MAX_STOP_STRING_CHARS,
                                    MAX_STOP_STRINGS)
from engine.serving import ServingEngine
from scripts.make_tiny_model import make_tiny_model
from scripts.tritonserver_env import copy_repository
from tests.tritonserver import start_server
from tests.waiting import wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tiny model's max_position_embeddings. A request that runs to it takes ~2 s here (1,000
# tokens), several times the 0.5 s in which the running-requests gauge is published: a test can
# see such a request running and still cancel it before it could end by itself.
MAX_MODEL_LEN = 1024
SETTINGS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "num_kv_blocks": 256,
            "max_model_len": MAX_MODEL_LEN, "cpu_threads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=4))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    copy_repository(repo, model_dir, {"dtype": "float32", **SETTINGS}, keep_params=False)
    with start_server(repo, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


@pytest.fixture(scope="module")
def direct(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu", **SETTINGS)


def greedy(max_tokens):
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def endless():
    """More tokens than fit in the context: only max_model_len ("length") or an abort ends it."""
    return greedy(10**6)


PROMPTS = [f"Request {i}: a few words about {w}." for i, w in enumerate(
    ["ships", "clouds", "bread", "rivers", "lamps", "maps", "salt", "bees"] * 4)]


# ---------------------------------------------------------------------------- clients
def _str(v):
    return np.array([v.encode() if isinstance(v, str) else v], dtype=np.object_)


def grpc_inputs(prompt, params, stream=True, **flags):
    arrays = {"text_input": _str(prompt), "stream": np.array([stream]),
              "sampling_parameters": _str(json.dumps(params))}
    arrays.update({k: np.array([v]) for k, v in flags.items()})
    out = []
    for name, arr in arrays.items():
        dtype = "BOOL" if arr.dtype == np.bool_ else "BYTES"
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def stream_request(server, prompt, params, cancel_after=None, **flags):
    """Streams one request; returns the list of (outputs dict, is_final) or raises the error."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("llm", grpc_inputs(prompt, params, **flags),
                                  enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                raise RuntimeError(str(error))
            resp = result.get_response()
            final = resp.parameters["triton_final_response"].bool_param
            outputs = {o.name: result.as_numpy(o.name) for o in resp.outputs}
            responses.append((outputs, final))
            if cancel_after is not None and len(responses) == cancel_after:
                client.stop_stream(cancel_requests=True)
                return responses
            if final:
                return responses
    finally:
        client.stop_stream()
        client.close()


def text_of(responses):
    return "".join(o["text_output"][0].decode() for o, _ in responses if "text_output" in o)


def bls_grpc(server, prompt, params, outputs=None, **flags):
    """llm_bls's outputs by name; `outputs`: the names to ask for (else all)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inputs = grpc_inputs(prompt, params, stream=False, exclude_input_in_output=True, **flags)
        result = client.infer("llm_bls", inputs, outputs=None if outputs is None else
                              [grpcclient.InferRequestedOutput(n) for n in outputs])
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
    finally:
        client.close()


def http_json(server, path, body=None):
    req = urllib.request.Request(f"http://{server.http_url}{path}",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def metrics(server):
    text = urllib.request.urlopen(f"http://{server.metrics_url}/metrics", timeout=10).read()
    values = {}
    for line in text.decode().splitlines():
        if line.startswith("llm_"):
            name_labels, value = line.rsplit(" ", 1)
            values[name_labels] = float(value)
    return values


def metric(server, name, values=None, **labels):
    """One family's value (summed over the labels not given), from `values` (one scrape of
    metrics()) or a new scrape."""
    pat = re.compile(re.escape(name) + r"\{(.*)\}$")
    total = 0.0
    for key, v in (values if values is not None else metrics(server)).items():
        m = pat.match(key)
        if m and all(f'{k}="{val}"' in m.group(1) for k, val in labels.items()):
            total += v
    return total


def finished(server, reason):
    return metric(server, "llm_requests_finished_total", reason=reason)


PROBE_PROMPT = "probe"      # wait_pool_whole's one-step request


def wait_pool_whole(server, timeout_s=10.0):
    """Waits until the engine is idle with every KV block free, as published after this call
    began, and returns the engine's step count in that publication: every step taken before
    this call, and the probe's one step or not.

    The engine's figures are published every 0.5 s, so an idle reading may predate what the test
    just did. A one-step probe request (which also shows that the server still serves) moves
    the step count; the count is published after the gauges, so a scrape that shows it moved
    shows a publication made after this call began. Its figures were fetched just before it
    was made, possibly before the probe ran: counters may still lack the probe's step, token,
    finish and prompt tokens (tests allow for that), never what came before this call."""
    steps_before = metric(server, "llm_engine_steps_total")
    assert text_of(stream_request(server, PROBE_PROMPT, greedy(1)))
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(server)
        steps = metric(server, "llm_engine_steps_total", values)
        free = metric(server, "llm_kv_blocks_free", values)
        total = metric(server, "llm_kv_blocks_total", values)
        running = metric(server, "llm_num_requests_running", values)
        waiting = metric(server, "llm_num_requests_waiting", values)
        if steps > steps_before and total > 0 and free == total and running == waiting == 0:
            return steps
        assert time.monotonic() < deadline, (
            f"KV pool not whole: free={free} total={total} running={running} "
            f"waiting={waiting}; steps {steps_before} -> {steps}")
        time.sleep(0.05)


# ---------------------------------------------------------------------------- streaming
def test_stream_equals_direct_engine(server, direct):
    prompt = "Once upon a time"
    # 128 tokens (~0.4 s here): a stream of a few dozen could leave as one response should the
    # sender be off the CPU the whole time (the steps made meanwhile leave together).
    expected = direct.generate(prompt, SamplingParams(**greedy(128)))[0]
    responses = stream_request(server, prompt, greedy(128), return_finish_reason=True,
                               return_num_input_tokens=True, return_num_output_tokens=True)
    assert len(responses) > 1
    assert [final for _, final in responses] == [False] * (len(responses) - 1) + [True]
    last = responses[-1][0]
    assert "text_output" in last                       # the final response carries data
    assert text_of(responses) == expected.outputs[0].text
    assert last["finish_reason"][0] == b"length"
    assert last["num_input_tokens"][0] == len(expected.prompt_token_ids)
    # As Triton's vLLM backend: each response counts its own tokens, and says "None" until
    # the last one says why the request finished.
    assert sum(int(o["num_output_tokens"][0]) for o, _ in responses) == 128
    assert all(o["finish_reason"][0] == b"None" for o, _ in responses[:-1])


@pytest.mark.parametrize("setting,value,log_says", [
    ("kv_cache_dtype", "fp8", "(torch.float8_e4m3fn)"),
    ("quantization", "fp8", "quantization=fp8)"),
])
def test_fp8_served_equals_the_direct_fp8_engine(model_dir, tmp_path_factory, setting, value, log_says):
    """kv_cache_dtype / quantization as a Triton parameter: the served engine keeps its KV cache
    in FP8, or its projections' weights (its log says so), and its streams and BLS answers are
    the direct FP8 engine's, token for token; the pool is whole afterwards."""
    settings = {**SETTINGS, setting: value}
    direct_fp8 = LLM(model_dir, dtype="float32", device="cpu", **settings)
    prompts = PROMPTS[:4]
    expected = [o.outputs[0].text for o in direct_fp8.generate(prompts, SamplingParams(**greedy(16)))]
    del direct_fp8
    repo = tmp_path_factory.mktemp("repo")
    copy_repository(repo, model_dir, {"dtype": "float32", **settings}, keep_params=False)
    with start_server(repo, log_dir=tmp_path_factory.mktemp("log")) as fp8_server:
        assert log_says in open(fp8_server.log_path).read()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: text_of(stream_request(fp8_server, p, greedy(16))), prompts))
        assert texts == expected
        assert bls_grpc(fp8_server, prompts[0], greedy(16))["text_output"][0].decode() == expected[0]
        wait_pool_whole(fp8_server)


def test_stream_false_gives_one_response_with_the_whole_text(server, direct):
    prompt = "The harbour at dawn"
    expected = direct.generate(prompt, SamplingParams(**greedy(12)))[0].outputs[0].text
    responses = stream_request(server, prompt, greedy(12), stream=False,
                               exclude_input_in_output=True)
    assert len(responses) == 1 and responses[0][1]
    assert text_of(responses) == expected


def test_bls_grpc_http_infer_and_generate_equal_streaming(server):
    prompt = "A letter from the mountains"
    streamed = text_of(stream_request(server, prompt, greedy(20)))
    via_grpc = bls_grpc(server, prompt, greedy(20), return_finish_reason=True)
    assert via_grpc["text_output"][0].decode() == streamed
    assert via_grpc["finish_reason"][0] == b"length"

    client = httpclient.InferenceServerClient(server.http_url)
    inputs = []
    for name, arr, dtype in [("text_input", _str(prompt), "BYTES"),
                             ("sampling_parameters", _str(json.dumps(greedy(20))), "BYTES"),
                             ("exclude_input_in_output", np.array([True]), "BOOL")]:
        t = httpclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    assert client.infer("llm_bls", inputs).as_numpy("text_output")[0].decode() == streamed
    client.close()

    gen = http_json(server, "/v2/models/llm_bls/generate", {
        "text_input": prompt, "sampling_parameters": json.dumps(greedy(20)),
        "exclude_input_in_output": True})
    assert gen["text_output"] == streamed
    # Without exclude_input_in_output the prompt leads the text (vLLM backend behaviour).
    gen = http_json(server, "/v2/models/llm_bls/generate", {
        "text_input": prompt, "sampling_parameters": json.dumps(greedy(20))})
    assert gen["text_output"] == prompt + streamed
    # Only an output its return_* flag leaves out: a response without it, as llm (and Triton's
    # vLLM backend) answer (llm_bls once answered INTERNAL "llm returned no output").
    assert bls_grpc(server, prompt, greedy(3), outputs=["finish_reason"]) == {}
    assert bls_grpc(server, prompt, greedy(3), outputs=["finish_reason"],
                    return_finish_reason=True) == {"finish_reason": np.array([b"length"],
                                                                             dtype=np.object_)}


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_logprobs_are_the_direct_engines_in_the_vllm_backends_layout(server, direct, model):
    """Per generated token, {token id: {"logprob", "rank", "decoded_token"}} for the sampled
    token and the top-n (Triton's vLLM backend's layout), equal to the direct engine's; and
    cumulative_logprob, the sampled tokens' sum so far, also when no logprobs were asked for
    (it was NaN, which made an HTTP response's JSON invalid for every parser but Python's)."""
    prompt = "Log these"
    params = {**greedy(5), "logprobs": 2}
    want = direct.generate(prompt, SamplingParams(**params))[0].outputs[0]
    assert want.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for step, t in zip(want.logprobs, want.token_ids)))
    if model == "llm":
        responses = stream_request(server, prompt, params, return_logprobs=True,
                                   return_cumulative_logprob=True)
        got = [step for o, _ in responses if "logprobs" in o
               for step in json.loads(o["logprobs"][0])]
        cumulative = [float(o["cumulative_logprob"][0]) for o, _ in responses
                      if "cumulative_logprob" in o]
    else:
        out = bls_grpc(server, prompt, params, return_logprobs=True,
                       return_cumulative_logprob=True)
        got = json.loads(out["logprobs"][0])
        cumulative = [float(out["cumulative_logprob"][0])]
    # Each response's is the request's running sum; the last one's the whole request's.
    assert cumulative[-1] == pytest.approx(want.cumulative_logprob, abs=1e-4)
    assert cumulative == sorted(cumulative, reverse=True)
    assert len(got) == len(want.logprobs) == 5
    for step, expected, token in zip(got, want.logprobs, want.token_ids):
        assert str(token) in step
        assert set(step) == {str(t) for t in expected}
        for tid, lp in expected.items():
            entry = step[str(tid)]
            assert entry["rank"] == lp.rank and entry["decoded_token"] == lp.decoded_token
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
    if model == "llm_bls":
        out = bls_grpc(server, prompt, greedy(5), return_logprobs=True,
                       return_cumulative_logprob=True)
        assert out["logprobs"][0] == b"null"
        assert float(out["cumulative_logprob"][0]) == pytest.approx(want.cumulative_logprob,
                                                                    abs=1e-4)

    def strict(constant):
        raise AssertionError(f"{constant} is no JSON")
    for path in (f"/v2/models/{model}/generate", f"/v2/models/{model}/generate_stream"):
        body = json.dumps({"text_input": prompt, "stream": path.endswith("stream"),
                           "return_cumulative_logprob": True, "parameters": greedy(5)}).encode()
        with urllib.request.urlopen(urllib.request.Request(
                f"http://{server.http_url}{path}", data=body,
                headers={"Content-Type": "application/json"}), timeout=60) as r:
            text = r.read().decode()
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        last = json.loads((events or [text])[-1], parse_constant=strict)
        assert last["cumulative_logprob"] == pytest.approx(want.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_n_completions_are_the_direct_engines_one_entry_each(server, direct, model):
    """n 3 in the sampling parameters: every response has an entry per completion (Triton's
    vLLM backend's layout), and the completions are the direct engine's n completions (the
    request seeded seed + k for the k-th), streamed on llm and whole from llm_bls."""
    prompt = "Three ways to end this"
    params = {"max_tokens": 48, "temperature": 1.0, "seed": 5, "ignore_eos": True, "n": 3}
    want = direct.generate(prompt, SamplingParams(**params))[0].outputs
    assert len({c.text for c in want}) == 3
    flags = {"return_finish_reason": True, "return_num_output_tokens": True}
    if model == "llm":
        responses = stream_request(server, prompt, params, **flags)
        assert len(responses) > 1
        assert all(len(o["text_output"]) == 3 for o, _ in responses)
        texts = ["".join(o["text_output"][k].decode() for o, _ in responses) for k in range(3)]
        counts = [sum(int(o["num_output_tokens"][k]) for o, _ in responses) for k in range(3)]
        last = responses[-1][0]
    else:
        last = bls_grpc(server, prompt, params, **flags)
        texts = [t.decode() for t in last["text_output"]]
        counts = [int(c) for c in last["num_output_tokens"]]
    assert texts == [c.text for c in want]
    assert counts == [48] * 3
    assert last["finish_reason"].tolist() == [b"length"] * 3
    wait_pool_whole(server)


def test_cancelled_stream_of_n_completions_aborts_them_all(server):
    """A stream with n 4 cancelled by its client: all four end in the engine (their blocks
    come back) by the abort, before max_model_len, and each counts an abort (as vLLM counts
    its child requests)."""
    wait_pool_whole(server)
    baseline = _abort_baseline(server)
    responses = stream_request(server, "Cancel us", {**endless(), "n": 4}, cancel_after=2)
    assert len(responses) == 2 and len(responses[0][0]["text_output"]) == 4
    _wait_aborted_early(server, baseline, at_least=2, completions=4)
    wait_pool_whole(server)
    assert finished(server, "abort") == baseline[0] + 4


def test_bls_answers_a_stream_request_with_the_streams_text(server):
    """llm_bls gives one response; to a request with stream=true it is the text the stream
    carries, joined (no prompt), and asking a stream for the prompt is an error on both models,
    as in Triton's vLLM backend."""
    prompt = "One answer for a stream"
    streamed = text_of(stream_request(server, prompt, greedy(6)))
    gen = http_json(server, "/v2/models/llm_bls/generate", {
        "text_input": prompt, "stream": True, "sampling_parameters": json.dumps(greedy(6))})
    assert gen["text_output"] == streamed
    for model in ("llm", "llm_bls"):
        with pytest.raises(urllib.error.HTTPError) as e:
            http_json(server, f"/v2/models/{model}/generate", {
                "text_input": prompt, "stream": True, "exclude_input_in_output": False})
        assert e.value.code == 400
        assert "exclude_input_in_output=false is not allowed with stream=true" in \
            e.value.read().decode()
    _server_carries_on(server)


def test_token_controls_are_served_as_the_direct_engine_gives_them(server, direct):
    """vLLM's allowed_token_ids, bad_words and logit_bias in sampling_parameters (JSON's string
    keys, as OpenAI's API sends them), streamed (llm) and not (llm_bls): the direct engine's
    tokens, which keep to the allowed ids, leave the bad word out and follow the bias; the pool
    ends whole."""
    prompt = "Only some words may follow"
    plain = direct.generate(prompt, SamplingParams(**greedy(12)))[0].outputs[0].token_ids
    allowed = [7, 11, 300, 512, 900]
    cases = [
        {"allowed_token_ids": allowed, **greedy(12)},
        {"bad_words": [banning_word(direct, plain)], **greedy(12)},
        {"logit_bias": {str(plain[0]): -100, "42": 100.0}, **greedy(12)},
        {"logit_bias": {"5": 3.0, "77": -2.5}, "allowed_token_ids": allowed + [5, 77],
         "temperature": 0.9, "seed": 17, "max_tokens": 12, "ignore_eos": True},
    ]
    for params in cases:
        want = direct.generate(prompt, SamplingParams(**params))[0].outputs[0]
        streamed = stream_request(server, prompt, params)
        assert text_of(streamed) == want.text, params
        bls = bls_grpc(server, prompt, params, return_output_ids=True)
        assert bls["output_ids"].tolist() == want.token_ids, params
        if "allowed_token_ids" in params:
            assert set(want.token_ids) <= set(params["allowed_token_ids"])
        assert want.token_ids != plain
    assert direct.generate(prompt, SamplingParams(**cases[2]))[0].outputs[0].token_ids == [42] * 12
    wait_pool_whole(server)


def test_request_parameters_are_sampling_parameters_as_in_the_vllm_backend(server, direct):
    """Triton's generate endpoint puts its "parameters" object, and every key that is not an
    input, into the request's parameters; gRPC clients set them directly. Triton's vLLM backend
    samples by them when sampling_parameters is absent, so both models do too (the inputs win
    where both are given), and a key they cannot honour is an error naming it."""
    prompt = "Parameters, not tensors"
    want = direct.generate(prompt, SamplingParams(**greedy(3)))[0].outputs[0].text
    gen = http_json(server, "/v2/models/llm_bls/generate", {
        "text_input": prompt, "exclude_input_in_output": True, "parameters": greedy(3)})
    assert gen["text_output"] == want
    gen = http_json(server, "/v2/models/llm_bls/generate", {
        "text_input": prompt, "exclude_input_in_output": True, **greedy(3)})
    assert gen["text_output"] == want
    # The vLLM backend README's own request (triton-inference-server/server#6660 sent it), to
    # the decoupled model: one response, the prompt and its text.
    gen = http_json(server, "/v2/models/llm/generate", {
        "text_input": prompt, "parameters": {"stream": False, **greedy(3)}})
    assert gen["text_output"] == prompt + want
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inputs = [t for t in grpc_inputs(prompt, {}, stream=False, exclude_input_in_output=True)
                  if t.name() != "sampling_parameters"]
        result = client.infer("llm_bls", inputs, parameters=greedy(3))
        assert result.as_numpy("text_output")[0].decode() == want
    finally:
        client.close()
    streamed = urllib.request.urlopen(urllib.request.Request(
        f"http://{server.http_url}/v2/models/llm/generate_stream",
        data=json.dumps({"text_input": prompt, "stream": True,
                         "parameters": {**greedy(3), "return_num_output_tokens": True}}).encode(),
        headers={"Content-Type": "application/json"}), timeout=60).read().decode()
    events = [json.loads(line[len("data: "):]) for line in streamed.splitlines()
              if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == want
    assert sum(e.get("num_output_tokens", 0) for e in events) == 3
    for model in ("llm", "llm_bls"):
        with pytest.raises(urllib.error.HTTPError) as e:
            http_json(server, f"/v2/models/{model}/generate",
                      {"text_input": prompt, "parameters": {"temperture": 0}})
        assert e.value.code == 400
        body = e.value.read().decode()
        assert "unknown request parameter(s) ['temperture']" in body and "temperature" in body
        # The body's "id" is the request's id to Triton, which also passes it on among the
        # parameters: no unknown sampling key (it was refused).
        gen = http_json(server, f"/v2/models/{model}/generate", {
            "text_input": prompt, "id": "42", "exclude_input_in_output": True,
            "parameters": {"stream": False, **greedy(3)}})
        assert gen["id"] == "42" and gen["text_output"] == want
    _server_carries_on(server)


def test_a_scalar_input_beyond_int32_wraps_in_tritons_parse_and_sampling_parameters_do_not(server):
    """The README's note: on llm_bls's generate endpoint `max_tokens` is the INT32 input, and
    Triton's JSON parse wraps 3000000000 round to -1294967296 before the model sees it (on
    infer too), so the refusal names that value; inside sampling_parameters the number is taken
    as sent."""
    infer = {"inputs": [
        {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["Wrap"]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [3_000_000_000]}]}
    for path, body in (("generate", {"text_input": "Wrap", "max_tokens": 3_000_000_000}),
                       ("generate", {"text_input": "Wrap",
                                     "parameters": {"max_tokens": 3_000_000_000}}),
                       ("infer", infer)):
        with pytest.raises(urllib.error.HTTPError) as e:
            http_json(server, f"/v2/models/llm_bls/{path}", body)
        assert e.value.code == 400
        assert "max_tokens must be >= 1, got -1294967296" in e.value.read().decode()
    # As sent: a min_tokens above it shows the max_tokens the engine got (no request runs).
    with pytest.raises(urllib.error.HTTPError) as e:
        http_json(server, "/v2/models/llm_bls/generate", {"text_input": "Wrap",
                  "sampling_parameters": json.dumps({"max_tokens": 3_000_000_000,
                                                     "min_tokens": 3_000_000_001})})
    assert e.value.code == 400
    assert "min_tokens must be <= max_tokens (3000000000), got 3000000001" in \
        e.value.read().decode()
    _server_carries_on(server)


def test_bls_scalar_inputs_override_json(server, direct):
    prompt = "Scalars win"
    expected = direct.generate(prompt, SamplingParams(**greedy(5)))[0].outputs[0].token_ids
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = grpc_inputs(prompt, greedy(30), stream=False, return_output_ids=True)
    t = grpcclient.InferInput("max_tokens", [1], "INT32")
    t.set_data_from_numpy(np.array([5], dtype=np.int32))
    result = client.infer("llm_bls", inputs + [t])
    client.close()
    assert result.as_numpy("output_ids").tolist() == expected


def banning_word(direct, token_ids):
    """A bad word that bans one of these tokens: the text of one whose text, as a bad word, is
    spelt by that token alone (vLLM's rule does not always spell a token's text so)."""
    tok = direct.get_tokenizer()
    for t in token_ids:
        check = SamplingParams(bad_words=[tok.decode([t])])
        check.tokenize_bad_words(tok)
        if [t] in check.bad_words_token_ids:
            return check.bad_words[0]
    pytest.fail("no token of the plain text is a bad word's spelling on its own")


def test_tensorrt_llms_readme_request_is_served(server, direct):
    """TensorRT-LLM's README sends this to its generate endpoint: its empty bad_words and
    stop_words mean none (its preprocessing skips empty words), and so they do here. Words to
    ban are vLLM's bad_words: the direct engine's text with them."""
    prompt = "What is machine learning?"
    body = {"text_input": prompt, "max_tokens": 20, "bad_words": "", "stop_words": ""}
    text = http_json(server, "/v2/models/llm_bls/generate", body)["text_output"]
    assert text.startswith(prompt) and len(text) > len(prompt), text
    greedy_body = {"text_input": prompt, "max_tokens": 20, "temperature": 0}
    assert (http_json(server, "/v2/models/llm_bls/generate", {**body, **greedy_body})
            == http_json(server, "/v2/models/llm_bls/generate", greedy_body))
    plain = direct.generate(prompt, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
    word = banning_word(direct, plain.token_ids)
    want = direct.generate(prompt, SamplingParams(max_tokens=20, temperature=0,
                                                  bad_words=[word]))[0].outputs[0].text
    assert want != plain.text
    got = http_json(server, "/v2/models/llm_bls/generate",
                    {**body, **greedy_body, "bad_words": ["", word]})["text_output"]
    assert got == prompt + want


def test_32_concurrent_streams_and_32_concurrent_bls(server, direct):
    expected = [o.outputs[0].text for o in direct.generate(PROMPTS, SamplingParams(**greedy(16)))]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        streams = [pool.submit(stream_request, server, p, greedy(16)) for p in PROMPTS]
        bls = [pool.submit(bls_grpc, server, p, greedy(16)) for p in PROMPTS]
        stream_texts = [text_of(f.result()) for f in streams]
        bls_texts = [f.result()["text_output"][0].decode() for f in bls]
    assert stream_texts == expected
    assert bls_texts == expected
    wait_pool_whole(server)


def test_16_concurrent_bls_are_batched_not_queued(server):
    """Served together, 16 requests of N tokens share about N engine steps; queued, one after
    another, they would take 16 N (two at a time, 8 N). How long they take is measured by
    scripts/bench_bls_concurrency.py (benchmarks/bls_concurrency.md), not asserted here."""
    # 200: the requests' arrival spread through llm_bls's stubs (up to ~0.5 s on a loaded
    # machine) stays well under N steps; 16 x 13 blocks fit the pool of 256 (no preemption).
    num_tokens = 200
    steps_before = wait_pool_whole(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue = queue.Queue()
    for prompt in PROMPTS[:16]:                      # all sent at once, none waits for another
        client.async_infer("llm_bls", grpc_inputs(prompt, greedy(num_tokens), stream=False,
                                                  return_num_output_tokens=True),
                           callback=lambda result, error: done.put((result, error)))
    for _ in range(16):
        result, error = done.get(timeout=60)
        assert error is None, error
        assert result.as_numpy("num_output_tokens")[0] == num_tokens
    client.close()
    num_steps = wait_pool_whole(server) - steps_before
    # At least one step per token; the rest is the requests' arrival spread (a few steps) and
    # up to two probe steps.
    assert num_tokens <= num_steps < 2 * num_tokens, num_steps


def test_requests_sharing_a_prefix_are_grouped_and_answer_as_without(server, model_dir):
    """Served traffic gets shared-prefix groups where they arise: requests whose block tables
    start with the same cached blocks are grouped in the engine's steps (cascade attention;
    llm_cascade_rows_total moves), and each answer is the one the engine gives without groups
    or cascade."""
    shared = ("The harbour office keeps a ledger of every ship, its cargo and its crew, and "
              "each entry names the day it came in and the day it left. ") * 3
    prompts = [shared + f"Question {i}: which ship carried {w}?" for i, w in
               enumerate(["salt", "grain", "oil", "timber", "wool", "iron", "wine", "tea"])]
    plain = LLM(model_dir, dtype="float32", device="cpu", enable_prefix_groups=False,
                enable_cascade_attention=False, **SETTINGS)
    expected = [o.outputs[0].text for o in plain.generate(prompts, SamplingParams(**greedy(64)))]
    assert text_of(stream_request(server, shared, greedy(1)))      # the prefix is now cached
    before = metric(server, "llm_cascade_rows_total")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streams = [pool.submit(stream_request, server, p, greedy(64)) for p in prompts]
        texts = [text_of(f.result()) for f in streams]
    assert texts == expected
    wait_for(lambda: metric(server, "llm_cascade_rows_total") > before,
             "the engine to count cascade rows")


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_num_cached_tokens_is_the_prompts_prefix_cache_hit(server, direct, model):
    """return_num_cached_tokens: every response says how many prompt tokens the prefix cache
    held for the request (none the first time a prompt is seen, its whole blocks the second),
    as the direct engine's RequestOutput.num_cached_tokens says; the prefix-cache counters
    move by as much."""
    prompt = (f"For {model}: the lighthouse keeper writes down the weather, the ships that pass "
              f"and the lamp's oil every evening, in a book that nobody else reads.")
    direct_outs = [direct.generate(prompt, SamplingParams(**greedy(4)))[0] for _ in range(2)]
    expected = [o.num_cached_tokens for o in direct_outs]
    assert expected[0] == 0 and expected[1] >= 16
    wait_pool_whole(server)         # every earlier request's stats are published
    queries = metric(server, "llm_prefix_cache_queries_total")
    hits = metric(server, "llm_prefix_cache_hits_total")
    got = []
    for _ in range(2):
        if model == "llm":
            responses = stream_request(server, prompt, greedy(4), return_num_cached_tokens=True)
            values = {int(o["num_cached_tokens"][0]) for o, _ in responses if o}
            assert len(values) == 1, values          # the same in every response
            got.append(values.pop())
        else:
            got.append(int(bls_grpc(server, prompt, greedy(4),
                                    return_num_cached_tokens=True)["num_cached_tokens"][0]))
    assert got == expected
    num_prompt = len(direct_outs[0].prompt_token_ids)

    def counted():
        values = metrics(server)
        return (metric(server, "llm_prefix_cache_queries_total", values) - queries,
                metric(server, "llm_prefix_cache_hits_total", values) - hits)
    # Published twice a second, hits after queries: wait for both. wait_pool_whole's baseline
    # may lack its probe's prompt (its docstring), which then counts here: its tokens as
    # queries, no hits (shorter than a block).
    probe = direct.generate(PROBE_PROMPT, SamplingParams(**greedy(1)))[0].prompt_token_ids
    assert len(probe) < direct.config.block_size
    want = (2 * num_prompt, sum(got))
    wait_for(lambda: counted() in (want, (want[0] + len(probe), want[1])),
             f"the prefix-cache counters to move by (queries, hits) = {want} (or the probe's "
             f"{len(probe)} queries more)")
    assert "num_cached_tokens" not in bls_grpc(server, prompt, greedy(1))   # only when asked


# ---------------------------------------------------------------------------- cancel
def _wait_aborted_early(server, baseline, at_least=1, completions=1):
    """Waits until the aborts of the request's `completions` are published, then checks that
    the aborted request (the only one since `baseline`, prompt under 16 tokens) was cut short:
    running to max_model_len each completion would have generated more than MAX_MODEL_LEN - 16
    tokens, and it generated `at_least` (those the client got). Its tokens are counted with its
    finish, before the abort; the probe's token may be among them."""
    aborted, generated = baseline
    wait_for(lambda: finished(server, "abort") >= aborted + completions,
             "the engine to abort the request")
    num_generated = metric(server, "llm_generation_tokens_total") - generated
    assert at_least <= num_generated < completions * (MAX_MODEL_LEN - 16), num_generated


def _abort_baseline(server):
    return finished(server, "abort"), metric(server, "llm_generation_tokens_total")


def test_cancelled_stream_is_aborted_and_frees_its_blocks(server):
    wait_pool_whole(server)
    baseline = _abort_baseline(server)
    responses = stream_request(server, "Cancel me", endless(), cancel_after=3)
    assert len(responses) == 3
    _wait_aborted_early(server, baseline, at_least=3)
    wait_pool_whole(server)


def test_cancelled_bls_request_aborts_the_inner_one(server):
    steps = wait_pool_whole(server)
    baseline = _abort_baseline(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue = queue.Queue()
    ctx = client.async_infer("llm_bls", grpc_inputs("Long one", endless(), stream=False),
                             callback=lambda result, error: done.put(error))
    # Two steps past the idle count: one may be the probe's, the other is the inner request's.
    wait_for(lambda: metric(server, "llm_engine_steps_total") >= steps + 2,
             "the inner llm request to run")
    ctx.cancel()
    assert "CANCELLED" in str(done.get(timeout=30)).upper()
    _wait_aborted_early(server, baseline)
    client.close()
    wait_pool_whole(server)


def test_bls_client_timeout_aborts_the_inner_request(server):
    """A client whose deadline passes is gone: its request is cancelled in Triton, and the
    inner llm request is aborted, long before it could have run to max_model_len."""
    wait_pool_whole(server)
    baseline = _abort_baseline(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
        client.infer("llm_bls", grpc_inputs("Time me out", endless(), stream=False),
                     client_timeout=0.5)
    client.close()
    _wait_aborted_early(server, baseline)
    wait_pool_whole(server)


def _http_stream_then_vanish(server, num_events, reset):
    """POST generate_stream on a raw socket, read `num_events` server-sent events (0: none),
    then close it (FIN), or reset it (RST: SO_LINGER 0), without a word."""
    body = json.dumps({"text_input": "Vanish", "stream": True,
                       "sampling_parameters": json.dumps(endless())}).encode()
    host, port = server.http_url.split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(b"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        received = b""
        while received.count(b"data:") < num_events:
            chunk = sock.recv(65536)
            assert chunk, f"the server ended the stream: {received[-500:]!r}"
            received += chunk
        assert b" 200 OK" in received or num_events == 0, received[:200]
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


@pytest.mark.parametrize("num_events,reset", [(3, False), (3, True), (0, False)],
                         ids=["closed-mid-stream", "reset-mid-stream", "closed-before-a-token"])
def test_http_client_vanishing_from_a_stream_aborts_its_request(server, num_events, reset):
    """Triton 2.51 turns a closed generate_stream connection into a cancellation of the
    request (is_cancelled() turns true): the engine aborts it and frees its blocks."""
    wait_pool_whole(server)
    baseline = _abort_baseline(server)
    _http_stream_then_vanish(server, num_events, reset)
    _wait_aborted_early(server, baseline)
    wait_pool_whole(server)


def test_a_failing_send_ends_the_engine_request(model_dir):
    """Should sending a response fail (a sender whose client is gone raises), the request must
    still end in the engine and free its blocks, not run on to max_model_len unseen."""
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", **SETTINGS)
    serving = ServingEngine(config)
    try:
        sent, failed = [], threading.Event()

        def send(tensors, error, final):
            sent.append((tensors, error, final))
            if len(sent) >= 3:
                failed.set()
                raise RuntimeError("the client is gone")

        serving.submit({"text_input": _str("Hello"), "stream": np.array([True]),
                        "sampling_parameters": _str(json.dumps(endless()))}, send)
        assert failed.wait(30)
        deadline = time.monotonic() + 10
        while True:
            stats = serving.stats()
            if stats.num_running == stats.num_waiting == 0 and (
                    stats.num_free_kv_blocks == stats.num_kv_blocks):
                break
            assert time.monotonic() < deadline, f"the request still holds the engine: {stats}"
            time.sleep(0.05)
        assert stats.num_generated_tokens < MAX_MODEL_LEN // 2       # it did not run to length
    finally:
        serving.shutdown()


# ---------------------------------------------------------------------------- one llm_bls instance
def _one_bls_instance_server(model_dir, tmp_path_factory, thread_pool_size, **llm_settings):
    """A server whose llm_bls has one instance and the Python backend `thread_pool_size`
    server threads per instance (the last --backend-config counts, over the launcher's)."""
    repo = tmp_path_factory.mktemp("repo")
    copy_repository(repo, model_dir, {"dtype": "float32", **SETTINGS, **llm_settings},
                    keep_params=False)
    cfg = repo / "llm_bls" / "config.pbtxt"
    text = cfg.read_text()
    assert "count: 8 kind: KIND_CPU" in text
    cfg.write_text(text.replace("count: 8 kind: KIND_CPU", "count: 1 kind: KIND_CPU"))
    return start_server(repo, log_dir=tmp_path_factory.mktemp("log"), extra_args=[
        f"--backend-config=python,thread-pool-size={thread_pool_size}"])


def _bls_stub_pid(server):
    (pid,) = [pid for pid, cmdline in server.descendant_pids().items()
              if "llm_bls/1/model.py" in cmdline]
    return pid


def _num_threads(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


class _Answers:
    """Callbacks of async llm_bls requests, counted as they come."""

    def __init__(self):
        self.lock = threading.Lock()
        self.results = []
        self.all_in = threading.Event()
        self.expected = 0

    def callback(self, result, error):
        with self.lock:
            self.results.append((result, error))
            if len(self.results) == self.expected:
                self.all_in.set()

    def count(self):
        with self.lock:
            return len(self.results)


def _send_bls(clients, prompts, params, answers):
    answers.expected += len(prompts)
    for i, prompt in enumerate(prompts):
        clients[i % len(clients)].async_infer(
            "llm_bls", grpc_inputs(prompt, params, stream=False, return_num_output_tokens=True),
            callback=answers.callback)


def _wait_running(server, at_least, what, timeout_s=30.0):
    """Waits until llm_num_requests_running reaches `at_least`; returns the most seen."""
    most = 0

    def enough():
        nonlocal most
        most = max(most, metric(server, "llm_num_requests_running"))
        return most >= at_least
    wait_for(enough, what, timeout_s)
    return most


BLS_POOL = 16      # server threads per instance in the test below: 15 requests in llm at most


@pytest.fixture(scope="module")
def small_pool_server(model_dir, tmp_path_factory):
    # KV for the test's 15 requests in llm at once, each near max_model_len (no preemption).
    with _one_bls_instance_server(model_dir, tmp_path_factory, BLS_POOL,
                                  num_kv_blocks=BLS_POOL * MAX_MODEL_LEN // 16) as s:
        yield s


def test_bls_threads_are_bounded_and_a_cancel_is_passed_on_beyond_the_server_threads(
        small_pool_server):
    """40 long requests on one llm_bls instance whose server pool has 16 threads: 15 are in llm
    at once, the others wait in llm_bls holding no thread, and a cancelled request is aborted
    in llm while the first 15 still run: its abort (a BLS call) finds the server thread kept
    free. With a worker per request, or 16 in BLS calls, the abort would wait for one of them
    to end, and the stub would hold a thread per request."""
    server, cap = small_pool_server, BLS_POOL - 1
    assert f"up to {cap} requests in llm at once" in open(server.log_path).read()
    assert bls_grpc(server, "warm up", greedy(1))["text_output"]    # the pool's first thread
    pid = _bls_stub_pid(server)
    threads_before = _num_threads(pid)
    steps = wait_pool_whole(server)
    baseline = _abort_baseline(server)
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(4)]
    client_of_target = grpcclient.InferenceServerClient(server.grpc_url)
    target = _Answers()
    _send_bls([client_of_target], ["Cancel me"], endless(), target)
    wait_for(lambda: metric(server, "llm_engine_steps_total") >= steps + 2,
             "the target's llm request to run")
    flood = _Answers()
    # Long enough that the first 15 are still running when the abort is seen, short enough for
    # three waves. Seeing it takes the watcher's round (~0.1 s) and up to two of the engine's
    # 0.5 s metric publications (the wait for 15 running, then the abort's count): ~1.2 s at
    # most. 256 tokens took 0.9 s on a 2-core CPU, and the abort was seen after them; near
    # max_model_len a wave takes ~6 s there.
    flood_tokens = MAX_MODEL_LEN - 32
    _send_bls(clients, [f"Flood {i}" for i in range(40)], greedy(flood_tokens), flood)
    most_running = _wait_running(server, cap, f"{cap} requests in llm")
    client_of_target.close()          # cancels its request in flight (the target)
    wait_for(lambda: finished(server, "abort") > baseline[0], "the target to be aborted")
    assert flood.count() == 0, "the abort waited for a request in llm to end"
    assert flood.all_in.wait(120), f"{flood.count()} of 40 answered"
    for result, error in flood.results:
        assert error is None, error
        assert result.as_numpy("num_output_tokens")[0] == flood_tokens
    most_running = max(most_running, metric(server, "llm_num_requests_running"))
    assert most_running <= cap, most_running
    # The workers a burst made are kept; none beyond the cap (the warm-up made the first).
    assert _num_threads(pid) - threads_before <= cap - 1, (threads_before, _num_threads(pid))
    for c in clients:
        c.close()
    wait_pool_whole(server)


@pytest.fixture(scope="module")
def big_pool_server(model_dir, tmp_path_factory):
    with _one_bls_instance_server(model_dir, tmp_path_factory, 512, max_num_seqs=256,
                                  num_kv_blocks=4096) as s:
        yield s


def test_one_bls_instance_has_hundreds_of_requests_in_llm_at_once(big_pool_server):
    server, num_requests = big_pool_server, 256
    wait_pool_whole(server)
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(8)]
    answers = _Answers()
    _send_bls(clients, [f"Request {i}: hello" for i in range(num_requests)], greedy(200),
              answers)
    _wait_running(server, 200, "hundreds of llm_bls requests in llm at once")
    assert answers.all_in.wait(120), f"{answers.count()} of {num_requests} answered"
    for result, error in answers.results:
        assert error is None, error
        assert result.as_numpy("num_output_tokens")[0] == 200
    for c in clients:
        c.close()
    wait_pool_whole(server)


# ---------------------------------------------------------------------------- bad input
def _ids(*values):
    return "INT32", np.array(values, dtype=np.int32)


def _text(text):
    return "BYTES", _str(text)


def _params(text):
    return {"text_input": _text("hi"), "sampling_parameters": _text(text)}


# What a careless or hostile client sends. Each gets an error naming the input or parameter
# (and its allowed values) for that request alone; the server carries on and no KV is held.
# case, tensors, the strings the error must hold
BAD_INPUTS = [
    ("missing text_input", {"sampling_parameters": _text('{"max_tokens": 2}')}, ["text_input"]),
    ("wrong dtype", {"text_input": ("INT32", np.array([5], dtype=np.int32))}, ["text_input"]),
    ("invalid JSON", _params("{oops"), ["sampling_parameters", "not valid JSON"]),
    ("unknown key", _params('{"best_of": 2}'), ["best_of", "valid keys are"]),
    ("out of range", _params('{"top_p": 1.5}'), ["top_p", "> 0.0 and <= 1.0"]),
    ("invalid UTF-8", {"text_input": _text(b"\xff\xfe\xfd")}, ["text_input", "UTF-8"]),
    ("prompt too long", {"text_input": _text("word " * 2 * MAX_MODEL_LEN)},
     ["max_model_len", str(MAX_MODEL_LEN)]),
    # prompts
    ("input_ids beyond the vocabulary", {"input_ids": _ids(5, 10**6)},
     ["input_ids", "must be in [0, ", "[1000000]"]),
    ("negative input_ids", {"input_ids": _ids(-3, 5)}, ["input_ids", "must be in [0, ", "[-3]"]),
    ("empty input_ids", {"input_ids": _ids()}, ["input_ids is empty"]),
    ("too many input_ids", {"input_ids": ("INT32", np.zeros(MAX_INPUT_IDS + 1, np.int32))},
     ["input_ids", f"at most {MAX_INPUT_IDS}"]),
    ("text_input and input_ids", {"text_input": _text("hi"), "input_ids": _ids(1, 2)},
     ["text_input or input_ids, not both"]),
    ("2-element text_input", {"text_input": ("BYTES", np.array([b"a", b"b"], np.object_))},
     ["text_input", "Expected [1], got [2]"]),               # refused by Triton (dims: [1])
    # sampling_parameters as a whole
    ("sampling_parameters an array", _params("[1, 2]"),
     ["sampling_parameters must be a JSON object", "got an array"]),
    ("sampling_parameters null", _params("null"),
     ["sampling_parameters must be a JSON object", "got null"]),
    ("sampling_parameters nested deep", _params("[" * 100_000),
     ["sampling_parameters", "nested too deeply"]),
    ("a 5000-digit number", _params('{"max_tokens": ' + "9" * 5000 + "}"),
     ["sampling_parameters cannot be read", "4300 digits"]),
    ("sampling_parameters over 1 MiB",
     _params('{"stop": ["' + "x" * MAX_SAMPLING_PARAMETERS_BYTES + '"]}'),
     ["sampling_parameters is", f"at most {MAX_SAMPLING_PARAMETERS_BYTES} bytes"]),
    # one parameter
    ("NaN", _params('{"temperature": NaN}'), ["temperature must be a finite number", "nan"]),
    ("Infinity", _params('{"repetition_penalty": Infinity}'),
     ["repetition_penalty must be a finite number"]),
    ("-Infinity", _params('{"frequency_penalty": -Infinity}'),
     ["frequency_penalty must be a finite number"]),
    ("1e308", _params('{"temperature": 1e308}'), ["temperature", f"<= {FLOAT32_MAX}"]),
    ("seed beyond 64 bits", _params(json.dumps({"seed": 2**64})),
     ["seed", ">= -9223372036854775808 and <= 9223372036854775807"]),
    ("10,000 stop strings", _params(json.dumps({"stop": [f"s{i}" for i in range(10_000)]})),
     ["stop holds 10000 strings", f"at most {MAX_STOP_STRINGS}"]),
    ("a long stop string", _params(json.dumps({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]})),
     ["stop strings", f"1 to {MAX_STOP_STRING_CHARS} characters"]),
    ("huge logprobs", _params('{"logprobs": 1000000}'), ["logprobs", f"<= {MAX_LOGPROBS}"]),
    ("stop_token_ids beyond the vocabulary", _params('{"stop_token_ids": [1000000]}'),
     ["stop_token_ids", "must be in [0, "]),
    ("top_k not a number", _params('{"top_k": "many"}'), ["top_k must be an integer"]),
    ("logit_bias beyond the vocabulary", _params('{"logit_bias": {"1000000": 5}}'),
     ["logit_bias keys", "must be in [0, ", "[1000000]"]),
    ("logit_bias out of range", _params('{"logit_bias": {"5": 500}}'),
     ["logit_bias[5]", ">= -100.0 and <= 100.0"]),
    ("allowed_token_ids empty", _params('{"allowed_token_ids": []}'),
     ["allowed_token_ids must hold at least one token id"]),
    ("allowed_token_ids beyond the vocabulary", _params('{"allowed_token_ids": [4, 1000000]}'),
     ["allowed_token_ids", "must be in [0, ", "[1000000]"]),
]


def _grpc_tensors(tensors):
    inputs = []
    for name, (dtype, arr) in tensors.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _error_of(server, model, inputs):
    """The error a request gets: from the stream (llm) or the call (llm_bls)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        if model == "llm":
            results: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put(error))
            client.async_stream_infer("llm", inputs)
            error = results.get(timeout=30)
            client.stop_stream()
            return error
        with pytest.raises(InferenceServerException) as e:
            client.infer(model, inputs)
        return e.value
    finally:
        client.close()


def _server_carries_on(server):
    wait_pool_whole(server)                 # its probe request is served, and no KV is held


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
@pytest.mark.parametrize("case,tensors,needles", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_per_request_error(server, model, case, tensors, needles):
    error = _error_of(server, model, _grpc_tensors(tensors))
    assert error is not None and all(n in str(error) for n in needles), str(error)
    if model == "llm_bls":
        # The client's fault, not the server's: no retry will help. Also where only llm's
        # engine checks it (a prompt too long, ids outside the vocabulary): BLS drops llm's
        # code, which llm_bls reads from the kind llm tags the message with; the tag is gone.
        assert error.status() == "StatusCode.INVALID_ARGUMENT", (case, error.status())
        assert "llm error kind" not in str(error), str(error)
    _server_carries_on(server)


BLS_BAD_INPUTS = [
    ("temperature NaN", {"temperature": ("FP32", np.array([np.nan], np.float32))},
     ["temperature must be a finite number"]),
    ("top_p Infinity", {"top_p": ("FP32", np.array([np.inf], np.float32))},
     ["top_p must be a finite number"]),
    ("negative max_tokens", {"max_tokens": ("INT32", np.array([-5], np.int32))},
     ["max_tokens must be >= 1"]),
    ("too many stop_words", {"stop_words": ("BYTES", np.array(
        [b"w%d" % i for i in range(10_000)], np.object_))},
     ["stop_words holds 10000 strings", f"at most {MAX_STOP_STRINGS}"]),
]


@pytest.mark.parametrize("case,tensors,needles", BLS_BAD_INPUTS,
                         ids=[c[0] for c in BLS_BAD_INPUTS])
def test_bad_bls_scalar_input_is_a_per_request_error(server, case, tensors, needles):
    error = _error_of(server, "llm_bls", _grpc_tensors({"text_input": _text("hi"), **tensors}))
    assert all(n in str(error) for n in needles), str(error)
    assert error.status() == "StatusCode.INVALID_ARGUMENT", error.status()
    _server_carries_on(server)


@pytest.mark.parametrize("body,status", [
    ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": -1})}, 400),
    ({"text_input": "hi", "sampling_parameters": json.dumps({"max_tokenz": 4})}, 400),
    ({"text_input": "word " * 2 * MAX_MODEL_LEN, "sampling_parameters": json.dumps(greedy(2))},
     400),
    ({"text_input": "hi", "sampling_parameters": json.dumps(greedy(2))}, 200),
])
def test_http_infer_status_is_400_for_a_bad_request(server, body, status):
    """A bad request is the client's fault: HTTP 400 through llm_bls's infer, as Triton gives
    for INVALID_ARG (it was 500, which clients retry), with the message naming the field; also
    a prompt too long, which only llm's engine finds (its kind reaches llm_bls on the message,
    as BLS drops the code)."""
    inputs = [{"name": k, "shape": [1], "datatype": "BYTES", "data": [v]} for k, v in body.items()]
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/llm_bls/infer",
        data=json.dumps({"inputs": inputs}).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            got, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        got, text = e.code, e.read().decode()
    assert got == status, text
    if status == 400:
        assert any(n in text for n in ("max_tokens must be >= 1", "max_tokenz",
                                       "max_model_len")), text
        assert "llm error kind" not in text, text


def test_a_50mb_prompt_is_refused_by_its_size(server):
    """Triton and tritonclient allow gRPC messages up to 2 GiB, so a 50 MB prompt reaches the
    model over gRPC (and HTTP): it is refused there by its size, before it is tokenized (that
    took ~40 s here) or forwarded by llm_bls."""
    prompt = "word " * (50_000_000 // 5)
    needles = ["text_input is 50000000 bytes long", f"at most {MAX_TEXT_INPUT_BYTES} bytes"]
    for model in ("llm", "llm_bls"):
        error = _error_of(server, model, _grpc_tensors({"text_input": _text(prompt)}))
        assert all(n in str(error) for n in needles), str(error)[:500]
    with pytest.raises(urllib.error.HTTPError) as e:
        http_json(server, "/v2/models/llm_bls/generate", {"text_input": prompt})
    assert e.value.code == 400
    body = e.value.read().decode()
    assert all(n in body for n in needles), body[:500]
    _server_carries_on(server)


@pytest.mark.parametrize("max_tokens", [10**12, None])
@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_max_tokens_beyond_the_context_ends_at_max_model_len(server, model, max_tokens):
    """Like vLLM's engine: max_tokens has no upper bound, and null is no limit; the request
    ends with "length" when it fills the context."""
    flags = dict(return_finish_reason=True, return_num_input_tokens=True,
                 return_num_output_tokens=True)
    params = {**greedy(max_tokens), "min_tokens": 10**12}
    if model == "llm":
        (out, final), = stream_request(server, "Go on", params, stream=False, **flags)
        assert final
    else:
        out = bls_grpc(server, "Go on", params, **flags)
    assert out["finish_reason"][0] == b"length"
    assert out["num_input_tokens"][0] + out["num_output_tokens"][0] == MAX_MODEL_LEN
    wait_pool_whole(server)


def test_requests_outgrowing_the_pool_are_preempted_and_answer_as_direct(server, direct):
    """Eight requests of ~560 prompt tokens and 300 out need ~6,900 tokens of KV together, more
    than the server's 256 blocks of 16 (4,096), and any five of them running together outgrow
    it: as they grow, the newest running ones are preempted and recomputed later (as vLLM's
    default). llm_num_preemptions_total counts it, every answer is the direct engine's, and no
    block leaks."""
    rng = random.Random(7)
    words = ["ships", "clouds", "bread", "rivers", "lamps", "maps", "salt", "bees", "stone",
             "wind", "glass", "moss"]
    prompts = [f"Request {i}: " + " ".join(rng.choice(words) for _ in range(280)) for i in range(8)]
    params = greedy(300)
    want = direct.generate(prompts, SamplingParams(**params))
    assert all(520 <= len(o.prompt_token_ids) <= 700 for o in want), [len(o.prompt_token_ids) for o in want]
    assert 5 * (520 + 300) > SETTINGS["num_kv_blocks"] * 16
    before = metric(server, "llm_num_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda p: text_of(stream_request(server, p, params)), prompts))
    assert texts == [o.outputs[0].text for o in want]
    wait_pool_whole(server)
    assert metric(server, "llm_num_preemptions_total") > before


# ---------------------------------------------------------------------------- metrics
def test_metrics_families_move(server):
    """Counted in the serving process and published twice a second (engine/metrics.py): the
    families move once a publication after the request has gone out. The inter-token latency
    is observed between a stream's responses, so it moves only where the tokens came in more
    than one: under load all 8 may pile up into the first (engine/outbox.py), and then it must
    not move."""
    counted = ["llm_time_to_first_token_seconds_count", "llm_e2e_request_latency_seconds_count",
               "llm_prompt_tokens_total", "llm_generation_tokens_total",
               "llm_event_loop_lag_seconds_count", "llm_responses_total",
               "llm_response_tokens_total", "llm_response_send_seconds_count"]
    before = metrics(server)
    responses = stream_request(server, "count me", greedy(8), return_num_output_tokens=True)
    # Each response counts its own tokens: the client's running count after each.
    sent = list(itertools.accumulate(int(o["num_output_tokens"][0]) for o, _ in responses
                                     if "num_output_tokens" in o))
    assert sent[-1] == 8
    with_tokens = sum(1 for a, b in zip([0] + sent, sent) if b > a)
    if with_tokens > 1:
        counted.append("llm_inter_token_latency_seconds_count")

    def moved():
        values = metrics(server)
        return all(metric(server, f, values) > metric(server, f, before) for f in counted)
    wait_for(moved, "the request's metrics to be published")
    after = metrics(server)
    # Histograms in Prometheus' layout: cumulative buckets up to +Inf, which equals the count.
    for family in ("llm_time_to_first_token_seconds", "llm_e2e_request_latency_seconds"):
        inf = metric(server, f"{family}_bucket", after, le="+Inf")
        assert inf == metric(server, f"{family}_count", after) > 0
    for family in ("llm_num_requests_running", "llm_num_requests_waiting", "llm_kv_blocks_total",
                   "llm_kv_blocks_free", "llm_kv_cache_usage_ratio",
                   "llm_prefix_cache_hit_ratio", "llm_event_loop_lag_max_seconds",
                   "llm_engine_graph_steps_total", "llm_num_preemptions_total"):
        assert any(k.startswith(family + "{") for k in after), family
    assert metric(server, "llm_kv_blocks_total") == SETTINGS["num_kv_blocks"]
    # On CPU every step is launched eagerly: no CUDA graphs.
    assert metric(server, "llm_engine_steps_total", after) > 0
    assert metric(server, "llm_engine_graph_steps_total", after) == 0
    itl = "llm_inter_token_latency_seconds_count"
    first = next(n for n in sent if n > 0)          # tokens in the first response that had any
    assert metric(server, itl, after) - metric(server, itl, before) == 8 - first


# ---------------------------------------------------------------------------- tools
def _perf_analyzer():
    return shutil.which("perf_analyzer", path=os.path.dirname(sys.executable))


def test_perf_analyzer_streaming_and_bls(server, tmp_path):
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{
        "text_input": ["Tell me a story"], "stream": [True],
        "sampling_parameters": [json.dumps(greedy(8))]}]}))
    bls_data = tmp_path / "bls.json"
    bls_data.write_text(json.dumps({"data": [{
        "text_input": ["Tell me a story"], "sampling_parameters": [json.dumps(greedy(8))]}]}))
    pa = _perf_analyzer()
    assert pa, "perf_analyzer missing from the virtualenv"
    env = dict(os.environ)
    # Concurrency 16 over llm_bls once crashed the server (a cancellation check on a request
    # already answered): keep it high enough to catch that again.
    common = ["-u", server.grpc_url, "-i", "grpc", "--measurement-mode", "count_windows",
              "--measurement-request-count", "64", "--concurrency-range", "16",
              "--stability-percentage", "999", "--max-trials", "3"]
    for args in (["-m", "llm", "--streaming", "--input-data", str(data)],
                 ["-m", "llm_bls", "--input-data", str(bls_data)]):
        proc = subprocess.run([pa] + args + common, capture_output=True, text=True, timeout=300,
                              env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "Throughput" in proc.stdout


def test_client_script_streams(server):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "client.py"),
                           "--url", server.grpc_url, "--prompt", "Hello", "--max-tokens", "8",
                           "--temperature", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "length" in proc.stdout


# ---------------------------------------------------------------------------- lifecycle
def _repo_with(tmp_path, model, **params):
    copy_repository(tmp_path / "repo", model, params, keep_params=False)
    return tmp_path / "repo"


def test_startup_failure_is_raised_from_initialize(tmp_path):
    repo = _repo_with(tmp_path, model=str(tmp_path / "no-such-model"))
    with pytest.raises(Exception) as e:
        with start_server(repo, log_dir=tmp_path, timeout_s=60):
            pass
    assert "no-such-model" in str(e.value) and "does not exist" in str(e.value)


def test_unload_lets_in_flight_streams_finish_then_finalizes(model_dir, tmp_path):
    """Triton calls finalize only once in-flight requests are done: the stream must complete
    (final flag, every token) and the unload must then finish, not hang."""
    repo = _repo_with(tmp_path, model=model_dir, dtype="float32", **SETTINGS)
    with start_server(repo, log_dir=tmp_path) as server:
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put(
            (time.monotonic(), result, error)))
        # Runs to max_model_len (~2 s): the unload below comes while it streams.
        client.async_stream_infer("llm", grpc_inputs("Keep going", endless(),
                                                     return_num_input_tokens=True,
                                                     return_num_output_tokens=True),
                                  enable_empty_final_response=True)
        _, first, error = results.get(timeout=30)
        assert error is None                                  # it is streaming
        client.unload_model("llm_bls")
        client.unload_model("llm")
        unloading_since = time.monotonic()
        last, num_after_unload = first, 0
        num_out = int(first.as_numpy("num_output_tokens")[0])
        while not last.get_response().parameters["triton_final_response"].bool_param:
            at, last, error = results.get(timeout=30)
            assert error is None, error
            num_after_unload += at > unloading_since
            if last.as_numpy("num_output_tokens") is not None:    # not the empty final one
                num_out += int(last.as_numpy("num_output_tokens")[0])
        client.stop_stream()
        assert num_after_unload > 0, "the stream had ended before the unload began"
        assert int(first.as_numpy("num_input_tokens")[0]) + num_out == MAX_MODEL_LEN
        wait_for(lambda: "successfully unloaded 'llm'" in open(server.log_path).read(),
                 "the unload to finish", timeout_s=30)
        assert "llm: engine stopped" in open(server.log_path).read()   # finalize ran
        assert not client.is_model_ready("llm")
        client.close()


def test_a_cancel_llm_cannot_take_while_unloading_is_logged_and_the_unload_waits(tmp_path):
    """An llm_bls request cancelled while llm is unloading: Triton takes no new request for a
    model that is unloading, and the abort llm_bls sends is one, so llm_bls logs that the inner
    request runs on to its end; llm then unloads once it has ended. A model of 4,096 positions
    makes the inner request run long enough (~6 s) for the unload and the cancel to come while
    it runs."""
    model = make_tiny_model(tmp_path / "long", arch="llama", seed=3,
                            max_position_embeddings=4096)
    repo = _repo_with(tmp_path, model=str(model), dtype="float32", max_num_seqs=4,
                      max_num_batched_tokens=512, num_kv_blocks=300, max_model_len=4096,
                      cpu_threads=1)
    with start_server(repo, log_dir=tmp_path) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        done: queue.Queue = queue.Queue()
        ctx = client.async_infer("llm_bls", grpc_inputs("Run long", endless(), stream=False),
                                 callback=lambda result, error: done.put(error))
        wait_for(lambda: metric(server, "llm_num_requests_running") >= 1,
                 "the inner llm request to run")
        client.unload_model("llm")
        wait_for(lambda: not client.is_model_ready("llm"), "llm to be unloading")
        ctx.cancel()
        assert "CANCELLED" in str(done.get(timeout=30)).upper()
        wait_for(lambda: "could not abort request bls-" in open(server.log_path).read(),
                 "llm_bls to log the abort llm refused", timeout_s=30)
        log = open(server.log_path).read()
        assert "runs on to its end" in log and "successfully unloaded 'llm'" not in log
        wait_for(lambda: "successfully unloaded 'llm'" in open(server.log_path).read(),
                 "llm to unload once the inner request ended", timeout_s=120)
        assert "llm: engine stopped" in open(server.log_path).read()     # finalize ran
        client.close()


def _core_pids(server):
    """The engine core processes of this server (started by its stubs, by command line)."""
    return [pid for pid, cmdline in server.descendant_pids().items()
            if "engine.core_process" in cmdline]


def test_killing_the_core_process_ends_streams_and_makes_llm_not_ready(model_dir, tmp_path):
    repo = _repo_with(tmp_path, model=model_dir, dtype="float32", **SETTINGS)
    with start_server(repo, log_dir=tmp_path) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.is_model_ready("llm")
        (core_pid,) = _core_pids(server)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put(
            (time.monotonic(), result, error)))
        for i in range(4):
            client.async_stream_infer("llm", grpc_inputs(f"stream {i}", endless()),
                                      request_id=f"k{i}")
        seen = {}
        while len(seen) < 4:                                # every stream is under way
            _, result, error = results.get(timeout=30)
            assert error is None, error
            seen[result.get_response().id] = True
        wait_for(lambda: metric(server, "llm_num_requests_running") == 4, "the 4 in the gauges")
        killed_at = time.monotonic()
        os.kill(core_pid, signal.SIGKILL)
        errors = {}
        while len(errors) < 4:
            at, result, error = results.get(timeout=10)
            if error is not None:
                errors[len(errors)] = (at - killed_at, str(error))
        client.stop_stream()
        for delay, message in errors.values():
            assert delay < 1.0, (delay, message)
            assert "engine core" in message and "killed by signal 9" in message, message
        wait_for(lambda: not client.is_model_ready("llm"), "llm to stop reporting ready")
        with pytest.raises(Exception, match="llm"):          # and new requests are refused
            stream_request(server, "after", greedy(4))
        # llm_bls's too, as UNAVAILABLE (HTTP 503: the engine is gone), not as a fault of its
        # own (INTERNAL, 500): BLS hands Triton's "Model 'llm' is not ready" over as INTERNAL.
        with pytest.raises(InferenceServerException) as e:
            client.infer("llm_bls", grpc_inputs("after", greedy(4), stream=False))
        assert e.value.status() == "StatusCode.UNAVAILABLE", (e.value.status(), str(e.value))
        assert "llm" in e.value.message()
        body = {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                            "data": ["after"]}]}
        with pytest.raises(urllib.error.HTTPError) as http_error:
            http_json(server, "/v2/models/llm_bls/infer", body)
        assert http_error.value.code == 503, http_error.value.read().decode()
        client.close()
        assert not _core_pids(server)
        # Its gauges say the engine runs nothing (they showed the 4 streams while llm stayed
        # unloaded): published once more after the engine stopped, before finalize returned.
        wait_for(lambda: "llm: engine stopped" in open(server.log_path).read(), "finalize")
        values = metrics(server)
        assert metric(server, "llm_num_requests_running", values) == 0
        assert metric(server, "llm_num_requests_waiting", values) == 0
        # ... and has no pool: summed by model, only live engines count (engine/serving.py).
        assert metric(server, "llm_kv_blocks_total", values) == 0
        assert metric(server, "llm_kv_blocks_free", values) == 0
        assert metric(server, "llm_kv_cache_usage_ratio", values) == 0
    assert not server.group_pids()                          # nothing left behind
