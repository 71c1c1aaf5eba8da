"""Two instances of `llm` in one tritonserver (as one per GPU, here on CPU): requests spread
evenly, each instance publishes its own metrics, and llm_bls's aborts reach the instance that
runs their request (engine/instance_board.py)."""
import concurrent.futures
import json
import os
import queue
import shutil

import pytest
import tritonclient.grpc as grpcclient

from engine import LLM, SamplingParams
from scripts import server_probe
from scripts.make_tiny_model import make_tiny_model
from scripts.tritonserver_env import copy_repository
from tests.test_serving import (SETTINGS, endless, finished, greedy, grpc_inputs, metric,
                                metrics, stream_request, text_of, wait_pool_whole)
from tests.tritonserver import start_server
from tests.waiting import wait_for

NUM_INSTANCES = 2
# Streams that outlast the tests (until cancelled, without preemption): a context of 16k
# tokens, with room for every stream on one instance.
MAX_MODEL_LEN = 16384
# prefix_routing_slack: over a group of 12 and one request lingering after its answer, so that
# the group stays whole whatever the default (test_requests_sharing_a_long_prefix_run_on_...).
INSTANCE_SETTINGS = {**SETTINGS, "max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 8192,
                     "prefix_routing_slack": 16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("m") / "llama", arch="llama", seed=4,
                               max_position_embeddings=MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    copy_repository(repo, model_dir, {"dtype": "float32", **INSTANCE_SETTINGS},
                    keep_params=False)
    cfg = repo / "llm" / "config.pbtxt"
    text = cfg.read_text()
    assert "count: 1 kind: KIND_CPU" in text
    cfg.write_text(text.replace("count: 1 kind: KIND_CPU",
                                f"count: {NUM_INSTANCES} kind: KIND_CPU"))
    with start_server(repo, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


def per_instance(server, name, values=None):
    """{"instance@device": value} of one llm_* family."""
    return server_probe.per_instance(values if values is not None else metrics(server), name)


def test_each_instance_publishes_its_own_series(server):
    wait_pool_whole(server)
    total = per_instance(server, "llm_kv_blocks_total")
    assert sorted(total) == ["llm_0_0@cpu", "llm_0_1@cpu"]
    assert set(total.values()) == {INSTANCE_SETTINGS["num_kv_blocks"]}


def _running(server):
    return per_instance(server, "llm_num_requests_running")


@pytest.mark.parametrize("round_", [1, 2])
def test_streams_sent_at_once_spread_evenly_over_the_instances(server, round_):
    """Triton alone gives each request to whichever instance is free: 48 sent at once split
    18/30, 19/29, 21/27, 22/26 here; an instance with more than one over the other now waits
    in execute, so the next ones go to the other."""
    wait_pool_whole(server)
    n = 48
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    try:
        for i in range(n):
            client.async_stream_infer("llm", grpc_inputs(f"spread {round_} {i}", endless()))
        wait_for(lambda: sum(_running(server).values()) == n, f"{n} requests running",
                 timeout_s=60)
        running = _running(server)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    assert max(running.values()) - min(running.values()) <= 2, running
    wait_pool_whole(server, timeout_s=60)


def test_cancelled_bls_requests_are_aborted_on_whichever_instance_runs_them(server):
    """Each abort (a BLS call to llm) reaches an instance Triton picks; the one that does not
    hold the request passes it on. Without that, about half would run on to max_model_len."""
    wait_pool_whole(server)
    n = 6
    aborted = finished(server, "abort")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors: queue.Queue = queue.Queue()
    calls = [client.async_infer("llm_bls", grpc_inputs(f"cancel {i}", endless(), stream=False),
                                callback=lambda result, error: errors.put(error))
             for i in range(n)]
    try:
        wait_for(lambda: sum(_running(server).values()) == n, f"{n} inner requests running",
                 timeout_s=60)
        assert all(v > 0 for v in _running(server).values())    # both instances run some
        for call in calls:
            call.cancel()
        for _ in range(n):
            assert "CANCELLED" in str(errors.get(timeout=60)).upper()
        # One not aborted would run on to max_model_len: minutes.
        wait_for(lambda: finished(server, "abort") >= aborted + n, "the inner requests' aborts",
                 timeout_s=60)
    finally:
        client.close()
    wait_pool_whole(server, timeout_s=60)


def test_both_instances_answer_as_the_direct_engine(server, model_dir):
    """Six at once: the instances share them, and each answers as the direct engine."""
    expected = LLM(model_dir, dtype="float32", device="cpu", **INSTANCE_SETTINGS).generate(
        "Same prompt", SamplingParams(**greedy(12)))[0].outputs[0].text
    before = per_instance(server, "llm_requests_finished_total")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda _: text_of(stream_request(server, "Same prompt",
                                                                greedy(12))), range(6)))
    assert texts == [expected] * 6
    wait_for(lambda: sum(per_instance(server, "llm_requests_finished_total").values())
             >= sum(before.values()) + 6, "the finishes to be published")
    after = per_instance(server, "llm_requests_finished_total")
    assert all(after[k] > before.get(k, 0) for k in after) and len(after) == NUM_INSTANCES


def test_requests_sharing_a_long_prefix_run_on_the_engine_that_has_it(server, model_dir):
    """Prefix routing (engine/prefix_routing.py): whichever instance Triton gives each request
    of a group that shares a long prefix, the group runs on the engine that took the first, so
    the prefix is computed once and cached once (while the engines' loads stay within the
    slack, here the prefix_routing_slack setting); each answers as the direct engine."""
    from transformers import AutoTokenizer
    wait_pool_whole(server)
    shared = " ".join(f"section {i} of the shared document says {i * 7} things." for i in range(40))
    # 12: the engine that has the prefix takes the others while its load is under the other's
    # plus the slack set (16; one may linger a moment after its answer).
    prompts = [f"{shared} Question {i}: what of {w}?" for i, w in enumerate(
        ["ships", "clouds", "bread", "rivers", "lamps", "maps", "salt", "wool", "bells",
         "roads", "kites", "tides"])]
    assert INSTANCE_SETTINGS["prefix_routing_slack"] > len(prompts) + 1
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(p)["input_ids"] for p in prompts]
    common = next(i for i in range(len(ids[0])) if len({tuple(x[:i + 1]) for x in ids}) > 1)
    shared_blocks = common // 16
    assert shared_blocks >= 20, common
    queries = lambda: per_instance(server, "llm_prefix_cache_queries_total")  # noqa: E731
    hits = lambda: sum(per_instance(server, "llm_prefix_cache_hits_total").values())  # noqa
    on_peer = lambda: sum(per_instance(server, "llm_requests_run_on_peer_total").values())  # noqa
    # Every instance connects to the others' cores once they are up (checked every 0.5 s).
    wait_for(lambda: per_instance(server, "llm_prefix_routing_peers") == {
        "llm_0_0@cpu": 1, "llm_0_1@cpu": 1}, "each instance connected to the other's engine",
        timeout_s=30)
    q0, h0, p0 = queries(), hits(), on_peer()
    first = text_of(stream_request(server, prompts[0], greedy(32)))   # takes the prefix
    # The others on one stream, sent at once: the instance board spreads them over both
    # instances (its hold, not chance: test_streams_sent_at_once_spread_evenly_...).
    texts = [first] + _stream_at_once(server, prompts[1:], greedy(32))
    wait_pool_whole(server, timeout_s=60)
    wait_for(lambda: sum(queries().values()) >= sum(q0.values()) + sum(map(len, ids)),
             "the prompts' counts to be published")
    q1 = queries()
    moved = {k: q1[k] - q0.get(k, 0) for k in q1}
    # Every prompt token was looked up in one engine's cache: the other took none of them...
    assert sorted(moved.values())[0] <= 2 * 4, moved      # (the pool probes' prompts)
    # ... so the prefix was computed once: the other 11 found its whole blocks there. Each
    # instance publishes its counters twice a second, on its own (hits just after queries), and
    # the 11 can be done in 0.2 s: so wait for the counts here rather than read them once.
    wait_for(lambda: hits() - h0 >= (len(prompts) - 1) * shared_blocks * 16,
             "the prefix's blocks found in the cache by the other 11")
    # Triton gave some of them to the other instance, which ran them there.
    wait_for(lambda: on_peer() - p0 >= 1,
             "the other instance to publish a request it ran on the prefix's engine")
    llm = LLM(model_dir, dtype="float32", device="cpu", **INSTANCE_SETTINGS)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**greedy(32)))]
    assert texts == expected


def test_prompts_that_share_nothing_run_where_triton_put_them(server, model_dir):
    """Long prompts with no prefix in common (plain traffic) each start a prefix no engine
    holds; while few prompts find theirs held, prefix routing moves none of them to the other
    instance's engine (Triton's choice, held even by the board, already balances them), and
    each answers as the direct engine."""
    wait_pool_whole(server)
    wait_for(lambda: per_instance(server, "llm_prefix_routing_peers") == {
        "llm_0_0@cpu": 1, "llm_0_1@cpu": 1}, "each instance connected to the other's engine",
        timeout_s=30)
    on_peer = lambda: sum(per_instance(server, "llm_requests_run_on_peer_total").values())  # noqa
    finished_ = lambda: per_instance(server, "llm_requests_finished_total")  # noqa: E731
    words = ["ships", "clouds", "bread", "rivers", "lamps", "maps", "salt", "wool"]
    prompts = [f"{w} " + " ".join(f"{w} line {i} counts {i * 3} {w}." for i in range(20))
               for w in words]
    p0, f0 = on_peer(), finished_()
    texts = _stream_at_once(server, prompts, greedy(8))
    wait_for(lambda: sum(finished_().values()) >= sum(f0.values()) + len(prompts),
             "the finishes to be published")
    after = finished_()
    assert all(after[k] > f0.get(k, 0) for k in after), (f0, after)    # both instances ran
    assert on_peer() == p0
    llm = LLM(model_dir, dtype="float32", device="cpu", **INSTANCE_SETTINGS)
    assert texts == [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(**greedy(8)))]


def _stream_at_once(server, prompts, params):
    """Sends every prompt on one gRPC stream without waiting; returns their texts in order."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    texts = {str(i): "" for i in range(len(prompts))}
    try:
        for i, prompt in enumerate(prompts):
            client.async_stream_infer("llm", grpc_inputs(prompt, params), request_id=str(i),
                                      enable_empty_final_response=True)
        done = 0
        while done < len(prompts):
            result, error = results.get(timeout=60)
            assert error is None, error
            resp = result.get_response()
            if any(o.name == "text_output" for o in resp.outputs):
                texts[resp.id] += result.as_numpy("text_output")[0].decode()
            done += resp.parameters["triton_final_response"].bool_param
    finally:
        client.stop_stream()
        client.close()
    return [texts[str(i)] for i in range(len(prompts))]



# Over 4 KV blocks of 16 tokens (prefix routing's least shared prefix).
SHARED = "The quick brown fox jumps over the lazy dog and keeps on running far away. " * 6


def _open_stream(server, prompt, params):
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("llm", grpc_inputs(prompt, params),
                              enable_empty_final_response=True)
    return client, results


def test_a_stream_of_the_reloaded_model_outlives_the_old_loads_unload(tmp_path):
    """Reloading llm (a changed config) while it serves: the new instances start while the
    old ones drain their streams. Sharing their board, the new ones routed a request whose
    prefix an old engine held to that engine; Triton, which counts the request as the new
    model's, unloaded the old model once its own streams ended, and the routed stream failed
    ("the engine core of another instance failed"). Each load has a board of its own."""
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=4, max_position_embeddings=4096)
    repo = tmp_path / "repo"
    copy_repository(repo, str(model), {"dtype": "float32", **SETTINGS, "max_model_len": 4096,
                                       "num_kv_blocks": 1024}, keep_params=False)
    cfg = repo / "llm" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("count: 1 kind: KIND_CPU",
                                           f"count: {NUM_INSTANCES} kind: KIND_CPU"))
    with start_server(repo, log_dir=tmp_path) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        wait_for(lambda: sum(per_instance(server, "llm_prefix_routing_peers").values()) >= 2,
                 "the two instances to connect to each other's engines", timeout_s=60)
        stream_request(server, SHARED, greedy(4))          # an old engine holds the prefix
        old_client, old_results = _open_stream(server, "something else entirely", endless())
        assert old_results.get(timeout=60)[1] is None       # the old load stays while it runs
        config = client.get_model_config("llm", as_json=True)["config"]
        config["parameters"]["max_num_seqs"] = {"string_value": "32"}
        client.load_model("llm", config=json.dumps(config))   # returns once the new is ready
        new_client, new_results = _open_stream(server, SHARED, endless())
        try:
            assert new_results.get(timeout=60)[1] is None
            old_client.stop_stream(cancel_requests=True)    # the old load unloads now
            wait_for(lambda: "successfully unloaded 'llm' version 1" in
                     open(server.log_path, errors="replace").read(),
                     "the old load to unload", timeout_s=60)
            outcome = None
            while outcome is None:                          # runs on to max_model_len
                result, error = new_results.get(timeout=120)
                if error is not None:
                    outcome = f"error: {error}"
                elif result.get_response().parameters["triton_final_response"].bool_param:
                    outcome = "final"
            assert outcome == "final", outcome
        finally:
            new_client.stop_stream(cancel_requests=True)
            new_client.close()
            old_client.close()
            client.close()


def test_two_models_in_one_repository_each_with_its_own_llm_bls(tmp_path, model_dir):
    """A repository serving two models: `llm` copied as `chat` with another model folder, and
    `llm_bls` copied as `chat_bls` naming it with its `llm_model` parameter (llm_bls called
    the model named `llm`, whatever its own name). Each non-streaming model answers with its
    own model's text, and a cancelled `chat_bls` request is aborted in `chat`."""
    other = str(make_tiny_model(tmp_path / "qwen2", arch="qwen2", seed=9))
    settings = {"dtype": "float32", **SETTINGS}
    repo = tmp_path / "repo"
    copy_repository(repo, model_dir, settings, keep_params=False)
    shutil.copytree(repo / "llm", repo / "chat")
    cfg = repo / "chat" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace(f'string_value: "{os.path.abspath(model_dir)}"',
                                           f'string_value: "{other}"'))
    shutil.copytree(repo / "llm_bls", repo / "chat_bls")
    with open(repo / "chat_bls" / "config.pbtxt", "a") as f:
        f.write('parameters { key: "llm_model" value: { string_value: "chat" } }\n')
    expected = {name: LLM(path, device="cpu", **settings).generate(
        "Two models", SamplingParams(**greedy(10)))[0].outputs[0].text
        for name, path in (("llm_bls", model_dir), ("chat_bls", other))}
    assert expected["llm_bls"] != expected["chat_bls"]
    with start_server(repo, log_dir=tmp_path / "log") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for name, text in expected.items():
                result = client.infer(name, grpc_inputs("Two models", greedy(10), stream=False,
                                                        exclude_input_in_output=True))
                assert result.as_numpy("text_output")[0].decode() == text, name
            errors: queue.Queue = queue.Queue()
            call = client.async_infer("chat_bls", grpc_inputs("cancel me", endless(),
                                                              stream=False),
                                      callback=lambda result, error: errors.put(error))
            wait_for(lambda: metric(server, "llm_num_requests_running", model="chat") == 1,
                     "the chat_bls request running in chat", timeout_s=60)
            call.cancel()
            assert "CANCELLED" in str(errors.get(timeout=60)).upper()
            wait_for(lambda: metric(server, "llm_requests_finished_total", model="chat",
                                    reason="abort") == 1, "its abort in chat", timeout_s=60)
            assert metric(server, "llm_requests_finished_total", model="llm", reason="abort") == 0
        finally:
            client.close()


@pytest.mark.parametrize("model", ["llm", "llm_bls"])
def test_a_max_batch_size_above_0_fails_the_load_naming_it(tmp_path, model_dir, model):
    """max_batch_size edited to 8 loaded READY, and then every llm_bls request failed on its
    inputs' shapes with INTERNAL (HTTP 500). Triton's vLLM backend refuses it at load."""
    repo = tmp_path / "repo"
    copy_repository(repo, model_dir, {"dtype": "float32", **SETTINGS}, keep_params=False)
    cfg = repo / model / "config.pbtxt"
    assert "max_batch_size: 0" in cfg.read_text()
    cfg.write_text(cfg.read_text().replace("max_batch_size: 0", "max_batch_size: 8"))
    with pytest.raises(RuntimeError, match=f"max_batch_size must be 0 for the {model} model, "
                                           f"got 8"):
        start_server(repo, log_dir=tmp_path / "log").stop()


def test_an_output_llm_does_not_declare_fails_only_the_requests_that_ask_for_it(tmp_path,
                                                                                model_dir):
    """llm's config trimmed of `logprobs` (llm_bls's left whole): llm_bls asked llm for every
    output its client asked for, all of its own where the client names none, and every
    request failed ("unexpected inference output 'logprobs'"), even those without
    return_logprobs."""
    repo = tmp_path / "repo"
    copy_repository(repo, model_dir, {"dtype": "float32", **SETTINGS}, keep_params=False)
    cfg = repo / "llm" / "config.pbtxt"
    lines = cfg.read_text().splitlines(keepends=True)
    trimmed = [line for line in lines if '{ name: "logprobs"' not in line]
    assert len(trimmed) == len(lines) - 1
    cfg.write_text("".join(trimmed))
    with start_server(repo, log_dir=tmp_path / "log") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            result = client.infer("llm_bls", grpc_inputs("Trimmed", greedy(4), stream=False,
                                                         return_finish_reason=True))
            assert result.as_numpy("finish_reason")[0] == b"length"
            assert result.as_numpy("text_output")[0].decode().startswith("Trimmed")
            with pytest.raises(Exception, match="logprobs"):
                client.infer("llm_bls", grpc_inputs("Trimmed", greedy(4), stream=False,
                                                    return_logprobs=True))
        finally:
            client.close()
