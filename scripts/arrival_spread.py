"""How bunched the sends of stored bench_serving runs were (scripts/serving_clients.py
`arrival_spread` over each round's timeline), beside the round's TTFT after the first wave: is
the served TTFT gap of issue 11 the load generator's arrival pattern?

    python scripts/arrival_spread.py benchmarks/h200x2/serving_1gpu_256_on2gpu_d4084f2.json ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.bench_common import dump_rows  # noqa: E402
from scripts.serving_clients import after_first_wave, arrival_spread  # noqa: E402


def rows_of(path: str) -> list[dict]:
    """One row per streaming round (llm_bls has no client TTFT) at concurrency > 1."""
    out = []
    for r in json.load(open(path))["results"]:
        c = r["concurrency"]
        if r["path"] == "llm_bls" or c <= 1:
            continue
        sends = [t[0] / 1e3 for t in r["timeline_ms"]]
        ttft = [t[1] - t[0] for t in r["timeline_ms"]]
        out.append({"file": os.path.basename(path), "path": r["path"], "round": r["round"],
                    "concurrency": c, **arrival_spread(sends, c), **after_first_wave(sends, ttft, c)})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_serving.py result JSON files")
    ap.add_argument("--out", help="also write the rows here (JSON)")
    args = ap.parse_args(argv)
    rows = [row for path in args.runs for row in rows_of(path)]
    print("| run | path | round | c | sends' cv per 50 ms | share in busiest fifth | TTFT p50 after first wave ms |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['file']} | {r['path']} | {r['round']} | {r['concurrency']} | "
              f"{r.get('arrivals_cv_50ms', '-')} | {r.get('arrivals_in_busiest_fifth', '-')} | "
              f"{r.get('ttft_after_first_wave_p50_ms', '-')} |")
    dump_rows(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
