"""scripts/bench_sampling.py on CPU with the tiny model: a row per setting, each beside greedy
(a check that it works, not a timing)."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from scripts.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_a_row_per_setting_beside_greedy(tmp_path):
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=4)
    out = tmp_path / "sampling"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_sampling.py"),
                        "--model", str(model), "--dtype", "float32", "--workload", "8x4",
                        "--num-prompts", "3", "--max-num-seqs", "2", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(out.with_suffix(".json").read_text())
    from bench_sampling import SETTINGS
    rows = doc["results"]
    assert [row["setting"] for row in rows] == list(SETTINGS)
    assert [row["sampling"] for row in rows] == list(SETTINGS.values())
    assert rows[0]["vs_greedy"] == 1.0
    assert all(row["output_tok_s"] > 0 and row["step_ms"]["wall"] > 0 for row in rows)
    md = out.with_suffix(".md").read_text()
    assert "| penalties |" in md and "Where a step's time goes" in md


def test_settings_are_name_and_a_json_object():
    from bench_sampling import parse_setting
    assert parse_setting('hot={"temperature": 1.5}') == ("hot", {"temperature": 1.5})
    for bad in ('{"temperature": 1.5}', "x=[1]", "x={", '=""'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_setting(bad)
