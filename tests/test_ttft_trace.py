import gzip
import json

import pytest

from scripts.ttft_trace import main, summarize, turnarounds


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
