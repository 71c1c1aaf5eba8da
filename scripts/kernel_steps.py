"""Per-step kernel tables from a `--profile-kernels` file (bench_shared_prefix.py, StepProfiler).

The file lists every GPU kernel of a profiled window as (name, start us, us), in start order.
Steps are cut after each kernel whose name starts with `--step-end` (default `_chunk_max`, the
argmax every step ends with). Each step's kernels are summed in groups by name prefix; `span` is
its first kernel's start to its last one's end; `overlap` is how long kernels of `--pair`
(default: the cascade own and prefix passes) ran at the same time, summed over the step.

    python3 scripts/kernel_steps.py benchmarks/h200/rfc6400_profile512_89d017a_kernels_rfc_groups_shuffled.json.gz
"""
from __future__ import annotations

import argparse
import gzip
import json

GROUPS = {"gemm": ("nvjet", "cutlass", "sm90_", "void cublasLt"), "own": ("_own_kernel",),
          "prefix": ("_prefix_kernel",), "paged": ("_paged_attention_kernel",)}


def load(path: str) -> list[tuple[str, float, float]]:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [tuple(k) for k in json.load(f)]


def split_steps(kernels, step_end: str = "_chunk_max") -> list[list]:
    """Kernels cut into steps after each `step_end` kernel; a tail without one is dropped."""
    steps, cur = [], []
    for k in kernels:
        cur.append(k)
        if k[0].startswith(step_end):
            steps.append(cur)
            cur = []
    return steps


def overlap_us(step, first: str, second: str) -> float:
    """Time kernels named `first*` and `second*` ran at once, pairing each `first` kernel with
    the next `second` kernel that starts after it in the list."""
    total = 0.0
    for i, (name, start, dur) in enumerate(step):
        if not name.startswith(first):
            continue
        other = next((k for k in step[i + 1:] if k[0].startswith(second)), None)
        if other is not None:
            total += max(0.0, min(start + dur, other[1] + other[2]) - max(start, other[1]))
    return total


def summarize(step, pair=("_own_kernel", "_prefix_kernel")) -> dict:
    row = {name: 0.0 for name in GROUPS} | {"other": 0.0}
    for name, _, dur in step:
        group = next((g for g, prefixes in GROUPS.items() if name.startswith(prefixes)), "other")
        row[group] += dur / 1e3
    row["kernels"] = len(step)
    row["span"] = (step[-1][1] + step[-1][2] - step[0][1]) / 1e3
    row["overlap"] = (overlap_us(step, *pair) + overlap_us(step, pair[1], pair[0])) / 1e3
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--step-end", default="_chunk_max")
    ap.add_argument("--pair", nargs=2, default=["_own_kernel", "_prefix_kernel"])
    args = ap.parse_args(argv)
    cols = list(GROUPS) + ["other", "span", "overlap"]
    print("| step | kernels | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in cols) + " |")
    for i, step in enumerate(split_steps(load(args.path), args.step_end)):
        r = summarize(step, tuple(args.pair))
        print(f"| {i} | {r['kernels']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
