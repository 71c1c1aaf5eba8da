"""A mixed step's attention: decode rows beside one prompt chunk, in the forms a step could run
it (issue 13; prefill ahead, benchmarks/h200/prefill_ahead.md).

`engine/models/attention.py` `_mixed_paged_attention` runs a mixed step in two calls: the decode
rows (decode tiles, one KV split) and then the prompt chunks (prompt tiles). One 256-token chunk
of one sequence is 8 tiles x 8 kv heads = 64 programs on 132 SMs, each over the chunk's whole
context: in prefill ahead's mixed steps the chunk's attention took +0.66 ms a step (32 layers),
where 256 tokens of a full prompt step take ~0.2. The forms, each 32 layers' calls in one CUDA
graph (the same cache each layer, far larger than L2), do_bench median of the replay, us a layer:

  decode_only       the decode rows' call alone
  chunk_only        the chunk's call alone
  two_calls         the engine's form
  two_calls_sS      the chunk's call with S KV splits (its programs x S, then a merge launch)
  chunk_side        the chunk's call on a side stream, launched before the decode rows' call

Each form's output is checked against two_calls (bf16 tolerances), and two_calls against the
fp32 reference.

    PYTHONPATH=. python3 scripts/gpu_mixed_chunk_attention.py --out $OUT/mixed_chunk_attention.json
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = 32
# (decode rows, their context, chunk tokens, the chunk's context at its end)
CASES = [(256, 1500, 256, 1256), (256, 1500, 512, 1512), (64, 1500, 256, 1256), (256, 1000, 2048, 2048)]
SPLITS = (2, 4, 8)


def forms(splits=SPLITS) -> list[str]:
    return ["decode_only", "chunk_only", "two_calls"] + [f"two_calls_s{s}" for s in splits] + ["chunk_side"]


def main() -> None:
    import torch

    from kernels.paged_attention import paged_attention, paged_attention_ref
    from scripts.bench_common import graph_us_a_call, write_probe
    from scripts.gpu_check_attention import ATOL, RTOL, D, Pool, errors

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    pool = Pool(4_000_000)
    side = torch.cuda.Stream()
    rows = []
    for nd, ctx_d, chunk, ctx_c in CASES:
        q, k, v, table, cu, lens = pool.batch([1] * nd + [chunk], [ctx_d] * nd + [ctx_c])
        scale = D ** -0.5

        def decode_call(out):
            paged_attention(q[:nd], k, v, table[:nd], cu[:nd + 1], lens[:nd], scale, None, max_seqlen_q=1,
                            max_seqlen_k=ctx_d, num_kv_splits=1, out=out[:nd])

        def chunk_call(out, splits=None):
            paged_attention(q, k, v, table[nd:], cu[nd:], lens[nd:], scale, None, max_seqlen_q=chunk,
                            max_seqlen_k=ctx_c, num_kv_splits=splits, out=out)

        def chunk_beside(out):
            main_stream = torch.cuda.current_stream()
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                chunk_call(out)
            decode_call(out)
            main_stream.wait_stream(side)

        calls = {"decode_only": decode_call, "chunk_only": chunk_call,
                 "two_calls": lambda out: (decode_call(out), chunk_call(out)),
                 "chunk_side": chunk_beside}
        for s in SPLITS:
            calls[f"two_calls_s{s}"] = lambda out, s=s: (decode_call(out), chunk_call(out, s))
        times, outs = {}, {}
        for form in forms():
            out = torch.zeros_like(q)
            times[form] = graph_us_a_call(lambda: calls[form](out), LAYERS)
            outs[form] = out.clone()
        ref = paged_attention_ref(q.float(), k.float(), v.float(), table, cu, lens, scale)
        base = outs["two_calls"]
        close = {f: bool(torch.allclose(o.float(), base.float(), atol=ATOL, rtol=RTOL))
                 for f, o in outs.items() if f.startswith(("two_calls_", "chunk_side"))}
        r = dict(decode_rows=nd, decode_ctx=ctx_d, chunk=chunk, chunk_ctx=ctx_c, us_a_layer=times,
                 close_to_two_calls=close, two_calls_vs_ref=errors(base, ref))
        rows.append(r)
        print(f"{nd} decode rows x {ctx_d} keys + a {chunk}-token chunk at {ctx_c}: "
              + ", ".join(f"{f} {t:.1f}" for f, t in times.items())
              + f" us a layer; close {close}; two_calls vs ref {r['two_calls_vs_ref']}", flush=True)
        del outs, ref
    write_probe(args.out, rows, layers=LAYERS)


if __name__ == "__main__":
    main()
