"""Do the cascade decode passes overlap? Stream arrangements of `cascade_attention(side_by_side=True)`
on the GPU (issue 12).

A torch profile of the RFC job's decode graphs (benchmarks/h200/cascade_priority.md) showed the
prefix pass, on its side stream, starting 139 us into the own pass's 149: the own pass's
thousands of short programs held every SM slot until their last wave, so the passes ran one
after the other, side by side or not. A higher priority for the side stream changed nothing.
This probe times, per case, 32 layers' calls in one CUDA graph (do_bench median of the replay,
us a layer; the same cache each layer, far larger than L2), and checks each arrangement's output
against the passes in turn, bit for bit:

  in_turn        the prefix pass, then the own pass (which folds the partials in)
  own_only       the own pass alone, its partials unused (a floor: what the own pass costs)
  side_by_side   as the engine runs it: the prefix pass on a side stream, the own pass on the
                 main one, then the merge kernel
  swapped        the prefix pass on the main stream, the own pass on the side stream
  *_2st          the same with the prefix pass's 64-row tiles on 2 stages, not 3 (less shared
                 memory a program, so a prefix program fits beside own programs)

    PYTHONPATH=. python3 scripts/gpu_cascade_overlap.py --out $OUT/cascade_overlap.json
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = 32
CASES = [(512, 16, 2000, 250), (256, 16, 2000, 250), (256, 16, 2000, 100), (128, 16, 2000, 250)]
FORMS = ("in_turn", "own_only", "side_by_side", "swapped", "side_by_side_2st", "swapped_2st")


def main() -> None:
    import torch

    import kernels.cascade_attention as ca
    from kernels.side_stream import SIDE_STREAMS
    from scripts.bench_common import graph_us_a_call, write_probe
    from scripts.gpu_check_cascade import Batch, decode_groups

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    real_prefix, real_own, real_prefix_config = ca._launch_prefix, ca._launch_own, ca._prefix_config
    streams = {}

    def on_main(*a, **k):       # the prefix pass on the stream the call came in on
        with torch.cuda.stream(streams["main"]):
            real_prefix(*a, **k)

    def on_side(*a, **k):       # the own pass on the side stream (which waited for main on entry)
        with torch.cuda.stream(SIDE_STREAMS[streams["main"].device]):
            real_own(*a, **k)

    def two_stages(*a):
        cfg = real_prefix_config(*a)
        return dataclasses.replace(cfg, num_stages=2) if cfg.block_q == 64 else cfg

    def call(batch, out, form):
        streams["main"] = torch.cuda.current_stream()
        if form == "own_only":          # no prefix pass: the own pass folds whatever the workspace holds
            ca._launch_prefix = lambda *a, **k: None
            try:
                return batch.cascade(out=out)
            finally:
                ca._launch_prefix = real_prefix
        if form.startswith("swapped"):
            ca._launch_prefix, ca._launch_own = on_main, on_side
        if form.endswith("_2st"):
            ca._prefix_config = two_stages
        try:
            return batch.cascade(out=out, side_by_side=form != "in_turn")
        finally:
            ca._launch_prefix, ca._launch_own, ca._prefix_config = real_prefix, real_own, real_prefix_config

    rows = []
    for num_rows, size, prefix, own in CASES:
        batch = Batch(decode_groups(size, prefix, num_rows=num_rows, own_len=own), seed=num_rows + own)
        times, outs = {}, {}
        for form in ["in_turn"] + [f for f in args.forms if f != "in_turn"]:
            out = torch.empty_like(batch.q)
            times[form] = graph_us_a_call(lambda: call(batch, out, form), LAYERS)
            outs[form] = out.clone()
        r = dict(num_rows=num_rows, group=size, prefix=prefix, own=own, us_a_layer=times,
                 same_bits={f: bool(torch.equal(outs[f], outs["in_turn"])) for f in outs if f != "own_only"})
        rows.append(r)
        print(f"{num_rows:4d} rows, groups of {size}, prefix {prefix}, own {own}: "
              + ", ".join(f"{f} {t:.1f}" for f, t in times.items()) + f" us a layer; same bits {r['same_bits']}",
              flush=True)
        del batch, outs
        torch.cuda.empty_cache()
    write_probe(args.out, rows, layers=LAYERS)


if __name__ == "__main__":
    main()
