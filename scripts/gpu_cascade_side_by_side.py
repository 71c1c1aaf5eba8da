"""Cascade attention's two passes in turn against side by side, on the GPU (issue 12).

A shared-prefix job's decode step runs the prefix pass (a few programs a group over long
prefixes: 128 for 16 groups at Llama-8B shapes, 2.3 TB/s) and then the own pass (one program a
member and kv head over ~200-300 own keys, 3.0 TB/s): benchmarks/h200/cascade_decode_passes.md.
`cascade_attention(side_by_side=True)` runs the prefix pass on a side stream beside the own
pass and folds the two with a merge kernel. Each case: decode rows in groups over one prefix
each, both forms captured in one CUDA graph of 32 layers' calls (the same cache each layer, far
larger than L2), do_bench medians of the replay, us a layer; the outputs compared bit for bit.

    PYTHONPATH=. python3 scripts/gpu_cascade_side_by_side.py --out $OUT/cascade_side_by_side.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_common import positive_ints  # noqa: E402

LAYERS = 32
# (decode rows, members a group, prefix tokens (whole pages), own tokens)
CASES = [(256, 16, 2000, 250), (256, 16, 2000, 100), (128, 16, 2000, 250), (64, 16, 2000, 250),
         (32, 16, 2000, 250), (256, 4, 496, 200), (256, 64, 8000, 200), (16, 16, 2000, 2000)]


def parse_case(text: str) -> tuple[int, int, int, int]:
    """'256,16,2000,250' -> (rows, members a group, prefix, own)."""
    return positive_ints(text, "a case", "ROWS,GROUP,PREFIX,OWN", "256,16,2000,250")


def main() -> None:
    import torch

    from scripts.bench_common import graph_us_a_call, write_probe
    from scripts.gpu_check_cascade import Batch, decode_groups

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=parse_case, nargs="+", default=CASES)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for num_rows, size, prefix, own in args.cases:
        batch = Batch(decode_groups(size, prefix, num_rows=num_rows, own_len=own), seed=num_rows + own)
        times, outs = {}, {}
        for form in ("in_turn", "side_by_side"):
            out = torch.empty_like(batch.q)
            times[form] = graph_us_a_call(lambda: batch.cascade(out=out, side_by_side=form == "side_by_side"),
                                          LAYERS)
            outs[form] = out.clone()
        r = dict(num_rows=num_rows, group=size, prefix=prefix, own=own,
                 in_turn_us=times["in_turn"], side_by_side_us=times["side_by_side"],
                 same_bits=bool(torch.equal(outs["in_turn"], outs["side_by_side"])))
        r["gain"] = r["in_turn_us"] / r["side_by_side_us"]
        rows.append(r)
        print(f"{num_rows:4d} rows, groups of {size:3d}, prefix {prefix:5d}, own {own:5d}: in turn "
              f"{r['in_turn_us']:7.1f} us, side by side {r['side_by_side_us']:7.1f} us a layer, "
              f"{r['gain']:5.3f}x, same bits {r['same_bits']}", flush=True)
        del batch, outs
        torch.cuda.empty_cache()
    write_probe(args.out, rows, layers=LAYERS)


if __name__ == "__main__":
    main()
