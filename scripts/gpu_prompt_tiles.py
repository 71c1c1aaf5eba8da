"""Prompt tiles of the attention kernels over other tile configs, on the GPU (issue 12: a
shared-prefix job's prompt steps spend ~16% of their GPU time in the cascade own pass at ~240
TFLOP/s, benchmarks/h200/intake_and_overlap.md).

Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, 16-key pages, bf16). Each case's prompt chunks are
alone (prefix 0), as the engine runs them (engine/cascade_plan.py keeps chunks longer than a
prefix tile out of groups), beside two decode rows in a group over a 64-token prefix, as in a
shared-prefix job's prompt steps. Kernels:

  paged              `paged_attention`, the plain kernel
  cascade_own        `cascade_attention`, the own pass in one launch (the partials' fold compiled)
  cascade_apart      the own pass apart: decode tiles for the two decode rows, prompt tiles for
                     the chunks, as the engine runs such steps
  cascade_apart_nofold   the same with prompt_prefixes=False (prompt tiles compiled for prefix 0:
                         key loops from a literal 0, no fold)

once per config: (rows a tile, keys a step, warps, stages) put in place of the prompt tiles'
default (`_pick_config` / `_own_config` for max_seqlen_q > 1). A config whose output is off the
default's by more than 2e-2 is marked bad (its time is still shown). us per call (L2 flushed),
TFLOP/s of the chunks' attention.

    PYTHONPATH=. python3 scripts/gpu_prompt_tiles.py --out $OUT/prompt_tiles.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_common import positive_ints  # noqa: E402

# (name, groups, lone) as gpu_check_cascade.Batch takes them: groups' members share the prefix's
# physical blocks (as a prefix group pins them) but read them in the own pass (prefix 0).
CASES = [
    ("rfc prompt step: a leader's 2200 + 22 members' 200 after a shared 2000",
     [(2000, [(200, 200)] * 22)], [(2200, 2200)]),
    ("16 x 200 after a shared 2000", [(2000, [(200, 200)] * 16)], []),
    ("fresh 2048 x2", [], [(2048, 2048)] * 2),
    ("chunk 2048 after 6144", [], [(2048, 8192)]),
]
CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 3), (128, 128, 8, 2),
           (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2), (256, 32, 8, 3)]
BAD_DIFF = 2e-2
DECODE_GROUP = (64, [(1, 10), (1, 10)])     # two decode rows over a 64-token prefix


def causal_pairs_of(groups, lone) -> int:
    """(query, key) pairs of a case: each query row sees its sequence's keys up to its own."""
    seqs = [(q, p + own) for p, members in groups for q, own in members] + list(lone)
    return sum(sum(range(n - q + 1, n + 1)) for q, n in seqs)


def parse_config(text: str) -> tuple[int, int, int, int]:
    """'128,64,8,3' -> (rows a tile, keys a step, warps, stages)."""
    return positive_ints(text, "a config", "ROWS,KEYS,WARPS,STAGES", "128,64,8,3")


def main() -> None:
    import torch

    import kernels.cascade_attention as ca
    import kernels.paged_attention as pa
    from scripts.gpu_check_attention import HQ, D, bench_ms
    from scripts.gpu_check_cascade import Batch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=parse_config, nargs="+", default=CONFIGS)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    flush = torch.empty(80 * 2 ** 20, dtype=torch.uint8, device="cuda")
    pick, own = pa._pick_config, ca._own_config
    rows = []
    for name, groups, lone in CASES:
        b = Batch([DECODE_GROUP] + groups, lone, seed=3)
        q, k, v, table, cu, seq_lens, prefix_lens, _ = b.args()
        # The decode group keeps its prefix; the chunks read theirs in the own pass.
        prefix_lens = torch.where(torch.arange(len(prefix_lens), device=q.device) < 2, prefix_lens, 0)
        one_group = torch.tensor([0, 2], dtype=torch.int32, device=q.device)
        decodes = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
        prompts = torch.arange(2, len(prefix_lens), dtype=torch.int32, device=q.device)
        flops = 4 * HQ * D * causal_pairs_of(groups, lone)
        max_q = b.max_seqlen_q
        max_k = int(seq_lens.max())

        def cascade(out, **apart):
            return ca.cascade_attention(q, k, v, table, cu, seq_lens, prefix_lens, one_group, D ** -0.5,
                                        max_seqlen_q=max_q, max_group_rows=2, max_prefix_len=64,
                                        out=out, **apart)
        calls = {
            "paged": lambda out: pa.paged_attention(q, k, v, table, cu, seq_lens, D ** -0.5, None,
                                                    max_seqlen_q=max_q, max_seqlen_k=max_k, out=out),
            "cascade_own": cascade,
            "cascade_apart": lambda out: cascade(out, own_decode_seqs=decodes, own_prompt_seqs=prompts),
            "cascade_apart_nofold": lambda out: cascade(out, own_decode_seqs=decodes, own_prompt_seqs=prompts,
                                                        prompt_prefixes=False),
        }
        reference = {}
        for cfg in args.configs:
            tiles = (pa._TileConfig(*cfg), ca._TileConfig(*cfg))
            pa._pick_config = lambda m, *a, _t=tiles[0], **kw: _t if m > 1 else pick(m, *a, **kw)
            ca._own_config = lambda m, *a, _t=tiles[1]: _t if m > 1 else own(m, *a)
            try:
                for kernel, fn in calls.items():
                    out = torch.empty_like(q)
                    row = {"case": name, "kernel": kernel, "config": list(cfg)}
                    try:
                        fn(out)
                        torch.cuda.synchronize()
                        row["us"] = 1e3 * bench_ms(lambda: fn(out), 3, 15, flush)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is data
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        continue
                    ref = reference.setdefault("out", out.clone())     # the first: paged, default tile
                    row["max_abs_diff"] = (out.float() - ref.float()).abs().max().item()
                    row["bad"] = row["max_abs_diff"] > BAD_DIFF or bool(out.isnan().any())
                    row["tflops"] = flops / row["us"] / 1e6
                    rows.append(row)
                    print(f"{name[:40]:<40} {kernel:<12} {str(cfg):<18} {row['us']:9.1f} us "
                          f"{row['tflops']:6.1f} TFLOP/s  diff {row['max_abs_diff']:.3g}"
                          f"{'  BAD' if row['bad'] else ''}", flush=True)
            finally:
                pa._pick_config, ca._own_config = pick, own
        del b
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("BENCH_COMMIT"),
                   "command": "python3 scripts/gpu_prompt_tiles.py " + " ".join(sys.argv[1:]),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
