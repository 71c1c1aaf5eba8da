"""scripts/bench_cpu_neighbour.py with the tiny model and a few tokens: a row per round and
neighbour load, the engine pinned to one CPU and the load to the other, and no load process
left behind (a check that it works, not a timing)."""
import json
import os
import subprocess
import sys

import pytest

from scripts.bench_common import process_cmdlines
from scripts.make_tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "bench_cpu_neighbour.py")


def run(*args, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs (CI has two)")
def test_rounds_of_each_load_beside_idle_ones(tmp_path):
    model = make_tiny_model(tmp_path / "m", arch="llama", seed=5)
    out = tmp_path / "neighbour"
    r = run("--model", str(model), "--prompts", "2", "--output-tokens", "4", "--rounds", "2",
            "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    rows, meta = data["results"], data["meta"]
    assert [(x["round"], x["neighbour"]) for x in rows] == [
        (i, kind) for i in range(2) for kind in ("idle", "memory", "spin")]
    assert all(x["output_tok_s"] > 0 and x["seconds"] > 0 for x in rows)
    cpus = sorted(os.sched_getaffinity(0))
    assert (meta["engine_cpu"], meta["neighbour_cpu"]) == (cpus[0], cpus[1])
    assert set(meta["vs_idle"]) == {"memory", "spin"}
    md = out.with_suffix(".md").read_text()
    assert "| median |" in md and "| idle tok/s | memory tok/s | spin tok/s |" in md
    # The load processes were killed and reaped with their rounds.
    assert not [cmd for _, cmd in process_cmdlines() if "sched_setaffinity" in cmd]


def test_one_cpu_is_refused_with_the_reason(tmp_path):
    cpu = sorted(os.sched_getaffinity(0))[0]
    r = run("--engine-cpu", str(cpu), "--neighbour-cpu", str(cpu), "--out", str(tmp_path / "x"))
    assert r.returncode != 0 and "needs two CPUs" in r.stderr
    assert not (tmp_path / "x.json").exists()
