"""One-off (twentieth session), kept as run: plain decode attention, the keys in one masked loop against the
two loops, over rows x keys, as the engine calls it (splits merged in the kernel, the fused
split rule), in CUDA graphs of 32 layers' calls; us a layer (do_bench median)."""
import json
import sys

import torch
import triton.testing

import kernels.paged_attention as pa
from scripts.bench_common import capture_graph
from scripts.gpu_check_attention import D
from scripts.gpu_check_cascade import Batch

LAYERS = 32
rows_out = []
for n in (1, 4, 16, 64, 256):
    for keys in (300, 1000, 2000, 4000, 8000, 16000):
        b = Batch([], [(1, keys)] * n, seed=n + keys)
        splits = pa.choose_fused_kv_splits(n, 8, keys)
        res = {}
        outs = {}
        for one in ((True, False) if (n + keys) % 2 else (False, True)):
            out = torch.empty_like(b.q)
            fn = lambda: pa.paged_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, D ** -0.5,  # noqa: E731
                                            max_seqlen_q=1, max_seqlen_k=keys, merge_in_kernel=True,
                                            out=out, one_loop=one)
            graph, _ = capture_graph(lambda: [fn() for _ in range(LAYERS)])
            res[one] = triton.testing.do_bench(graph.replay, warmup=20, rep=80, return_mode="median") * 1e3 / LAYERS
            graph.replay()
            torch.cuda.synchronize()
            outs[one] = out.clone()
            del graph
        r = dict(rows=n, keys=keys, splits=splits, steps_a_split=-(-keys // splits // 64),
                 one_loop_us=res[True], two_loops_us=res[False], gain=res[False] / res[True],
                 max_diff=(outs[True].float() - outs[False].float()).abs().max().item())
        rows_out.append(r)
        print(json.dumps(r), flush=True)
        del b, outs
        torch.cuda.empty_cache()
json.dump(rows_out, open(sys.argv[1], "w"), indent=1)
