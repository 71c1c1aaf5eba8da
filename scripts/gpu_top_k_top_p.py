"""The sampler's top-k / top-p on a GPU: the sort (kernels/top_k_top_p.py's reference, what the
sampler ran before) against the sort-free kernel at several block sizes and warp counts, at a
decode step's shape (256 rows of Llama 3's 128,256 logits), us a call (L2 flushed by
triton's do_bench), with each result checked against the sort bitwise (`mismatched_rows`).

    PYTHONPATH=. python3 scripts/gpu_top_k_top_p.py --out $OUT/top_k_top_p.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {"top_p 0.95": (0, 0.95), "top_k 50 + top_p 0.95": (50, 0.95), "top_k 50": (50, 1.0)}
CONFIGS = [(1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]


def main() -> None:
    import torch
    import triton.testing

    import kernels.top_k_top_p as tkp
    from scripts.bench_common import write_probe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Logits with a model's spread: a few high, a long tail; temperature 0.8 applied.
    logits = (torch.randn(args.rows, args.vocab, device="cuda", generator=gen) * 2.5) / 0.8
    rows = []
    for name, (k, p) in CASES.items():
        top_k = torch.full((args.rows,), k, dtype=torch.int64, device="cuda") if k else None
        top_p = torch.full((args.rows,), p, dtype=torch.float32, device="cuda") if p < 1.0 else None
        want = tkp.top_k_top_p_ref(logits, top_k, top_p)
        row = {"case": name, "rows": args.rows, "vocab": args.vocab, "kept_per_row_mean":
               torch.isfinite(want).sum(1).float().mean().item(),
               "sort_us": 1e3 * triton.testing.do_bench(lambda: tkp.top_k_top_p_ref(logits, top_k, top_p)),
               "kernel": {}}
        for block, warps in CONFIGS:
            got = tkp.top_k_top_p(logits, top_k, top_p, block=block, num_warps=warps)
            row["kernel"][f"block{block}_w{warps}"] = {
                "us": 1e3 * triton.testing.do_bench(
                    lambda: tkp.top_k_top_p(logits, top_k, top_p, block=block, num_warps=warps)),
                "mismatched_rows": int((got != want).any(1).sum())}
        best = min(row["kernel"], key=lambda c: row["kernel"][c]["us"])
        row["best"] = best
        rows.append(row)
        print(f"{name}: sort {row['sort_us']:.1f} us; " + ", ".join(
            f"{c} {r['us']:.1f} us ({r['mismatched_rows']} rows differ)" for c, r in row["kernel"].items())
            + f"; kept {row['kept_per_row_mean']:.0f} a row", flush=True)
    write_probe(args.out, rows, command=" ".join(sys.argv))


if __name__ == "__main__":
    main()
