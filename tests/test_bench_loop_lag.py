"""scripts/bench_loop_lag.py: its statistics on hand-made arrivals, its repository copy, its
prompts, and a tiny run through a real tritonserver."""
import json
import os
import re
import threading

import pytest

from scripts.bench_loop_lag import (StreamSlot, flood_prompt, is_stalled, main, make_repo,
                                    phase_stats, short_prompt, summary)
from scripts.make_tiny_model import make_tiny_model


def slot_with(requests):
    s = StreamSlot("localhost:1", 0, {}, threading.Event())
    s.requests = requests
    return s


def test_phase_stats_gaps_per_token_in_the_window_and_ttft_by_send_time():
    # Request A: sent at 0, responses at 1, 2, 2.5 (2 tokens), 5. Request B: sent at 4.5,
    # first response at 6, then 6.1.
    slots = [slot_with([(0.0, [(1.0, 1), (2.0, 1), (2.5, 2), (5.0, 1)]),
                        (4.5, [(6.0, 1), (6.1, 1)])])]
    whole = phase_stats(slots, 0.0, 10.0)
    # Gaps: 1 s (1 token), 0.5 s over 2 tokens -> 0.25 s twice, 2.5 s, 0.1 s.
    assert whole["num_itl"] == 5
    assert whole["itl_max_ms"] == pytest.approx(2500)
    assert whole["itl_p50_ms"] == pytest.approx(250)
    assert whole["worst_gap_per_request_p99_ms"] == pytest.approx(100 + 0.99 * 2400)  # [2500, 100]
    assert whole["num_ttft"] == 2 and whole["ttft_max_ms"] == pytest.approx(1500)
    assert whole["tokens_per_s"] == pytest.approx(7 / 10)
    # A gap counts where its later response arrived; TTFT where its request was sent.
    late = phase_stats(slots, 4.0, 10.0)
    assert late["num_itl"] == 2 and late["itl_max_ms"] == pytest.approx(2500)
    assert late["num_ttft"] == 1 and late["ttft_p50_ms"] == pytest.approx(1500)
    assert phase_stats(slots, 20.0, 30.0)["itl_p99_ms"] is None


def test_make_repo_keeps_the_llm_parameters_and_sets_model_and_extra(tmp_path):
    params = make_repo(str(tmp_path / "repo"), "models/x", {"tokenize_inline_max_chars": "7"})
    cfg = (tmp_path / "repo" / "llm" / "config.pbtxt").read_text()
    written = dict(re.findall(r'key: "([^"]+)" value: \{ string_value: "([^"]*)" \}', cfg))
    assert written == params
    assert params["model"] == os.path.abspath("models/x")
    assert params["tokenize_inline_max_chars"] == "7"
    assert {"max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"} <= set(params)
    assert "decoupled: true" in cfg


def test_flood_prompts_are_exact_length_varied_and_distinct():
    a, b = flood_prompt(0, 30_000), flood_prompt(1, 30_000)
    assert len(a) == len(b) == 30_000 and a != b
    lines = a.splitlines()
    assert len(set(lines)) == len(lines) > 100
    assert short_prompt(3, 4) != short_prompt(3, 5)


def test_bench_loop_lag_tiny_run_writes_results(tmp_path):
    model = make_tiny_model(tmp_path / "llama", arch="llama", seed=4)
    out = main(["--modes", "process", "--streams", "2", "--max-tokens", "8",
                "--flood-requests", "3", "--flood-chars", "20000", "--unloaded-seconds", "1",
                "--model", str(model), "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "loop_lag.json").read_text())
    assert (tmp_path / "loop_lag.md").read_text().startswith("# Short streams'")
    for key in ("command", "commit", "date", "cpu", "cores", "load_average_at_start",
                "summary", "source_digest"):
        assert key in data["meta"], key
    rows = {r["phase"]: r for r in data["results"]}
    assert set(rows) == {"unloaded", "flood"} and out["meta"]["repeats"] == 1
    flood = rows["flood"]["flood"]
    assert flood["num_answers"] == flood["num_errors"] == 3 and flood["all_answered"]
    assert "max_model_len" in flood["first_error"]
    assert rows["flood"]["num_slot_errors"] == 0
    for phase in rows.values():
        assert phase["num_itl"] > 0 and phase["itl_p50_ms"] <= phase["itl_p99_ms"]
        assert phase["loop_lag"]["count"] > 0
    assert rows["flood"]["itl_p99_ratio"] == pytest.approx(
        rows["flood"]["itl_p99_ms"] / rows["unloaded"]["itl_p99_ms"])


def test_a_mode_whose_streams_stalled_fails_whatever_its_p99():
    unloaded = {"num_itl": 1000, "duration_s": 10.0}
    assert not is_stalled(unloaded, {"num_itl": 1000, "duration_s": 20.0})   # half the pace
    assert is_stalled(unloaded, {"num_itl": 999, "duration_s": 20.0})
    runs = [{"mode": m, "settings": "", "itl_p99_ratio": 0.8, "stalled": stalled}
            for m, stalled in (("ok", False), ("ok", False), ("frozen", True), ("frozen", False))]
    out = summary(runs)
    assert out["ok"]["meets_target"] and out["ok"]["stalled"] == 0
    assert not out["frozen"]["meets_target"] and out["frozen"]["stalled"] == 1
