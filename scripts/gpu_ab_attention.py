"""The attention kernels against an older copy of themselves, on the GPU, through their public entry
points with their own defaults (Llama-3.1-8B shapes: Hq 32, Hkv 8, D 128, 16-key pages scattered
over the cache, bf16): prompt tiles (fresh prompts, chunks after cached keys, a mixed batch), decode
batches, and the cascade kernel's passes. The two versions run alternately, twice; each row gives
both times and the largest difference of their outputs.

    git show REV:kernels/paged_attention.py > /tmp/paged_old.py
    git show REV:kernels/cascade_attention.py > /tmp/cascade_old.py
    python3 scripts/gpu_ab_attention.py --old-paged /tmp/paged_old.py --old-cascade /tmp/cascade_old.py --out ab.json

The old cascade file is loaded against the old paged module (it imports the key loop from it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels.cascade_attention as cascade_new  # noqa: E402
import kernels.paged_attention as paged_new  # noqa: E402
from scripts.gpu_check_attention import HQ, D, Pool, bench_ms, causal_pairs  # noqa: E402
from scripts.gpu_check_cascade import Batch, decode_groups  # noqa: E402

PROMPTS = [("fresh 2048 x2", [2048] * 2, [2048] * 2), ("fresh 512 x8", [512] * 8, [512] * 8),
           ("fresh 8192 x1", [8192], [8192]), ("16 x 200 after 2000", [200] * 16, [2200] * 16),
           ("chunk 2048 after 6144", [2048], [8192]),
           ("mixed 2048 chunk + 64 decodes @4k", [2048] + [1] * 64, [6144] + [4096] * 64)]
DECODES = [("decode 1 x 300", [1], [300]), ("decode 1 x 4000", [1], [4000]),
           ("decode 16 x 1000", [1] * 16, [1000] * 16), ("decode 64 x 1000", [1] * 64, [1000] * 64),
           ("decode 256 x 1620", [1] * 256, [1620] * 256)]
CASCADES = [("cascade decode, 16 groups of 16 x 2000 + 200 own", decode_groups(16, 2000), ()),
            ("cascade decode, 64 groups of 4 x 496 + 200 own", decode_groups(4, 496), ()),
            ("cascade own pass, 16 lone prompts of 200 after 2000", [], [(200, 2200)] * 16),
            ("cascade own pass, 2 lone fresh prompts of 2048", [], [(2048, 2048)] * 2)]


def load(path: str, name: str, paged=None):
    """The module in `path`; with `paged`, its `kernels.paged_attention` imports resolve to it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                      # dataclasses look their module up there
    saved = sys.modules.get("kernels.paged_attention")
    if paged is not None:
        sys.modules["kernels.paged_attention"] = paged
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules["kernels.paged_attention"] = saved
    return module


def compare(rows, name, calls, flush, rnd, flops=None, nbytes=None):
    """calls: {"old": (fn, out), "new": (fn, out)}, timed in turn (new first in odd rounds)."""
    row = {"case": name, "round": rnd}
    for tag in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
        fn, _ = calls[tag]
        row[f"{tag}_us"] = 1e3 * bench_ms(fn, 3, 15, flush)
    row["new_vs_old"] = row["old_us"] / row["new_us"]
    row["max_abs_diff"] = (calls["old"][1].float() - calls["new"][1].float()).abs().max().item()
    extra = ""
    if flops:
        row["old_TFLOP_s"], row["new_TFLOP_s"] = (flops / row[f"{t}_us"] / 1e6 for t in ("old", "new"))
        extra = f" | {row['old_TFLOP_s']:6.1f} -> {row['new_TFLOP_s']:6.1f} TFLOP/s"
    if nbytes:
        row["old_GB_s"], row["new_GB_s"] = (nbytes / row[f"{t}_us"] / 1e3 for t in ("old", "new"))
        extra = f" | {row['old_GB_s']:6.0f} -> {row['new_GB_s']:6.0f} GB/s"
    rows.append(row)
    print(f"r{rnd} {name:<52} old {row['old_us']:8.1f} us  new {row['new_us']:8.1f} us  "
          f"x{row['new_vs_old']:.3f}{extra}  max|diff| {row['max_abs_diff']:.3g}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-paged", required=True, help="an older kernels/paged_attention.py")
    ap.add_argument("--old-cascade", required=True, help="an older kernels/cascade_attention.py")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    paged_old = load(args.old_paged, "paged_attention_old")
    cascade_old = load(args.old_cascade, "cascade_attention_old", paged=paged_old)
    flush = torch.empty(80 * 2 ** 20, dtype=torch.uint8, device="cuda")
    pool = Pool(450_000)
    rows = []
    for rnd in range(args.rounds):
        for name, q_lens, ctx in PROMPTS + DECODES:
            batch = pool.batch(q_lens, ctx)
            calls = {}
            for tag, module in (("old", paged_old), ("new", paged_new)):
                out = torch.empty_like(batch[0])
                calls[tag] = (lambda m=module, o=out, batch=batch: m.paged_attention(
                    *batch, D ** -0.5, None, max_seqlen_q=max(q_lens), max_seqlen_k=max(ctx),
                    merge_in_kernel=max(q_lens) == 1, out=o), out)
            decode = max(q_lens) == 1
            compare(rows, name, calls, flush, rnd, flops=None if decode else 4 * HQ * D * causal_pairs(q_lens, ctx),
                    nbytes=sum(ctx) * 8 * D * 2 * 2 if decode else None)
        for name, groups, lone in CASCADES:
            b = Batch(groups, lone, seed=3)
            calls = {}
            for tag, module in (("old", cascade_old), ("new", cascade_new)):
                out = torch.empty_like(b.q)
                calls[tag] = (lambda m=module, o=out, b=b: m.cascade_attention(
                    *b.args(), D ** -0.5, max_seqlen_q=b.max_seqlen_q, max_group_rows=b.max_group_rows,
                    max_prefix_len=b.max_prefix_len, out=o), out)
            compare(rows, name, calls, flush, rnd)
            del b
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT"),
                   "old_paged": args.old_paged, "old_cascade": args.old_cascade, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
