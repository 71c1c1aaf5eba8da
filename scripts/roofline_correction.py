"""Recorded figures against the rooflines before and after c4072e1, which stopped counting the
input embedding table as read every decode step and as a matmul of every token (and lm_head for
every prompt token): the old scripts are taken from git at `--before`, the new from this tree,
and each recorded rate is set against both. No GPU: arithmetic on recorded figures.

    python3 scripts/roofline_correction.py --out benchmarks/roofline_correction
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_common as new_common  # noqa: E402
import bench_shared_prefix as new_shared  # noqa: E402
import bench_throughput as new_throughput  # noqa: E402

# (what, rows, out tok/s or req/s, where it is recorded)
THROUGHPUT = [(128, 8923, "bf16, f9fe8fb: h200/fp8_decode.md sections 20-21 (issue 13's 75.2%)"),
              (128, 8922, "bf16, f9fe8fb, the second machine"),
              (256, 10068, "bf16, 2a23d25: h200/fp8_decode.md section 16"),
              (384, 10307, "bf16, 6ba6d18: h200/open_targets_bounds.md section 4")]
FP8 = [(512, 16830, "FP8 weights + KV, 79bf068: h200/fp8_decode.md (thirty-seventh session)")]
LATENCY = [(4.16, "one stream served, 38158ac: h200/served_c1_38158ac_b.md"),
           (4.21, "one stream served, 95b456e: h200/served_c1_95b456e.md")]
SHARED = [(512, 82.47, "groups + cascade, RFC job shuffled, 7acd8ee"),
          (512, 83.42, "groups + cascade, RFC job grouped, 1461ff3")]


def old_modules(commit: str, tmp: str):
    """bench_common, bench_throughput and bench_shared_prefix as they were at `commit`."""
    paths = {}
    for name in ("bench_common", "bench_throughput", "bench_shared_prefix"):
        text = subprocess.run(["git", "show", f"{commit}:scripts/{name}.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        paths[name] = os.path.join(tmp, f"{name}.py")
        with open(paths[name], "w") as f:
            f.write(text)
    # Old bench_throughput imports `bench_common`, old bench_shared_prefix `scripts.bench_common`:
    # both names must give the old module while they load, then the new ones again.
    aliases = ("bench_common", "scripts.bench_common")
    mods, saved = {}, {alias: sys.modules.get(alias) for alias in aliases}
    try:
        for name in ("bench_common", "bench_throughput", "bench_shared_prefix"):
            spec = importlib.util.spec_from_file_location(name, paths[name])
            mods[name] = importlib.util.module_from_spec(spec)
            if name == "bench_common":
                sys.modules.update(dict.fromkeys(aliases, mods[name]))
            spec.loader.exec_module(mods[name])
    finally:
        for alias, module in saved.items():
            if module is None:
                sys.modules.pop(alias, None)
            else:
                sys.modules[alias] = module
    return mods


def latency_ms(common, cfg, inp=128, out=256) -> float:
    wb = common.weight_cost(cfg, 2).bytes
    return 1e3 * (wb + common.kv_bytes_per_token(cfg, 2) * (inp + out // 2)) / common.HBM_BYTES_PER_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="3dfb010")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = new_common.PRESETS["llama-3.1-8b"]
    with tempfile.TemporaryDirectory() as tmp:
        old = old_modules(args.before, tmp)
    rows = []
    for rows_, rate, where in THROUGHPUT + FP8:
        q, kv = ("fp8", 1) if "FP8" in where else (None, None)
        o = old["bench_throughput"].roofline_s(cfg, 1000, 1000, 1000, rows_, 2, kv, q)
        n = new_throughput.roofline_s(cfg, 1000, 1000, 1000, rows_, 2, kv, q)
        s = 1e6 / rate
        rows.append({"what": f"1000 x 1000 at {rows_} rows", "measured": f"{rate} out tok/s",
                     "roofline_s": [round(o, 2), round(n, 2)],
                     "percent": [round(100 * o / s, 1), round(100 * n / s, 1)], "where": where})
    lo, ln = latency_ms(old["bench_common"], cfg), latency_ms(new_common, cfg)
    for ms, where in LATENCY:
        rows.append({"what": "one stream, 128 in / 256 out", "measured": f"{ms} ms/token",
                     "roofline_s": [round(lo / 1e3, 6), round(ln / 1e3, 6)],
                     "percent": [round(100 * lo / ms, 1), round(100 * ln / ms, 1)], "where": where})
    w = new_shared.parse_workload("rfc", None, 200, 100)
    for seats, rate, where in SHARED:
        o = old["bench_shared_prefix"].floor_s(cfg, w, seats, 2)
        n = new_shared.floor_s(cfg, w, seats, 2)
        rows.append({"what": f"RFC job (6,400 requests) at {seats} seats", "measured": f"{rate} req/s",
                     "roofline_s": [round(o, 2), round(n, 2)],
                     "percent": [round(100 * rate * o / 6400, 1), round(100 * rate * n / 6400, 1)],
                     "where": where})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    with open(args.out + ".json", "w") as f:
        json.dump({"before": args.before, "commit": commit, "rows": rows}, f, indent=1)
    lines = [f"| what | measured | roofline s, before {args.before} / now | % of it, before / now | recorded |",
             "| --- | --- | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['measured']} | {r['roofline_s'][0]} / {r['roofline_s'][1]} | "
                     f"{r['percent'][0]}% / **{r['percent'][1]}%** | {r['where']} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
