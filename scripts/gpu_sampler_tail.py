"""The sampler's whole call on a GPU (issue 13), as a decode step makes it: bf16 logits of Llama
3's 128,256 columns, us a call (triton's do_bench) for a few settings and row counts. Run it from
two trees to compare them (the base with its own engine/ and kernels/ first on PYTHONPATH).

    PYTHONPATH=. python3 scripts/gpu_sampler_tail.py --out $OUT/sampler_tail.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {"temperature": {"temperature": 0.8}, "top_p": {"temperature": 0.8, "top_p": 0.95},
            "top_k_top_p": {"temperature": 0.8, "top_k": 50, "top_p": 0.95}}


def main() -> None:
    import torch
    import triton.testing

    from engine.sampler import Sampler, SamplingMetadata
    from engine.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--label", default=os.environ.get("BENCH_COMMIT", "unknown"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for num_rows in args.rows:
        logits = (torch.randn(num_rows, args.vocab, device="cuda", generator=gen) * 2.5).bfloat16()
        for name, fields in SETTINGS.items():
            params = [SamplingParams(**fields) for _ in range(num_rows)]
            meta = SamplingMetadata.from_params(params, [[1]] * num_rows, None, [], "cuda", [0] * num_rows)
            sampler = Sampler(seed=0)
            sampler(logits, meta)
            us = 1e3 * triton.testing.do_bench(lambda: sampler(logits, meta))
            rows.append({"rows": num_rows, "setting": name, "us": us})
            print(f"{args.label}: {num_rows} rows, {name}: {us:.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump({"label": args.label, "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
