from scripts.ttft_trace import main, summarize


def _row(t0, loop, tok, engine, send):
    return {"submitted": t0, "serving": t0 + loop, "in_engine": t0 + loop + tok,
            "first_output": t0 + loop + tok + engine, "first_sent": t0 + loop + tok + engine + send}


def test_summary_splits_the_time_to_first_token_into_its_stages():
    rows = [_row(0.0, 0.001, 0.002, 0.100, 0.003), _row(1.0, 0.003, 0.002, 0.300, 0.001),
            _row(2.0, 0.002, 0.002, 0.200, 0.002)]
    s = summarize(rows)
    assert s["execute -> loop"]["p50_ms"] == 2.0
    assert s["engine"] == {"p50_ms": 200.0, "p90_ms": 200.0, "mean_ms": 200.0}
    assert s["outbox + send"]["mean_ms"] == 2.0
    assert s["execute -> first sent"]["p50_ms"] == 206.0


def test_main_prints_each_round(tmp_path, capsys):
    import json
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(_row(float(i), 0.001, 0.001, 0.01 * (i + 1), 0.001)) + "\n"
                            for i in range(4)))
    main([str(path), "--rounds", "2"])
    out = capsys.readouterr().out
    assert "round 1: 2 requests" in out and "round 2: 2 requests" in out
