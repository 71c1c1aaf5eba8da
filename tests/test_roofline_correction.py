"""scripts/roofline_correction.py: the old scripts it loads from git compute with the old
bench_common, whichever name they import it by."""
import json
import os
import sys

import pytest

from scripts import roofline_correction as rc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_old_shared_prefix_floor_is_the_one_its_runs_recorded(tmp_path):
    """Old bench_shared_prefix imports `scripts.bench_common` (old bench_throughput plain
    `bench_common`): its floor is the old formula with the old weight_cost, the 46.764 s that
    the RFC run itself wrote, not the old formula with the new weight_cost (44.02 s)."""
    new_modules = {name: sys.modules.get(name) for name in ("bench_common", "scripts.bench_common")}
    old = rc.old_modules("3dfb010", str(tmp_path))
    assert old["bench_shared_prefix"].weight_cost is old["bench_common"].weight_cost
    assert old["bench_throughput"].weight_cost is old["bench_common"].weight_cost
    # the new modules are back under both names afterwards
    assert {name: sys.modules.get(name) for name in new_modules} == new_modules
    cfg = rc.new_common.PRESETS["llama-3.1-8b"]
    w = rc.new_shared.parse_workload("rfc", None, 200, 100)
    with open(os.path.join(ROOT, "benchmarks/h200/rfc6400_shuffled_512_7acd8ee.json")) as f:
        recorded = [r for r in json.load(f)["results"] if r["mode"] == "groups"][0]["floor_s"]
    assert old["bench_shared_prefix"].floor_s(cfg, w, 512, 2) == pytest.approx(recorded, rel=1e-6)
    assert rc.new_shared.floor_s(cfg, w, 512, 2) < recorded
