"""scripts/bench_shared_prefix.py at a tiny size (--quick: tiny model on CPU), and its floor."""
import json

from scripts.bench_common import PRESETS
from scripts.bench_shared_prefix import floor_s, main, make_prompts, parse_workload


def test_quick_run_writes_every_mode_and_order(tmp_path):
    out = tmp_path / "shared_prefix"
    main(["--quick", "--out", str(out)])
    data = json.loads((tmp_path / "shared_prefix.json").read_text())
    rows = {(r["mode"], r["order"]): r for r in data["results"]}
    assert set(rows) == {(m, o) for m in ("off", "apc", "groups") for o in ("grouped", "shuffled")}
    for (mode, order), r in rows.items():
        assert r["requests_per_s"] > 0 and r["num_requests"] == 12
        # Host time before the first step and outside steps: parts of the run's wall time.
        assert 0 < r["intake_s"] <= r["outside_steps_s"] < r["elapsed_s"]
        # Its phases (LLM.intake_s) lie inside it; only groups mode finds groups.
        phases = r["intake_phases_s"]
        assert set(phases) == {"prompts", "grouping", "scheduling"}
        assert sum(phases.values()) <= r["intake_s"] and phases["prompts"] > 0
        assert (phases["grouping"] > 0) == (mode == "groups")
        # 3 groups of 4 over a 64-token prefix, 16 own tokens each.
        full = 12 * 80
        if mode == "off":
            assert r["computed_prompt_tokens"] == full and r["cascade_rows"] == 0
        if mode == "groups":
            assert r["computed_prompt_tokens"] == full - 9 * 64 and r["cascade_rows"] > 0
    md = (tmp_path / "shared_prefix.md").read_text()
    assert "| g4-p64 |" not in md and "| 4 x 64 | 12 / 12 / 12 | shuffled |" in md
    # Parts merge into one table; a later part replaces the same run.
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"meta": data["meta"], "results": [dict(
        rows[("off", "grouped")], requests_per_s=1.0)]}))
    main(["--merge", str(tmp_path / "shared_prefix.json"), str(part), "--out", str(out)])
    merged = json.loads((tmp_path / "shared_prefix.json").read_text())["results"]
    assert len(merged) == 6
    assert [r["requests_per_s"] for r in merged if (r["mode"], r["order"]) == ("off", "grouped")] == [1.0]


def test_workloads_and_prompts():
    rfc = parse_workload("rfc", None, 200, 100)
    assert (rfc["num_requests"], rfc["degree"], rfc["prefix"]) == (6400, 16, 2000)
    assert parse_workload("g64-p8000", None, 200, 100)["num_requests"] == 512
    assert parse_workload("g64-p500", 100, 200, 100)["num_requests"] == 64
    w = dict(degree=4, prefix=32, own=8, num_requests=12)
    grouped, shuffled = make_prompts(w, "grouped", 5000), make_prompts(w, "shuffled", 5000)
    assert sorted(map(tuple, grouped)) == sorted(map(tuple, shuffled)) and grouped != shuffled
    assert all(p[:32] == grouped[4 * (i // 4)][:32] for i, p in enumerate(grouped))


def test_floor_counts_each_prefix_once():
    cfg = PRESETS["llama-3.1-8b"]
    rfc = parse_workload("rfc", None, 200, 100)
    t = floor_s(cfg, rfc, 256, 2)
    # Prefill alone: (400 x 2000 + 6400 x 200) tokens x 2 x 8.03e9 FLOPs at 989 TFLOP/s ~ 34 s;
    # decode: 2500 steps of 16 GB of weights, 6.8 GB/step of KV ... ~ 10 s.
    assert 35 < t < 60, t
    more_sharing = dict(rfc, degree=64)
    assert floor_s(cfg, more_sharing, 256, 2) < t


def test_step_trace_records_every_step(tmp_path):
    out = tmp_path / "sp"
    main(["--quick", "--step-trace", "--modes", "groups", "--orders", "shuffled", "--out", str(out)])
    row = json.loads((tmp_path / "sp.json").read_text())["results"][0]
    trace = json.loads((tmp_path / "sp_trace_g4-p64_groups_shuffled.json").read_text())
    fields, rows = trace["fields"], trace["rows"]
    summary = row["step_trace"]
    # Every step() call of the run, in order; the last only collects (nothing left running).
    assert summary["steps"] == len(rows) >= row["steps"]
    at = {f: [r[i] for r in rows] for i, f in enumerate(fields)}
    assert at["t_ms"] == sorted(at["t_ms"]) and at["running"][-1] == 0
    # Each request finishes once and each of its 4 tokens comes out once.
    assert sum(at["finished"]) == 12 and sum(at["outputs"]) == 12 * 4
    # On CPU the GPU's time is 0: a step's host time is all over it.
    assert all(g == 0 for g in at["gpu"]) and summary["gpu_busy_ms"] == 0
    host = sum(sum(r[1:7]) for r in rows)
    assert abs(summary["host_over_gpu_ms"] - host) < 0.1 * len(rows) + 1e-6
    assert abs(summary["worst"][0]["over_ms"] - max(sum(r[1:7]) for r in rows)) < 1e-3
    assert summary["between_steps_ms"] >= 0


def test_step_trace_summary_on_known_rows():
    """The summary's figures for three hand-made steps (ms): host phases 3 over a GPU step of 5
    (nothing over), 9 over 4 (5 over), 2 over 0 (2 over); gaps between them 1 and 4."""
    from scripts.bench_common import StepTrace

    class Core:
        step = None
    trace = StepTrace(Core())
    trace.close()
    #              t_ms  sched prep  launch wait post  update gpu  graph run out fin
    trace.rows = [[0.0, 1.0, 0.5, 1.0, 0.5, 0.0, 0.0, 5.0, 1, 8, 8, 0],
                  [4.0, 2.0, 1.0, 4.0, 0.0, 1.0, 1.0, 4.0, 1, 8, 8, 2],
                  [17.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.5, 0.0, 0, 6, 6, 6]]
    s = trace.summary(top=2)
    assert s["steps"] == 3 and s["gpu_busy_ms"] == 9.0
    assert s["host_over_gpu_ms"] == 7.0 and s["between_steps_ms"] == 5.0
    assert [(w["step"], w["over_ms"], w["finished"]) for w in s["worst"]] == [(1, 5.0, 2), (2, 2.0, 6)]


def test_rfc_num_requests_is_whole_groups_as_sent():
    """--num-requests for rfc rounds to whole groups of 16 (at least one), as the sweep does: the
    rates divide the count that make_prompts sends."""
    for asked, sent in ((100, 96), (5, 16), (None, 6400)):
        w = parse_workload("rfc", asked, 200, 100)
        assert w["num_requests"] == sent
        assert len(make_prompts(dict(w, prefix=4, own=2), "grouped", 5000)) == sent


def test_workload_flags_it_would_ignore_or_cannot_run_are_usage_errors():
    import pytest
    with pytest.raises(SystemExit, match="--own-len and --output-len are for"):
        parse_workload("rfc", None, 50, 10)          # ran 200 / 100 without a word
    for name, own, out in (("g0-p100", 200, 100), ("g4-p0", 200, 100), ("g4-p100", 0, 100),
                           ("g4-p100", 200, 0), ("four-p100", 200, 100)):
        with pytest.raises(SystemExit, match="expected 'rfc'"):
            parse_workload(name, None, own, out)     # g0 was a ZeroDivisionError
    assert parse_workload("g4-p100", None, 50, 10)["own"] == 50
