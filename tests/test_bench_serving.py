"""scripts/bench_serving.py end to end on CPU with the tiny model: a short run that shows it
works (direct engine, tritonserver, perf_analyzer and the python client, both models,
two clients each), not a timing."""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from scripts import bench_serving, serving_clients, serving_workload
from scripts.make_tiny_model import make_tiny_model
from tests.tritonserver import on_cpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_short_run_reports_every_path(tmp_path, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "the test command needs 2 CPUs (CI has 2)"
    client_cpu = allowed[-1]         # the clients on one CPU, the server on the others
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=2)
    out = tmp_path / "serving"
    saved = []                       # rows in the results each time they are written
    write = bench_serving.write_results
    monkeypatch.setattr(bench_serving, "write_results",
                        lambda prefix, meta, rows, *a, **k: (saved.append(len(rows)),
                                                             write(prefix, meta, rows, *a, **k)))
    inputs = []                      # the sampling each perf_analyzer input file was written with
    write_input = serving_clients.write_input_data
    monkeypatch.setattr(serving_clients, "write_input_data",
                        lambda *a, sampling=None, **k: (inputs.append(sampling),
                                                        write_input(*a, sampling=sampling, **k)))
    bench_serving.main(["--model", str(model), "--concurrency", "2", "--output-tokens", "6",
                        "--prompt-tokens", "20", "--waves", "1", "--clients", "2",
                        "--drivers", "perf_analyzer", "python", "--py-clients", "2",
                        "--sampling", '{"temperature": 0.7, "top_p": 0.9, "seed": 5}', "--out", str(out)]
                       + ["--client-cpus", str(client_cpu)])
    saved_run = json.loads((tmp_path / "serving.json").read_text())
    rows = saved_run["results"]
    assert saved_run["meta"]["sampling"] == {"max_tokens": 6, "temperature": 0.7, "ignore_eos": True,
                                             "top_p": 0.9, "seed": 5}
    # perf_analyzer's requests carried the sampling (its input files: test_requests_carry_...)
    assert inputs and all(s == {"temperature": 0.7, "top_p": 0.9, "seed": 5} for s in inputs), inputs
    seen = {(r["path"], r["round"]) for r in rows}
    assert seen == {("direct", "first"), ("direct", "steady"), ("llm", "first"),
                    ("llm", "steady"), ("llm_bls", "steady"),
                    ("llm (python client)", "steady"), ("llm_bls (python client)", "steady")}
    for r in rows:
        assert r["requests"] == serving_workload.MIN_REQUESTS and r["output_tok_s"] > 0, r
        assert r["ttft_p50_ms"] is not None and r["itl_p50_ms"] is not None, r
        # one response per llm_bls request: no client-side first token to speak of
        assert ("ttft_after_first_wave_p50_ms" in r) == (not r["path"].startswith("llm_bls")), r
        assert len(r["timeline_ms"]) == r["requests"]
        assert all(send <= first <= last for send, first, last in r["timeline_ms"])
    servers = bench_serving.cpu_text(set(allowed) - {client_cpu})
    for r in rows:                   # served: the server ran on the CPUs the clients did not
        if not r["path"].startswith("direct"):
            assert r["cpus"] == {"server": servers, "clients": str(client_cpu)}, r
    streamed = next(r for r in rows if r["path"] == "llm" and r["round"] == "steady")
    assert streamed["clients"] == 2 and streamed["responses_per_request"] >= 1
    py = next(r for r in rows if r["path"] == "llm (python client)")
    assert py["clients"] == 2 and py["server_tokens_per_response"] > 0
    md = (tmp_path / "serving.md").read_text()
    assert "| llm_bls | steady | 2 |" in md
    # The table has the slots' idle gaps and the prefix cache's share beside the rates.
    assert "| reissue gap p50 / p90 ms |" in md and "| prefix hit ratio |" in md
    row = next(line for line in md.splitlines() if line.startswith("| llm | steady |"))
    assert row.endswith(f"| {streamed['prefix_cache_hit_ratio']} |"), row
    assert f"| {streamed['reissue_gap_p50_ms']:.2f} / {streamed['reissue_gap_p90_ms']:.2f} |" in row
    # One llm instance: no gap between engines' loads (server_probe.LoadPoller).
    assert "| engine load gap p50 / p90 |" in md and "| - / - |" in row
    assert "engine_load_gap_p50" not in streamed
    assert streamed["requests_run_on_peer"] == 0        # no other instance to route to
    for r in rows:                   # the run fills its slots and drains: a full-load window
        assert r["full_load_tok_s"] > 0 and r["full_load_in_flight"] > 0, r
    assert all(v >= 0 for v in streamed["cpu_cores"].values()) and "tritonserver" in streamed["cpu_cores"]
    for r in rows:                   # on CPU no step runs as a CUDA graph
        if r["path"].startswith("direct") or r["path"].startswith("llm"):
            assert r["graph_step_fraction"] == 0.0, r
    for r in rows:                   # both paths say how much prefill the prefix cache saved
        if r["path"] in ("direct", "llm"):
            assert 0 <= r["prefix_cache_hit_ratio"] <= 1 and r["cascade_rows"] >= 0, r
    assert (tmp_path / "serving.server.log").exists()
    # Saved after every round (a run cut off keeps what it measured), then once at the end.
    assert saved == list(range(1, len(rows) + 1)) + [len(rows)]


def test_cpu_lists_read_and_write_ranges_and_confine_a_child():
    allowed = os.sched_getaffinity(0)
    last = max(allowed)
    assert bench_serving.cpu_list(str(last)) == {last}
    assert bench_serving.cpu_text({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert bench_serving.cpu_text({3}) == "3"
    for bad in (bench_serving.cpu_text(allowed), str(max(allowed) + 1)):   # all, or not ours
        with pytest.raises(argparse.ArgumentTypeError, match="some, not all"):
            bench_serving.cpu_list(bad)
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True, preexec_fn=on_cpus({last}))
    assert out.stdout.strip() == f"[{last}]"
    assert on_cpus(None) is None


def test_requests_carry_the_sampling_over_greedy(tmp_path):
    """--sampling's fields go into every request's sampling_parameters, over the greedy default;
    max_tokens and ignore_eos stay the run's."""
    path = tmp_path / "input.json"
    serving_clients.write_input_data(str(path), ["a", "b"], 7, stream=True,
                                     sampling={"temperature": 0.8, "top_k": 40})
    entries = json.loads(path.read_text())["data"]
    assert [json.loads(e["sampling_parameters"][0]) for e in entries] == [
        {"max_tokens": 7, "temperature": 0.8, "ignore_eos": True, "top_k": 40}] * 2
    assert all(e["stream"] == [True] for e in entries)
    serving_clients.write_input_data(str(path), ["a"], 3, stream=False)
    assert json.loads(json.loads(path.read_text())["data"][0]["sampling_parameters"][0]) == {
        "max_tokens": 3, "temperature": 0, "ignore_eos": True}


def test_sampling_cannot_change_the_runs_token_count():
    """--sampling's max_tokens and ignore_eos give way to the run's: every request makes exactly
    --output-tokens tokens, which the results count."""
    params = serving_clients.request_params(128, {"temperature": 0.8, "max_tokens": 16,
                                                  "ignore_eos": False})
    assert params == {"temperature": 0.8, "max_tokens": 128, "ignore_eos": True}


def test_perf_analyzer_clients_share_the_rounds_prompts():
    """Several perf_analyzer processes send, together, the n prompts the direct engine and the
    python client send, each once (they used to send the first n / clients prompts each, so a
    later round met prompts the prefix cache had never seen)."""
    prompts = [f"p{i}" for i in range(12)]
    split = serving_clients.client_prompts(prompts, 10, 4)
    assert sorted(p for part in split for p in part) == sorted(prompts[:10])
    assert [len(part) for part in split] == [3, 3, 2, 2]
    assert serving_clients.client_prompts(prompts, 10, 1) == [prompts[:10]]
    assert all(serving_clients.client_prompts(prompts, 2, 4))      # more clients than requests


def test_every_round_sends_prompts_new_to_its_engine():
    """The warm-up round's prompts are never sent again (a later round would be answered from
    the prefix cache); the direct round and the first served round at a concurrency send the
    same prompts; further served rounds there get prompts of their own; all fit."""
    args = bench_serving.main.__globals__["argparse"].Namespace(
        concurrency=[1, 4], waves=2, models=["llm", "llm_bls"], drivers=["perf_analyzer", "python"])
    rounds = serving_workload.PromptRounds(args)
    n = {c: serving_workload.num_requests(args, c) for c in args.concurrency}
    warm = set(range(rounds.warm(), rounds.warm() + max(n.values())))
    for c in args.concurrency:
        direct = set(range(rounds.direct(c), rounds.direct(c) + n[c]))
        served = [set(range(f, f + n[c])) for f in (rounds.served(c) for _ in range(4))]
        assert served[0] == direct and not direct & warm
        for i, a in enumerate(served):
            assert max(a) < rounds.total
            assert not a & warm
            assert all(not a & b for b in served[i + 1:])


def test_shared_prefix_prompts_start_alike_within_a_group_and_apart_across_groups(tmp_path):
    """With --shared-prefix-tokens, each group of consecutive prompts starts with the same
    tokens (about that many, as the server tokenizes them), then each its own; prompts of
    different groups part within their first KV block."""
    from transformers import AutoTokenizer
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=2)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = serving_workload.make_prompts(str(model), 9, 20, shared_tokens=80, group_size=4)
    ids = [tok.encode(p) for p in prompts]

    def common(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for i in (1, 2, 3):      # (+ the BOS token, and "\nRequest" before the own part's number)
        assert 76 <= common(ids[0], ids[i]) <= 80 + 8, (i, common(ids[0], ids[i]))
    assert common(ids[4], ids[5]) >= 76 and common(ids[8], ids[4]) < 16
    assert all(common(ids[0], ids[i]) < 16 for i in (4, 8))
    assert all(len(x) >= 80 + 15 for x in ids) and len(set(prompts)) == 9
    # Without shared tokens: the plain prompts, each apart from the others from its start.
    plain = serving_workload.make_prompts(str(model), 3, 20)
    assert all(p in s for p, s in zip(plain, prompts[:3]))


def test_with_shared_prefixes_every_round_starts_on_a_groups_first_prompt():
    """No round's prompts share a group (its prefix) with another round's: each starts at a
    multiple of the group size, and they stay apart and fit."""
    args = bench_serving.main.__globals__["argparse"].Namespace(
        concurrency=[3, 5], waves=3, models=["llm", "llm_bls"], drivers=["perf_analyzer"],
        shared_prefix_tokens=64, group_size=4)
    rounds = serving_workload.PromptRounds(args)
    n = {c: serving_workload.num_requests(args, c) for c in args.concurrency}
    spans = [(rounds.warm(), max(n.values()))]
    for c in args.concurrency:
        spans += [(rounds.served(c), n[c]) for _ in range(2)]
    assert rounds.direct(3) == spans[1][0]
    groups = [{i // 4 for i in range(f, f + k)} for f, k in spans]
    assert all(f % 4 == 0 and f + k <= rounds.total for f, k in spans)
    assert all(not a & b for i, a in enumerate(groups) for b in groups[i + 1:])


def test_reuse_prompts_sends_the_warm_up_prompts_in_every_round():
    args = bench_serving.main.__globals__["argparse"].Namespace(
        concurrency=[2, 8], waves=2, models=["llm"], drivers=["perf_analyzer"],
        reuse_prompts=True)
    rounds = serving_workload.PromptRounds(args)
    assert {rounds.direct(2), rounds.direct(8), rounds.served(8), rounds.served(8)} == {
        rounds.warm()}


def test_direct_stagger_starts_the_closed_loop_in_groups(tmp_path):
    """--direct-stagger-ms: the direct engine's workers start as --clients groups, each this
    much after the last (perf_analyzer's processes start apart too)."""
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=2)
    bench_serving.main(["--model", str(model), "--concurrency", "4", "--output-tokens", "4",
                        "--prompt-tokens", "12", "--waves", "1", "--clients", "2",
                        "--direct-stagger-ms", "300", "--skip-served",
                        "--out", str(tmp_path / "s")])
    rows = json.loads((tmp_path / "s.json").read_text())["results"]
    for r in rows:                   # the second group's first request is 300 ms late
        assert max(send for send, _, _ in r["timeline_ms"]) >= 300, r["round"]
    delays = [bench_serving.start_delay_s(w, 256, 4, 1.0) for w in range(256)]
    assert [delays.count(d) for d in (0.0, 1.0, 2.0, 3.0)] == [64, 64, 64, 64]
    assert delays == sorted(delays)
    assert [bench_serving.start_delay_s(w, 5, 2, 1.0) for w in range(5)] == [0, 0, 0, 1, 1]


def test_direct_concurrency_below_the_engine_count_runs_c_streams():
    """c = 1 on 2 direct engines runs one stream, on the first engine; the second gets no
    command and is not waited for (with max(c_i, 1) each ran one: two streams)."""
    import io

    class Worker:                    # a direct_worker's pipes: one answer ready
        def __init__(self):
            self.stdin = io.StringIO()
            self.stdout = io.StringIO(json.dumps({"times": [[0.0, 0.1, 0.2]], "steps": 4,
                                                  "graph_steps": 2, "prompt_tokens": 8,
                                                  "cached_prompt_tokens": 0,
                                                  "cascade_rows": 0}) + "\n")
    engines = bench_serving.DirectEngines.__new__(bench_serving.DirectEngines)
    engines.procs, engines.groups, engines.stagger_s = [Worker(), Worker()], 1, 0.0
    times, stats = engines.run(1, 10, "c1", 5)
    assert engines.procs[0].stdin.getvalue() == "run 1 10 c1 5 1 0.0\n"
    assert engines.procs[1].stdin.getvalue() == ""
    assert times == [[0.0, 0.1, 0.2]] and stats["graph_step_fraction"] == 0.5
    for w in engines.procs:
        w.stdout.seek(0)
    engines.procs[0].stdin, engines.procs[1].stdin = io.StringIO(), io.StringIO()
    engines.run(3, 10, "c3", 0)      # 3 on 2 engines: 2 + 1, 5 requests each
    assert [w.stdin.getvalue() for w in engines.procs] == ["run 2 5 c3 0 1 0.0\n",
                                                           "run 1 5 c3 5 1 0.0\n"]


def test_ttft_after_the_first_wave_leaves_out_the_first_c_sends():
    # c = 2: the first two sends are the opening burst (slow first tokens), the rest steady.
    starts = [0.0, 0.001, 1.0, 1.5, 2.0]
    ttft_ms = np.array([700.0, 650.0, 10.0, 30.0, 20.0])
    r = serving_clients.after_first_wave(starts, ttft_ms, 2)
    assert r["ttft_after_first_wave_p50_ms"] == 20.0
    assert serving_clients.after_first_wave(starts, ttft_ms, 5) == {}


def test_arrival_spread_tells_even_sends_from_bursts():
    """Sends after the first wave: one every 10 ms fill every 50 ms bin alike (cv 0, the busiest
    fifth of the bins holds a fifth); the same number in bursts of 20 every second do not."""
    first = [0.0] * 4
    even = first + [0.01 * i for i in range(200)]
    r = serving_clients.arrival_spread(even, 4)
    assert r == {"arrivals_cv_50ms": 0.0, "arrivals_in_busiest_fifth": 0.2}
    bursts = first + [float(i // 20) for i in range(200)]
    b = serving_clients.arrival_spread(bursts, 4)
    assert b["arrivals_cv_50ms"] > 3 and b["arrivals_in_busiest_fifth"] == 1.0
    assert serving_clients.arrival_spread(first, 4) == {}


def _outputs(cfg_path) -> dict[str, str]:
    text = open(cfg_path).read()
    block = text[text.index("output ["):]
    block = block[:block.index("\n]")]
    return dict(re.findall(r'name:\s*"(\w+)"\s*data_type:\s*(\w+)', block))


def test_the_benchs_repository_declares_no_output_perf_analyzer_cannot_export(tmp_path):
    """perf_analyzer records outputs a response leaves out as bytes the server never sent; an
    FP32 one that read as NaN left its profile export empty (about one run in twelve of the
    test above). The bench's copy declares no FP32 output, the shipped repository does, and
    the copy still takes the settings and the GPU instance kind."""
    shipped = {m: _outputs(os.path.join(ROOT, "model_repository", m, "config.pbtxt"))
               for m in ("llm", "llm_bls")}
    assert all("TYPE_FP32" in outs.values() for outs in shipped.values())
    params = bench_serving.make_repository(str(tmp_path / "r"), str(tmp_path / "m"),
                                           {"max_num_seqs": "7"}, gpus=1)
    assert params["max_num_seqs"] == "7"
    for m, outs in shipped.items():
        copied = _outputs(tmp_path / "r" / m / "config.pbtxt")
        assert copied == {k: v for k, v in outs.items() if v != "TYPE_FP32"}
    assert "kind: KIND_GPU" in (tmp_path / "r" / "llm" / "config.pbtxt").read_text()


def test_cpu_instances_give_llm_that_many_instances_and_bls_one(tmp_path):
    """--cpu-instances: llm gets that many CPU instances (each its engine, as one per GPU);
    llm_bls keeps its own count."""
    bench_serving.make_repository(str(tmp_path / "r"), str(tmp_path / "m"), {}, gpus=0,
                                  cpu_instances=3)
    llm = (tmp_path / "r" / "llm" / "config.pbtxt").read_text()
    bls = (tmp_path / "r" / "llm_bls" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 3 kind: KIND_CPU } ]" in llm
    assert "instance_group [ { count: 8 kind: KIND_CPU } ]" in bls


def test_sampling_that_changes_a_requests_token_count_is_refused():
    """n, stop and stop_token_ids passed through --sampling, and the results counted
    --output-tokens a request whatever the requests made (n 2: half the tokens counted)."""
    from scripts.bench_common import sampling_fields
    for fields in ({"n": 2}, {"stop": ["x"]}, {"stop_token_ids": [7]}):
        with pytest.raises(argparse.ArgumentTypeError, match="would change how many tokens"):
            sampling_fields(json.dumps(fields))
    assert sampling_fields('{"temperature": 0.8, "min_tokens": 4}') == {"temperature": 0.8,
                                                                        "min_tokens": 4}


def test_results_json_puts_lists_of_numbers_on_one_line_and_reads_back_the_same():
    """A served run's record held its per-request timelines one number a line (~1 MB a run);
    the repository must travel to the GPU machine within a size limit."""
    from scripts.bench_common import results_json
    doc = {"meta": {"command": "x --sizes [\n 1,\n 2\n]"}, "results": [
        {"timeline_ms": [0.5, 1, -2e-05, 3.25], "nested": [[1, 2], [3]], "mixed": [1, "a"],
         "empty": [], "one": [7]}]}
    text = results_json(doc)
    assert json.loads(text) == doc
    assert '"timeline_ms": [0.5, 1, -2e-05, 3.25]' in text and '"one": [7]' in text
    assert '"command": "x --sizes [\\n 1,\\n 2\\n]"' in text      # strings untouched
