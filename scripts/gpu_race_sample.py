"""The sampler's tail on a GPU (issue 13): what the sampler ran before kernels/race_sample.py
(the stable sort's top-k / top-p, softmax, p / q, argmax) against the kernel, at decode shapes of
Llama 3's 128,256 logits, us a call (L2 flushed by triton's do_bench), each result checked
against the reference (`mismatched_rows`, over a few noise draws). The noise, the temperature
and min-p come before both and are not timed there; the noise is timed apart (`noise` rows):
torch's exponential_ for all rows from one generator, the same for seeded rows (a re-seeded
generator and a launch each, what the sampler ran before kernels/exp_noise.py) and the kernel.

    PYTHONPATH=. python3 scripts/gpu_race_sample.py --out $OUT/race_sample.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name: (top_k, top_p, logit scale): scale 2.5 is a model's spread at temperature ~0.8 (a few
# high, a long tail); 0.3 a flat row, where top-p keeps thousands and often rejects the winner.
CASES = {"temperature only": (0, 1.0, 2.5), "top_p 0.95": (0, 0.95, 2.5),
         "top_k 50 + top_p 0.95": (50, 0.95, 2.5), "top_k 50": (50, 1.0, 2.5),
         "top_p 0.95, flat": (0, 0.95, 0.3), "top_p 0.5, flat": (0, 0.5, 0.3)}
CONFIGS = [(4096, 8), (4096, 16), (8192, 8), (8192, 16)]          # (block, num_warps)
DRAWS = 4


def main() -> None:
    import torch
    import triton.testing

    import kernels.race_sample as rs
    from kernels.argmax import argmax_rows
    from scripts.bench_common import write_probe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 512])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--configs", nargs="+", default=[f"{b},{w}" for b, w in CONFIGS], metavar="BLOCK,WARPS",
                    help="the kernel's (block, num_warps) pairs to time")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]

    def before(x, q, top_k, top_p):
        if top_k is not None or top_p is not None:
            x = rs.keep_top_k_top_p(x, top_k, top_p)
        return argmax_rows(x.softmax(-1) / q)

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for num_rows in args.rows:
        for name, (k, p, scale) in CASES.items():
            x = torch.randn(num_rows, args.vocab, device="cuda", generator=gen) * scale
            x = x.bfloat16().float()                   # decode logits come as bf16: ties
            qs = [torch.empty_like(x).exponential_(generator=gen).clamp_min_(torch.finfo(torch.float32).tiny)
                  for _ in range(DRAWS)]
            top_k = torch.full((num_rows,), k, dtype=torch.int64, device="cuda") if k else None
            top_p = torch.full((num_rows,), p, dtype=torch.float32, device="cuda") if p < 1.0 else None
            wants = [rs.race_sample_ref(x, q, top_k, top_p) for q in qs]
            whole = [rs.race_sample_ref(x, q, None, None) for q in qs]
            row = {"case": name, "rows": num_rows, "vocab": args.vocab,
                   "rejected_rows": sum(int((w != a).sum()) for w, a in zip(wants, whole)),
                   "before_us": 1e3 * triton.testing.do_bench(lambda: before(x, qs[0], top_k, top_p)),
                   "kernel": {}}
            for block, warps in configs:
                run = (lambda q: rs.race_sample(x, q, top_k, top_p, k, block=block, num_warps=warps))
                row["kernel"][f"block{block}_w{warps}"] = {
                    "us": 1e3 * triton.testing.do_bench(lambda: run(qs[0])),
                    "mismatched_rows": sum(int((run(q) != w).sum()) for q, w in zip(qs, wants))}
            row["best"] = min(row["kernel"], key=lambda c: row["kernel"][c]["us"])
            rows.append(row)
            print(f"{num_rows} rows, {name}: before {row['before_us']:.1f} us; " + ", ".join(
                f"{c} {r['us']:.1f} us ({r['mismatched_rows']} differ)" for c, r in row["kernel"].items())
                + f"; {row['rejected_rows']} of {DRAWS * num_rows} winners rejected", flush=True)
    from engine.sampler import _row_seed
    from kernels.exp_noise import exponential_noise
    for num_rows in args.rows:
        noise = torch.empty(num_rows, args.vocab, device="cuda")

        def shared():
            noise.exponential_(generator=gen)
            return noise.clamp_min_(torch.finfo(torch.float32).tiny)

        def seeded():
            for row in range(num_rows):
                gen.manual_seed(_row_seed(row, 5))
                noise[row].exponential_(generator=gen)
            return noise.clamp_min_(torch.finfo(torch.float32).tiny)

        keys = torch.arange(num_rows, device="cuda") * 7919
        streams = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
        row = {"case": "noise", "rows": num_rows, "vocab": args.vocab,
               "shared_generator_us": 1e3 * triton.testing.do_bench(shared),
               "seeded_rows_us": 1e3 * triton.testing.do_bench(seeded),
               "kernel_us": 1e3 * triton.testing.do_bench(lambda: exponential_noise(keys, streams, args.vocab))}
        rows.append(row)
        print(f"{num_rows} rows, noise: one generator {row['shared_generator_us']:.1f} us, a generator a seeded "
              f"row {row['seeded_rows_us']:.1f} us, kernels/exp_noise.py {row['kernel_us']:.1f} us", flush=True)
    write_probe(args.out, rows, command=" ".join(sys.argv), draws=DRAWS)


if __name__ == "__main__":
    main()
