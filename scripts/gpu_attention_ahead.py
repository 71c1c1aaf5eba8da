"""Decode attention with the next step's K and V loaded ahead (kernels/paged_attention.py,
kv_ahead) and without, on a GPU, at Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, block 16, bf16),
splits merged in the kernel: us per call (a CUDA graph of 32 calls over up to 32 caches), for
the engine's split count and the others given, so the split rule can be checked too.

    PYTHONPATH=. python3 scripts/gpu_attention_ahead.py --out $OUT/attention_ahead.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.paged_attention as pa  # noqa: E402
from engine.gemm_tuning import replay_ms  # noqa: E402

HQ, HKV, D, BLOCK, LAYERS = 32, 8, 128, 16, 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["1x300", "1x1000", "1x4000", "16x1000", "64x1000", "256x1620"],
                    help="BATCHxCONTEXT")
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16], help="split counts to time too")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT", "?"), "cases": []}
    for case in args.cases:
        batch, ctx = (int(v) for v in case.split("x"))
        per_seq = -(-ctx // BLOCK)
        layers = LAYERS if batch * ctx <= 64 * 1000 else 1       # big caches: one, read 32 times
        caches = [(torch.randn(batch * per_seq, BLOCK, HKV, D, device=dev, dtype=dt),
                   torch.randn(batch * per_seq, BLOCK, HKV, D, device=dev, dtype=dt)) for _ in range(layers)]
        table = torch.randperm(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
        cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
        lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(batch, HQ, D, device=dev, dtype=dt)
        engine = pa.choose_fused_kv_splits(batch, HKV, ctx, num_sms)
        row = {"batch": batch, "context": ctx, "engine_splits": engine, "us": {}}
        outs = {}
        for splits in sorted({engine, *args.splits}):
            for ahead in (True, False):
                def call(i, splits=splits, ahead=ahead):
                    k, v = caches[i % layers]
                    return pa.paged_attention(q, k, v, table, cu, lens, D ** -0.5, max_seqlen_q=1, max_seqlen_k=ctx,
                                              num_kv_splits=splits, merge_in_kernel=True, kv_ahead=ahead)
                row["us"][f"s{splits}_{'ahead' if ahead else 'in_step'}"] = replay_ms(
                    lambda: [call(i) for i in range(LAYERS)], dev) * 1e3 / LAYERS
                outs[splits, ahead] = call(0)
            row.setdefault("same_bits", True)
            row["same_bits"] &= bool(torch.equal(outs[splits, True], outs[splits, False]))
        out["cases"].append(row)
        print(json.dumps(row), flush=True)
        del caches
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
