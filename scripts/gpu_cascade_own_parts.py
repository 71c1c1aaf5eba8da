"""Cascade against plain paged attention on decode batches of few rows and long own parts (issue 12).

The cost rule (kernels/cascade_cost.py) weighs bytes; the cascade own pass has no split-KV, so a
step of few rows whose own parts are long can lose to the plain kernel even where bytes say
otherwise (`CascadeCostRule.own_pass_fills`). Each case: decode rows in groups over one prefix
each, both kernels at their defaults replayed from CUDA graphs (do_bench medians), Llama-3.1-8B
shapes in bf16, and the rule's verdict with and without the own-pass check.

    PYTHONPATH=. python3 scripts/gpu_cascade_own_parts.py --out DIR    # DIR/cascade_own_parts.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.cascade_attention as ca  # noqa: E402
from kernels.cascade_attention import CascadeCostRule, PrefixGroup  # noqa: E402
from scripts.bench_common import git_commit  # noqa: E402
from scripts.gpu_check_cascade import D, DTYPE, HKV, HQ, Batch, bench_graph, decode_groups  # noqa: E402

# (decode rows, group size, prefix tokens (whole pages), own tokens)
CASES = [(256, 16, 2000, 200), (16, 16, 2000, 8000), (8, 8, 4000, 8000), (32, 16, 2000, 4000),
         (64, 16, 992, 4000), (16, 16, 4000, 2000), (64, 16, 2000, 2000), (128, 16, 2000, 1000),
         (64, 16, 2000, 500), (32, 16, 2000, 1000), (16, 16, 2000, 2000), (16, 16, 2000, 500)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    g_pad = triton.next_power_of_2(HQ // HKV)
    rows = []
    for num_rows, size, prefix, own in CASES:
        batch = Batch(decode_groups(size, prefix, num_rows=num_rows, own_len=own), seed=num_rows + own)
        cfg = ca._prefix_config(batch.max_group_rows, g_pad, D, DTYPE)
        block_m = max(cfg.block_q // g_pad, 1)
        splits = ca.choose_num_prefix_splits(len(batch.groups), triton.cdiv(batch.max_group_rows, block_m),
                                             HKV, prefix, ca._num_sms(batch.q.device))
        cascade_us = bench_graph(lambda: batch.cascade(num_prefix_splits=splits), 10, 60) * 1e3
        plain_us = bench_graph(batch.plain, 10, 60) * 1e3
        rule = CascadeCostRule(HQ, HKV, D, DTYPE.itemsize, num_prefix_splits=splits,
                               rows_per_prefix_tile=block_m)
        groups = [PrefixGroup(size, prefix, size)] * len(batch.groups)
        by_bytes = rule.use_cascade(groups)
        r = dict(num_rows=num_rows, group=size, prefix=prefix, own=own, splits=splits, cascade_us=cascade_us,
                 plain_us=plain_us, bytes_rule_says_cascade=by_bytes,
                 rule_says_cascade=by_bytes and rule.own_pass_fills(num_rows, own),
                 saved_MiB=sum(rule.saved_bytes(g) for g in groups) / 2 ** 20)
        rows.append(r)
        print(f"{num_rows:4d} rows, groups of {size:3d}, prefix {prefix:5d}, own {own:5d}: cascade "
              f"{cascade_us:7.1f} us (S={splits}), plain {plain_us:7.1f} us, {plain_us / cascade_us:5.2f}x; "
              f"rule: {'cascade' if r['rule_says_cascade'] else 'plain'} (bytes alone: "
              f"{'cascade' if by_bytes else 'plain'}, {r['saved_MiB']:.0f} MiB saved)", flush=True)
        del batch
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cascade_own_parts.json"), "w") as f:
        json.dump({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
