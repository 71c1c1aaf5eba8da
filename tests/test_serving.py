"""The served models against a real tritonserver on free localhost ports, with tritonclient."""
import concurrent.futures
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from engine import LLM, SamplingParams
from scripts.bench_bls_concurrency import concurrency_ratio
from scripts.make_tiny_model import make_tiny_model
from tests.tritonserver import start_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODEL_LEN = 256
SETTINGS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "num_kv_blocks": 256,
            "max_model_len": MAX_MODEL_LEN, "cpu_threads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=4))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(os.path.join(ROOT, "model_repository"), repo, dirs_exist_ok=True)
    cfg_path = repo / "llm" / "config.pbtxt"
    cfg = re.sub(r"^parameters .*$\n?", "", cfg_path.read_text(), flags=re.M)
    params = {"model": model_dir, "dtype": "float32", **SETTINGS}
    cfg += "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                   for k, v in params.items())
    cfg_path.write_text(cfg)
    with start_server(repo, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


@pytest.fixture(scope="module")
def direct(model_dir):
    return LLM(model_dir, dtype="float32", device="cpu", **SETTINGS)


def greedy(max_tokens):
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


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


def bls_grpc(server, prompt, params, **flags):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inputs = grpc_inputs(prompt, params, stream=False, exclude_input_in_output=True, **flags)
        result = client.infer("llm_bls", inputs)
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


def metric(server, name, **labels):
    pat = re.compile(re.escape(name) + r"\{(.*)\}$")
    total = 0.0
    for key, v in metrics(server).items():
        m = pat.match(key)
        if m and all(f'{k}="{val}"' in m.group(1) for k, val in labels.items()):
            total += v
    return total


def wait_pool_whole(server, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = metric(server, "llm_kv_blocks_free"), metric(server, "llm_kv_blocks_total")
        running = metric(server, "llm_num_requests_running")
        waiting = metric(server, "llm_num_requests_waiting")
        if total > 0 and free == total and running == 0 and waiting == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"KV pool not whole: free={free} total={total} running={running}")


# ---------------------------------------------------------------------------- streaming
def test_stream_equals_direct_engine(server, direct):
    prompt = "Once upon a time"
    expected = direct.generate(prompt, SamplingParams(**greedy(24)))[0]
    responses = stream_request(server, prompt, greedy(24), return_finish_reason=True,
                               return_num_input_tokens=True, return_num_output_tokens=True)
    assert len(responses) > 1
    assert [final for _, final in responses] == [False] * (len(responses) - 1) + [True]
    last = responses[-1][0]
    assert "text_output" in last                       # the final response carries data
    assert text_of(responses) == expected.outputs[0].text
    assert last["finish_reason"][0] == b"length"
    assert last["num_input_tokens"][0] == len(expected.prompt_token_ids)
    assert last["num_output_tokens"][0] == 24
    assert all("finish_reason" not in o for o, _ in responses[:-1])


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
    # Long enough that per-request fixed costs (arrival through BLS, prefill) do not dominate.
    params = greedy(128)
    bls_grpc(server, "warm up", params)
    # Served one after another, 16 would take ~16x one; batched they take 1.6-1.8x here
    # (benchmarks/bls_concurrency.md). Other processes on a small machine only ever add time,
    # so each round is the best of 5 runs of each, and a round over the bound is run again.
    rounds = []
    for _ in range(3):
        rounds.append(concurrency_ratio(server.grpc_url, 16, params, best_of=5))
        print(f"16 concurrent llm_bls: {rounds[-1]}")
        if rounds[-1]["ratio"] < 2.0:
            break
    assert min(r["ratio"] for r in rounds) < 2.0, f"16 at once vs one: {rounds}"


# ---------------------------------------------------------------------------- cancel
def test_cancelled_stream_is_aborted_and_frees_its_blocks(server):
    aborted_before = metric(server, "llm_requests_finished_total", reason="abort")
    responses = stream_request(server, "Cancel me", greedy(200), cancel_after=3)
    assert len(responses) == 3
    deadline = time.monotonic() + 10
    while metric(server, "llm_requests_finished_total", reason="abort") == aborted_before:
        assert time.monotonic() < deadline, "the engine never aborted the cancelled request"
        time.sleep(0.05)
    generated = metric(server, "llm_generation_tokens_total")
    wait_pool_whole(server)
    assert metric(server, "llm_generation_tokens_total") == generated  # it stopped for good


def test_cancelled_bls_request_aborts_the_inner_one(server):
    aborted_before = metric(server, "llm_requests_finished_total", reason="abort")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done: queue.Queue = queue.Queue()
    ctx = client.async_infer("llm_bls", grpc_inputs("Long one", greedy(240), stream=False),
                             callback=lambda result, error: done.put(error))
    time.sleep(0.5)
    ctx.cancel()
    assert "CANCELLED" in str(done.get(timeout=30)).upper()
    deadline = time.monotonic() + 10
    while metric(server, "llm_requests_finished_total", reason="abort") == aborted_before:
        assert time.monotonic() < deadline, "the inner llm request was not aborted"
        time.sleep(0.05)
    client.close()
    wait_pool_whole(server)


# ---------------------------------------------------------------------------- bad input
BAD_INPUTS = [
    ("missing text_input", {"sampling_parameters": ("BYTES", _str('{"max_tokens": 2}'))},
     "text_input"),
    ("wrong dtype", {"text_input": ("INT32", np.array([5], dtype=np.int32))}, "text_input"),
    ("invalid JSON", {"text_input": ("BYTES", _str("hi")),
                      "sampling_parameters": ("BYTES", _str("{oops"))}, "not valid JSON"),
    ("unknown key", {"text_input": ("BYTES", _str("hi")),
                     "sampling_parameters": ("BYTES", _str('{"best_of": 2}'))}, "best_of"),
    ("out of range", {"text_input": ("BYTES", _str("hi")),
                      "sampling_parameters": ("BYTES", _str('{"top_p": 1.5}'))}, "top_p"),
    ("invalid UTF-8", {"text_input": ("BYTES", _str(b"\xff\xfe\xfd"))}, "UTF-8"),
    ("prompt too long", {"text_input": ("BYTES", _str("word " * 400))}, "max_model_len"),
]


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
@pytest.mark.parametrize("case,tensors,needle", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_per_request_error(server, model, case, tensors, needle):
    inputs = []
    for name, (dtype, arr) in tensors.items():
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    if model == "llm":
        results: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put(error))
        client.async_stream_infer("llm", inputs)
        error = results.get(timeout=30)
        client.stop_stream()
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        with pytest.raises(Exception) as e:
            client.infer("llm_bls", inputs)
        error = e.value
    client.close()
    assert error is not None and needle in str(error), str(error)
    # ...and the server carries on.
    assert text_of(stream_request(server, "still here", greedy(3)))


# ---------------------------------------------------------------------------- metrics
def test_metrics_families_move(server):
    before = metrics(server)
    stream_request(server, "count me", greedy(8))
    after = metrics(server)
    for family in ("llm_time_to_first_token_seconds_count", "llm_inter_token_latency_seconds_count",
                   "llm_prompt_tokens_total", "llm_generation_tokens_total",
                   "llm_event_loop_lag_seconds_count"):
        key = next(k for k in after if k.startswith(family + "{"))
        assert after[key] > before.get(key, 0), family
    for family in ("llm_num_requests_running", "llm_num_requests_waiting", "llm_kv_blocks_total",
                   "llm_kv_blocks_free", "llm_kv_cache_usage_ratio",
                   "llm_prefix_cache_hit_ratio", "llm_event_loop_lag_max_seconds"):
        assert any(k.startswith(family + "{") for k in after), family
    assert metric(server, "llm_kv_blocks_total") == SETTINGS["num_kv_blocks"]


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
def _repo_with(tmp_path, **params):
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "model_repository"), repo)
    cfg_path = repo / "llm" / "config.pbtxt"
    cfg = re.sub(r"^parameters .*$\n?", "", cfg_path.read_text(), flags=re.M)
    cfg += "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                   for k, v in params.items())
    cfg_path.write_text(cfg)
    return repo


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
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("llm", grpc_inputs("Keep going", greedy(120),
                                                     return_num_output_tokens=True),
                                  enable_empty_final_response=True)
        first, error = results.get(timeout=30)
        assert error is None                                  # it is streaming
        client.unload_model("llm_bls")
        client.unload_model("llm")
        last = first
        while not last.get_response().parameters["triton_final_response"].bool_param:
            last, error = results.get(timeout=30)
            assert error is None, error
        client.stop_stream()
        assert last.as_numpy("num_output_tokens")[0] == 120
        deadline = time.monotonic() + 30
        while "successfully unloaded 'llm'" not in open(server.log_path).read():
            assert time.monotonic() < deadline, "unload did not finish"
            time.sleep(0.1)
        assert "llm: engine stopped" in open(server.log_path).read()   # finalize ran
        assert not client.is_model_ready("llm")
        client.close()


def _core_pids(server):
    """The engine core processes of this server (in its process group, by command line)."""
    pids = []
    for pid in server.group_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"engine.core_process" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids


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
            client.async_stream_infer("llm", grpc_inputs(f"stream {i}", greedy(200)),
                                      request_id=f"k{i}")
        seen = {}
        while len(seen) < 4:                                # every stream is under way
            _, result, error = results.get(timeout=30)
            assert error is None, error
            seen[result.get_response().id] = True
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
        deadline = time.monotonic() + 10
        while client.is_model_ready("llm"):
            assert time.monotonic() < deadline, "llm still reports ready"
            time.sleep(0.1)
        with pytest.raises(Exception, match="llm"):          # and new requests are refused
            stream_request(server, "after", greedy(4))
        client.close()
        assert not _core_pids(server)
    assert not server.group_pids()                          # nothing left behind
