"""The cascade own pass with several decode sequences a program, on the GPU (issue 12).

A shared-prefix job's decode step spends most of its cascade attention in the own pass: one
program a member and kv head over ~100-300 own keys, at ~3.0 TB/s against the 4.19 that the
plain kernel reaches over long contexts (benchmarks/h200/cascade_decode_passes.md, page_read.md).
A short program pays its start (lookups before its first key arrives) and its end (the prefix
fold) over few bytes. `_TileConfig.pack` > 1 runs `_own_packed_kernel`: PACK sequences a program,
each key step reading block_n / PACK keys of each of them. Each case and own-pass config:
`cascade_attention(side_by_side=True)` (the engine's decode graphs) captured 32 times in one
CUDA graph (the same cache each layer, far larger than L2), do_bench median of the replay, us a
layer; the output against the fp32 reference (rel err, beside the base config's).

    PYTHONPATH=. python3 scripts/gpu_cascade_pack.py --out $OUT/cascade_pack.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = 32
KV_BYTES_A_TOKEN_A_LAYER = 8 * 128 * 2 * 2        # Hkv x D x (K, V) x bf16
# name: (rows, members a group, prefix, own) decode groups, or ("lone", n, len) beside one group
CASES = {
    "512 rows, 16 x 2000 + 250": (512, 16, 2000, 250),
    "256 rows, 16 x 2000 + 250": (256, 16, 2000, 250),
    "256 rows, 16 x 2000 + 100": (256, 16, 2000, 100),
    "128 rows, 16 x 2000 + 250": (128, 16, 2000, 250),
    "32 rows, 16 x 2000 + 250": (32, 16, 2000, 250),
    "256 rows, 4 x 496 + 200": (256, 4, 496, 200),
    "256 rows, 64 x 8000 + 200": (256, 64, 8000, 200),
    "16 rows, 16 x 2000 + 2000": (16, 16, 2000, 2000),
    "64 lone x 2200 beside a group": ("lone", 64, 2200),
    "8 lone x 8000 beside a group": ("lone", 8, 8000),
}
# name: (block_q, block_n, warps, stages, prompt (packed: block ids a step ahead), i32, pack)
CONFIGS = {
    "base 64 keys": (16, 64, 4, 2, None, None, 1),
    "pack 2 x 32": (16, 64, 4, 2, None, None, 2),
    "pack 4 x 16": (16, 64, 4, 2, None, None, 4),
    "pack 4 x 16, 3 st": (16, 64, 4, 3, None, None, 4),
    "pack 4 x 16, ahead": (16, 64, 4, 2, True, None, 4),
    "pack 4 x 32": (16, 128, 4, 2, None, None, 4),
    "pack 4 x 32, 3 st": (16, 128, 4, 3, None, None, 4),
    "pack 8 x 16": (32, 128, 4, 2, None, None, 8),
    "pack 8 x 16, 8 w": (32, 128, 8, 2, None, None, 8),
    "pack 4 x 16, 2 w": (16, 64, 2, 2, None, None, 4),
}


def main() -> None:
    import torch
    import triton.testing

    import kernels.cascade_attention as ca
    from scripts.bench_common import capture_graph, git_commit, hardware
    from scripts.gpu_check_cascade import Batch, decode_groups, rel_err

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    own_config = ca._own_config
    rows = []
    for case in args.cases:
        spec = CASES[case]
        if spec[0] == "lone":
            _, n, length = spec
            batch = Batch(decode_groups(16, 2000, num_rows=16, own_len=200), lone=[(1, length)] * n, seed=n)
            kv_tokens = 2000 + 16 * 200 + n * length
        else:
            num_rows, size, prefix, own = spec
            batch = Batch(decode_groups(size, prefix, num_rows=num_rows, own_len=own), seed=num_rows + own)
            kv_tokens = num_rows // size * prefix + num_rows * own
        ref = batch.ref()
        for name in args.configs:
            cfg = ca._TileConfig(*CONFIGS[name])
            ca._own_config = lambda m, *a, _c=cfg: _c if m == 1 else own_config(m, *a)
            try:
                out = torch.full_like(batch.q, float("nan"))
                batch.cascade(out=out, side_by_side=True)
                torch.cuda.synchronize()
                err = rel_err(out, ref)
                nan = int(out.isnan().sum())
                graph, _ = capture_graph(lambda: [batch.cascade(out=out, side_by_side=True) for _ in range(LAYERS)])
                ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
                del graph
            finally:
                ca._own_config = own_config
            us = ms * 1e3 / LAYERS
            r = dict(case=case, config=name, tile=CONFIGS[name], us_a_layer=us, rel_err=err, nan=nan,
                     kv_tb_per_s=kv_tokens * KV_BYTES_A_TOKEN_A_LAYER / (us * 1e-6) / 1e12)
            rows.append(r)
            print(f"{case:<32} {name:<20} {us:7.1f} us a layer  {r['kv_tb_per_s']:.2f} TB/s  "
                  f"rel err {err:.2e}  nan {nan}", flush=True)
        del batch, ref
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": os.environ.get("BENCH_COMMIT") or git_commit(), "hardware": hardware(),
                   "layers": LAYERS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
