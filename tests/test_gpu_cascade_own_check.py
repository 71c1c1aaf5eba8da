"""scripts/gpu_cascade_own_check.py at a tiny size (--quick: tiny model on CPU)."""
import json

from scripts.gpu_cascade_own_check import main


def test_quick_run_toggles_the_own_pass_check(tmp_path):
    out = tmp_path / "own_check.json"
    results = main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == results
    by_variant = {r["variant"]: r for r in results}
    assert set(by_variant) == {"check", "no_check"}
    for r in results:
        assert r["rows"] == 8 and r["own_len"] == 16 and r["requests_per_s"] > 0
    # Own parts of 16 tokens are long to this rule: with the check every step stays plain.
    assert by_variant["check"]["cascade_rows"] == 0 < by_variant["no_check"]["cascade_rows"]
