"""One-off (twenty-first session), kept as run. Probe: plain decode attention at 1000 x 1000's shape (rows of 1,000-2,000 keys), rows in
random order against sorted by length (longest first, shortest first) and all of one length;
32 layers' calls in a CUDA graph, us a layer (do_bench median) and the K/V read rate."""
import json
import random
import sys

import torch
import triton.testing

import kernels.paged_attention as pa
from scripts.bench_common import capture_graph
from scripts.gpu_check_attention import D
from scripts.gpu_check_cascade import Batch

LAYERS = 32
out_rows = []
for n in (128, 256, 384):
    rng = random.Random(n)
    lens = [rng.randint(1000, 2000) for _ in range(n)]
    mean = sum(lens) // n
    variants = {"random": lens, "longest_first": sorted(lens, reverse=True),
                "shortest_first": sorted(lens), "all_mean": [mean] * n}
    for rep in range(2):
        for name, order in variants.items():
            b = Batch([], [(1, k) for k in order], seed=n)
            out = torch.empty_like(b.q)
            fn = lambda: pa.paged_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, D ** -0.5,  # noqa: E731
                                            max_seqlen_q=1, max_seqlen_k=max(order), merge_in_kernel=True,
                                            out=out)
            graph, _ = capture_graph(lambda: [fn() for _ in range(LAYERS)])
            us = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median") * 1e3 / LAYERS
            tbs = sum(order) * 4096 / us / 1e6
            r = dict(rows=n, order=name, rep=rep, keys=sum(order), us=us, tb_s=tbs)
            out_rows.append(r)
            print(json.dumps(r), flush=True)
            del graph, b, out
            torch.cuda.empty_cache()
json.dump(out_rows, open(sys.argv[1], "w"), indent=1)
