"""One-off (twentieth session), kept as run: decode attention (the cascade passes side by side, the plain
kernel) in CUDA graphs of 32 layers' calls, us a layer (do_bench median); outputs saved so two
trees' bits can be compared.  PYTHONPATH=. python3 benchmarks/h200/one_loop_first_probe.py TAG OUTDIR"""
import json
import sys

import torch
import triton.testing

import kernels.paged_attention as pa
from scripts.bench_common import capture_graph
from scripts.gpu_check_attention import D
from scripts.gpu_check_cascade import Batch, decode_groups

tag, outdir = sys.argv[1], sys.argv[2]
LAYERS = 32
CASCADE = [(256, 16, 2000, 250), (256, 16, 2000, 100), (128, 16, 2000, 250), (64, 16, 2000, 250),
           (32, 16, 2000, 250), (256, 4, 496, 200), (16, 16, 2000, 2000)]
PLAIN = [(256, 1500), (256, 250), (128, 1500), (64, 1000), (16, 8000), (1, 1000), (1, 300), (512, 1100)]
rows, outs = [], {}
for case in [("cascade",) + c for c in CASCADE] + [("plain",) + c for c in PLAIN]:
    if case[0] == "cascade":
        n, size, prefix, own = case[1:]
        b = Batch(decode_groups(size, prefix, num_rows=n, own_len=own), seed=n + own)
        out = torch.empty_like(b.q)
        fn = lambda: b.cascade(out=out, side_by_side=True)  # noqa: E731
    else:
        n, keys = case[1:]
        b = Batch([], [(1, keys)] * n, seed=n + keys)
        out = torch.empty_like(b.q)
        fn = lambda: pa.paged_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, D ** -0.5,  # noqa: E731
                                        max_seqlen_q=1, max_seqlen_k=b.max_seqlen_k, out=out)
    graph, _ = capture_graph(lambda: [fn() for _ in range(LAYERS)])
    us = triton.testing.do_bench(graph.replay, warmup=25, rep=150, return_mode="median") * 1e3 / LAYERS
    graph.replay()
    torch.cuda.synchronize()
    key = "-".join(map(str, case))
    outs[key] = out.clone().cpu()
    rows.append({"case": key, "us": us})
    print(f"{tag} {key:28s} {us:8.2f} us a layer", flush=True)
    del graph, b, out
    torch.cuda.empty_cache()
json.dump(rows, open(f"{outdir}/loops_{tag}.json", "w"), indent=1)
torch.save(outs, f"{outdir}/outs_{tag}.pt")
