"""scripts/bench_bls_concurrency.py at a tiny size: it runs through a real tritonserver, times
both sides of every round, and writes its results."""
import json

from scripts.bench_bls_concurrency import TARGET_RATIO, main
from scripts.make_tiny_model import make_tiny_model


def test_bench_bls_concurrency_tiny_run_writes_results(tmp_path):
    model = make_tiny_model(tmp_path / "llama", arch="llama", seed=4)
    main(["--concurrency", "3", "--max-tokens", "16", "--rounds", "2", "--best-of", "2",
          "--model", str(model), "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "bls_concurrency.json").read_text())
    table = (tmp_path / "bls_concurrency.md").read_text()
    assert table.startswith("# 3 concurrent llm_bls requests vs one")
    assert "| 1 | " in table and "| 2 | " in table and "The engine alone" in table
    meta = data["meta"]
    for key in ("command", "commit", "date", "cpu", "cores", "target", "llm_settings",
                "engine_alone", "summary"):
        assert key in meta, key
    assert meta["llm_settings"]["model"] == str(model)
    assert len(data["results"]) == 2
    for r in data["results"] + [meta["engine_alone"]]:
        # 3 at once cannot take much less than one: they share one machine and its steps.
        assert 0 < r["one_s"] and r["ratio"] > 0.5, r
    assert meta["target"] == f"3 at once < {TARGET_RATIO}x one"
