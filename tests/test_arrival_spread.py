"""scripts/arrival_spread.py: the sends' spread and TTFT of each streaming round of stored
bench_serving results; llm_bls rounds and c=1 rounds are left out."""
import json

from scripts import arrival_spread


def test_rows_of_stored_runs(tmp_path, capsys):
    even = [[10.0 * i, 10.0 * i + 5.0, 10.0 * i + 50.0] for i in range(204)]  # ms; 40 bins after c
    bursts = [[1000.0 * (i // 20), 1000.0 * (i // 20) + 30.0, 1000.0 * (i // 20) + 90.0]
              for i in range(200)]
    results = [{"path": "direct", "round": "steady", "concurrency": 4, "timeline_ms": even},
               {"path": "llm", "round": "steady", "concurrency": 4, "timeline_ms": bursts},
               {"path": "llm", "round": "steady", "concurrency": 1, "timeline_ms": even},
               {"path": "llm_bls", "round": "steady", "concurrency": 4, "timeline_ms": even}]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {}, "results": results}))
    out = tmp_path / "rows.json"
    rows = arrival_spread.main([str(run), "--out", str(out)])
    assert [(r["path"], r["concurrency"]) for r in rows] == [("direct", 4), ("llm", 4)]
    assert rows[0]["arrivals_cv_50ms"] == 0.0 and rows[0]["arrivals_in_busiest_fifth"] == 0.2
    assert rows[1]["arrivals_in_busiest_fifth"] == 1.0
    assert rows[0]["ttft_after_first_wave_p50_ms"] == 5.0 and rows[1]["ttft_after_first_wave_p50_ms"] == 30.0
    assert json.loads(out.read_text()) == rows
    assert "| run.json | llm | steady | 4 |" in capsys.readouterr().out
