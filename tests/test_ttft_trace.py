import gzip
import json

import pytest

from scripts.ttft_trace import in_flight, join_core_log, main, summarize, turnarounds


def _row(t0, loop, tok, engine, send, decode=0.5, final_send=0.004):
    first = t0 + loop + tok + engine
    return {"submitted": t0, "serving": t0 + loop, "in_engine": t0 + loop + tok,
            "first_output": first, "first_sent": first + send,
            "final_output": first + decode, "final_sent": first + decode + final_send}


def test_summary_splits_the_time_to_first_token_into_its_stages():
    rows = [_row(0.0, 0.001, 0.002, 0.100, 0.003), _row(1.0, 0.003, 0.002, 0.300, 0.001),
            _row(2.0, 0.002, 0.002, 0.200, 0.002)]
    s = summarize(rows)
    assert s["execute -> loop"]["p50_ms"] == 2.0
    assert s["engine"] == {"p50_ms": 200.0, "p90_ms": 200.0, "mean_ms": 200.0, "left_out": 0}
    assert s["outbox + send"]["mean_ms"] == 2.0
    assert s["execute -> first sent"]["p50_ms"] == 206.0
    assert s["final: outbox + send"]["mean_ms"] == 4.0


def test_a_request_without_a_stages_times_is_left_out_of_that_stage_only():
    """Seen once in 10,240 served requests: a final response sent with no last step's output
    timed. It counts in every other stage."""
    rows = [_row(0.0, 0.001, 0.002, 0.100, 0.003), _row(1.0, 0.003, 0.002, 0.300, 0.001)]
    rows[1]["final_output"] = None
    s = summarize(rows)
    assert s["final: outbox + send"] == {"p50_ms": 4.0, "p90_ms": 4.0, "mean_ms": 4.0,
                                         "left_out": 1}
    assert s["engine"]["left_out"] == 0 and s["engine"]["mean_ms"] == 200.0


def test_turn_around_pairs_each_final_response_with_the_request_after_the_first_c():
    # A closed loop of 2 clients: each sends its next request 10 / 30 ms after its last
    # final response was handed to the server.
    rows, t = [], {0: 0.0, 1: 0.001}
    for n in range(3):
        for client, gap in ((0, 0.010), (1, 0.030)):
            row = _row(t[client], 0.001, 0.001, 0.1, 0.001)
            rows.append(row)
            t[client] = row["final_sent"] + gap
    around = turnarounds(rows)
    order = sorted(range(len(rows)), key=lambda j: rows[j]["submitted"])
    assert [None if around[j] is None else round(around[j], 3) for j in order] == \
        [10.0, 30.0, 10.0, 30.0, None, None]


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_main_prints_each_round(tmp_path, capsys, name):
    text = "".join(json.dumps(_row(float(i), 0.001, 0.001, 0.01 * (i + 1), 0.001)) + "\n"
                   for i in range(4))
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    main([str(path), "--rounds", "2"])
    out = capsys.readouterr().out
    assert "round 1: 2 requests" in out and "round 2: 2 requests" in out


def _closed_loop_rounds(pause, clients=2, per_client=3, gap=0.010):
    """Two rounds of a closed loop of `clients`, each sending its next request `gap` s after
    its last final response, the second round starting `pause` s after the first ended (as
    bench_serving's warm-up and steady rounds)."""
    rows, t = [], {k: 0.001 * k for k in range(clients)}
    for rnd in range(2):
        for _ in range(per_client):
            for k in range(clients):
                row = _row(t[k], 0.001, 0.001, 0.1, 0.001)
                rows.append(row)
                t[k] = row["final_sent"] + gap
        restart = max(t.values()) + pause
        t = {k: restart + 0.001 * k for k in range(clients)}
    return sorted(rows, key=lambda r: r["submitted"])


def test_a_rounds_turn_around_leaves_out_the_pause_before_the_next_round(tmp_path, capsys):
    """A round's last final responses were paired with the next round's first requests: the
    pause between rounds (seconds) counted as the first round's client turn-around."""
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _closed_loop_rounds(pause=5.0)))
    main([str(path), "--rounds", "2"])
    lines = [x for x in capsys.readouterr().out.splitlines() if "client turn-around" in x]
    assert len(lines) == 2
    for line in lines:
        assert line.split()[2:] == ["p50", "10.0", "p90", "10.0", "mean", "10.0", "ms"], line


def test_a_trace_written_before_final_times_were_noted_still_gives_its_stages(tmp_path, capsys):
    """Traces older than the final_output / final_sent fields (benchmarks/h200's
    ttft_trace_77a91ba.jsonl) raised KeyError in the turn-around and gave no stage at all."""
    rows = _closed_loop_rounds(pause=1.0)
    for r in rows:
        del r["final_output"], r["final_sent"]
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main([str(path), "--rounds", "2"])
    out = capsys.readouterr().out
    assert "round 2: 6 requests" in out and "engine" in out and "turn-around" not in out


def _core_line(row, index, to_core, first_back, final_back):
    """The core's line for a traced row: taken `to_core` s after in_engine, its outputs sent
    `first_back` / `final_back` s before the front end's reader had them."""
    return {"front": 10, "core": 20, "index": index, "taken": row["in_engine"] + to_core,
            "first_sent": row["first_output"] - first_back,
            "final_sent": row["final_output"] - final_back, "finish": "length"}


def test_the_core_log_splits_the_engines_part_and_counts_requests_in_each():
    rows = [_row(float(i), 0.001, 0.002, 0.100, 0.003, decode=1.0) for i in range(3)]
    for i, r in enumerate(rows):
        r.update(front=10, core=20, index=i)
    rows.append(_row(5.0, 0.001, 0.002, 0.1, 0.003) | {"front": 10, "core": None, "index": None})
    core = [_core_line(r, i, 0.010, 0.002, 0.030) for i, r in enumerate(rows[:3])]
    core.append(_core_line(rows[0], 0, 0.0, 0.0, 0.0) | {"front": 11})   # another front end's
    assert join_core_log(rows, core) == 3
    assert "core_taken" not in rows[3]
    s = summarize(rows[:3], [("to core", "in_engine", "core_taken"),
                             ("back: final", "core_final_sent", "final_output")])
    assert s["to core"]["mean_ms"] == 10.0 and s["back: final"]["p50_ms"] == 30.0
    # Over [0.5, 2.5] s: rows 0-2 are in the engine 0.003-1.103 s after their start; 30 ms of
    # each is on the way back, within the window for rows 0 and 1 (row 2's falls after it).
    window = (0.5, 2.5)
    engine = in_flight(rows, "in_engine", "final_output", *window)
    assert engine == pytest.approx((0.603 + 1.1 + 0.497) / 2.0)
    back = in_flight(rows, "core_final_sent", "final_output", *window)
    assert back == pytest.approx(0.060 / 2.0)


def test_main_with_the_core_log_prints_the_parts_and_the_counts(tmp_path, capsys):
    rows = [_row(float(i), 0.001, 0.002, 0.100, 0.003) | {"front": 1, "core": 2, "index": i}
            for i in range(4)]
    trace, core = tmp_path / "t.jsonl", tmp_path / "c.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    core.write_text("".join(json.dumps(_core_line(r, i, 0.01, 0.001, 0.001) | {
        "front": 1, "core": 2}) + "\n" for i, r in enumerate(rows)))
    main([str(trace), "--rounds", "2", "--core-log", str(core)])
    out = capsys.readouterr().out
    assert "core log: 4 of 4 requests joined" in out
    assert out.count("\n  to core ") == 2 and out.count("on the way back") == 2
    assert "in the core: taken -> final sent" in out


def test_main_with_the_core_log_alone_counts_the_requests_in_the_core(tmp_path, capsys):
    """A directly driven engine has no trace: its core's part alone. Two requests 1 s apart,
    each 2 s in the core, its first output sent after 0.5 s."""
    core = tmp_path / "c.jsonl"
    core.write_text("".join(json.dumps({"front": 1, "core": 2, "index": i, "taken": float(i),
                                        "first_sent": i + 0.5, "final_sent": i + 2.0,
                                        "finish": "length"}) + "\n" for i in range(2)))
    main(["--core-log", str(core)])
    out = capsys.readouterr().out
    assert "core log alone: 2 requests" in out and "client turn-around" not in out
    assert "core: to final sent    p50   2000.0" in out
    # The middle half of [0, 3] is [0.75, 2.25]: request 0 is in the core through 0.75-2.0,
    # request 1 through 1.0-2.25; before a first output: 0 none of it, 1 from 1.0 to 1.5.
    counts = {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1])
              for line in out.splitlines() if line.startswith("    ")}
    assert counts == {"in the core: taken -> final sent": 1.7,
                      "of them before their first output": 0.3}
    with pytest.raises(SystemExit):
        main([])
