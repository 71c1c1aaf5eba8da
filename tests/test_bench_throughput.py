"""scripts/bench_throughput.py on CPU with the tiny model: one child process per max_num_seqs,
a row per (workload, max_num_seqs), a failing child recorded without losing the others, the
HF baseline and where a step's time goes (a check that it works, not a timing)."""
import json
import os
import re
import subprocess
import sys

import pytest

from engine.step_timing import PHASES
from scripts.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One run for the tests below: max_num_seqs 0 fails in its child (the engine config
    rejects it) between two that work."""
    tmp = tmp_path_factory.mktemp("throughput")
    model = make_tiny_model(tmp / "m", arch="llama", seed=4)
    out = tmp / "throughput"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_throughput.py"),
                        "--model", str(model), "--dtype", "float32", "--workloads", "8x4",
                        "16x4", "--num-prompts", "4", "--max-num-seqs", "2", "0", "4",
                        "--hf-prompts", "2", "--hf-batch", "1", "2", "--step-trace",
                        "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    return rows, out.with_suffix(".md").read_text(), out


def test_a_row_per_workload_and_max_num_seqs(sweep):
    rows, md, _ = sweep
    assert sorted((r["workload"], r["max_num_seqs"]) for r in rows) == sorted(
        (w, n) for w in ("8/4", "16/4") for n in (2, 0, 4))
    ok = [r for r in rows if not r["failed"]]
    assert sorted((r["workload"], r["max_num_seqs"]) for r in ok) == sorted(
        (w, n) for w in ("8/4", "16/4") for n in (2, 4))
    for r in ok:
        assert r["engine_output_tok_s"] > 0 and r["engine_total_tok_s"] > r["engine_output_tok_s"]
        assert r["hf_output_tok_s"] > 0 and r["speedup_vs_hf"] > 0 and r["hf_prompts"] == 2
        # HF at each batch asked for; the baseline is the best of them
        assert sorted(r["hf_by_batch"]) == ["1", "2"] and r["hf_batch"] in (1, 2)
        assert r["hf_output_tok_s"] == max(r["hf_by_batch"].values())
        ms = r["step_ms"]
        assert all(ms[p] > 0 for p in PHASES) and ms["graph_step_share"] == 0.0, ms
        assert r["preemptions"] == 0 and r["kv_blocks"] > 0     # a pool that holds them all
    assert "Where a step's time goes" in md and "| 16/4 | 4 | 4" in md
    assert "- HF generate on 8/4 by batch: 1: " in md


def test_step_trace_has_every_step_of_each_run(sweep):
    rows, _, out = sweep
    for r in (r for r in rows if not r["failed"]):
        inp, n_out = r["workload"].split("/")
        trace = json.loads(open(f"{out}_trace_{inp}x{n_out}_seqs{r['max_num_seqs']}.json").read())
        at = {f: [row[i] for row in trace["rows"]] for i, f in enumerate(trace["fields"])}
        assert r["step_trace"]["steps"] == len(trace["rows"]) > 0
        # Each of the 4 prompts finishes once, with all its tokens.
        assert sum(at["finished"]) == 4 and sum(at["outputs"]) == 4 * int(n_out)
        assert at["t_ms"] == sorted(at["t_ms"])


def test_a_failing_child_is_a_failed_row(sweep):
    rows, md, _ = sweep
    failed = [r for r in rows if r["failed"]]
    assert [r["max_num_seqs"] for r in failed] == [0, 0]
    for r in failed:
        assert r["returncode"] == 1 and "engine_output_tok_s" not in r
        assert any("max_num_seqs must be an integer >= 1" in line for line in r["stderr_tail"])
    assert "| failed (exit 1) |" in md and "- max_num_seqs 0: exit code 1: `ValueError" in md


def test_the_best_max_num_seqs_per_workload_is_marked(sweep):
    rows, md, _ = sweep
    for w in ("8/4", "16/4"):
        best = max((r for r in rows if r["workload"] == w and not r["failed"]),
                   key=lambda r: r["engine_output_tok_s"])
        line = next(line for line in md.splitlines() if line.startswith(f"| {w} | ")
                    and "failed" in line)       # the table by max_num_seqs
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-1] == str(best["max_num_seqs"])
        assert re.findall(r"\*\*(\d+)\*\*", line) == [f"{best['engine_output_tok_s']:.0f}"]
        assert f"| {w} | 4 | {best['max_num_seqs']} (best) |" in md


def test_the_roofline_counts_an_fp8_caches_bytes():
    """1000 x 1000 on the 8B shape is KV-bound in decode: one byte a KV value instead of two
    takes most of a second off each decode step's floor; a prefill-only job does not change."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_common import PRESETS
    from bench_throughput import roofline_s
    cfg = PRESETS["llama-3.1-8b"]
    bf16 = roofline_s(cfg, 1000, 1000, 1000, 256, 2)
    assert roofline_s(cfg, 1000, 1000, 1000, 256, 2, kv_elem=2) == bf16
    fp8 = roofline_s(cfg, 1000, 1000, 1000, 256, 2, kv_elem=1)
    assert 0.5 * bf16 < fp8 < 0.75 * bf16
    assert roofline_s(cfg, 1000, 1000, 0, 256, 2, kv_elem=1) == roofline_s(cfg, 1000, 1000, 0, 256, 2)


def test_the_roofline_counts_fp8_weights():
    """FP8 projections: a byte a parameter in decode, the FP8 peak (twice bf16's) in prefill; the
    embeddings and lm_head (1.05B of the 8B model's 8.03B) stay at two bytes and bf16's peak."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_common import (BF16_DENSE_FLOPS, FP8_DENSE_FLOPS, PRESETS, param_count, projection_param_count,
                              weight_cost)
    from bench_throughput import roofline_s
    cfg = PRESETS["llama-3.1-8b"]
    p, q = param_count(cfg), projection_param_count(cfg)
    assert 6.9e9 < q < 7.0e9 and 8.0e9 < p < 8.1e9
    table = cfg["vocab_size"] * cfg["hidden_size"]     # the embedding table; lm_head as big
    bf16 = weight_cost(cfg, 2)
    # A decode step reads every matrix but the embedding table (it gathers a row a token) and
    # multiplies by the layers and lm_head; a prompt token skips lm_head, computed once a
    # sequence. The table was counted as read every step and as a matmul of every token.
    assert bf16.bytes == 2 * (p - table)
    # By hand for the 8B shape: 32 layers of qkv 4096 x 6144, o 4096 x 4096, gate/up/down
    # 3 x 4096 x 14336 and two norms (218,112,000 each), lm_head 128256 x 4096, the final norm.
    assert bf16.bytes == 2 * (32 * 218_112_000 + 525_336_576 + 4096) == 15_009_849_344
    assert bf16.s_per_token == pytest.approx(2 * (p - table) / BF16_DENSE_FLOPS)
    assert bf16.s_per_prompt_token == pytest.approx(2 * (p - 2 * table) / BF16_DENSE_FLOPS)
    assert bf16.s_per_sequence == pytest.approx(2 * table / BF16_DENSE_FLOPS)
    tied = weight_cost(cfg | {"tie_word_embeddings": True}, 2)   # one table: lm_head reads it
    assert tied.bytes == 2 * param_count(cfg | {"tie_word_embeddings": True})
    assert tied.s_per_prompt_token == bf16.s_per_prompt_token
    fp8 = weight_cost(cfg, 2, "fp8")
    assert fp8.bytes == 2 * (p - table) - q
    assert fp8.s_per_token == pytest.approx(2 * (p - table - q) / BF16_DENSE_FLOPS
                                            + 2 * q / FP8_DENSE_FLOPS)
    prefill_only = roofline_s(cfg, 1000, 2048, 0, 256, 2)
    assert roofline_s(cfg, 1000, 2048, 0, 256, 2, quantization="fp8") < 0.6 * prefill_only
    assert roofline_s(cfg, 1000, 1000, 1000, 256, 2, quantization="fp8") < roofline_s(cfg, 1000, 1000, 1000, 256, 2)


def test_sampling_settings_reach_the_engines_requests(tmp_path):
    """--sampling: the requests run with those SamplingParams fields (penalties here), and the
    rows say so."""
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=4)
    out = tmp_path / "tp"
    sampling = {"repetition_penalty": 1.2, "frequency_penalty": 0.5}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_throughput.py"),
                        "--model", str(model), "--dtype", "float32", "--workloads", "8x4",
                        "--num-prompts", "3", "--max-num-seqs", "2", "--hf-prompts", "0",
                        "--sampling", json.dumps(sampling), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["meta"]["sampling"] == sampling
    [row] = doc["results"]
    assert row["sampling"] == sampling and not row["failed"] and row["engine_output_tok_s"] > 0


def test_run_engine_applies_the_sampling_fields(tmp_path):
    from engine import LLM
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_throughput import run_engine
    llm = LLM(str(make_tiny_model(tmp_path / "m", arch="llama", seed=4)), dtype="float32", device="cpu",
              num_kv_blocks=32, max_model_len=64)
    seen = []
    generate = llm.generate
    llm.generate = lambda prompts, params: seen.append(params) or generate(prompts, params)
    run_engine(llm, [[5, 6, 7]], 3, {"presence_penalty": 0.5, "max_tokens": 99})
    [params] = seen
    assert params.presence_penalty == 0.5 and params.temperature == 0.0
    assert params.max_tokens == 3 and params.ignore_eos        # the workload's length wins


def test_bad_workloads_and_count_changing_sampling_are_usage_errors(tmp_path):
    """--workloads 128 (no x) ended in a traceback; --sampling with n, stop or stop_token_ids
    ran, and the rows counted output_len tokens a prompt whatever the requests made."""
    for args, needle in ((["--workloads", "128"], "a workload is INPUTxOUTPUT"),
                         (["--workloads", "0x4"], "a workload is INPUTxOUTPUT"),
                         (["--sampling", '{"n": 2}'], "n would change how many tokens"),
                         (["--sampling", '{"stop": ["a"], "stop_token_ids": [1]}'],
                          "stop, stop_token_ids would change")):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_throughput.py"),
                            "--model", str(tmp_path / "none"), *args, "--out", str(tmp_path / "o")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
