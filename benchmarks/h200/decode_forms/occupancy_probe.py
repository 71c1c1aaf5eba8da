"""One-off (twenty-second session), kept as run: the plain decode kernel (engine's call: merged splits, one split from 33 rows) with its
registers capped (maxnreg) so that 3 programs fit an SM, against as it is; 32 layers' calls
in a CUDA graph, us a layer.

    PYTHONPATH=. python3 benchmarks/h200/decode_forms/occupancy_probe.py $OUT/occupancy.json
"""
import json, sys, random
import torch, triton.testing
import kernels.paged_attention as pa
from scripts.bench_common import capture_graph
from scripts.gpu_check_attention import D
from scripts.gpu_check_cascade import Batch

LAYERS = 32
ORIG = pa._paged_attention_kernel

class Capped:
    def __init__(self, maxnreg):
        self.maxnreg = maxnreg
    def __getitem__(self, grid):
        def launch(*a, **kw):
            if self.maxnreg:
                kw["maxnreg"] = self.maxnreg
            return ORIG[grid](*a, **kw)
        return launch

def timed(fn):
    graph, _ = capture_graph(lambda: [fn() for _ in range(LAYERS)])
    us = triton.testing.do_bench(graph.replay, warmup=20, rep=60, return_mode="median") * 1e3 / LAYERS
    del graph
    return us

rng = random.Random(0)
cases = [("equal", [1500] * 256), ("mixed 1000-2000", [rng.randrange(1000, 2001) for _ in range(256)]),
         ("equal", [1000] * 256), ("equal", [2000] * 256),
         ("mixed 1000-2000", [rng.randrange(1000, 2001) for _ in range(512)]),
         ("mixed 1000-2000", [rng.randrange(1000, 2001) for _ in range(128)]),
         ("mixed 300-4000", [rng.randrange(300, 4001) for _ in range(64)]),
         ("mixed 50-400", [rng.randrange(50, 400) for _ in range(256)])]
rows_out = []
for tag, lens in cases:
    n = len(lens)
    b = Batch([], [(1, L) for L in lens], seed=n + sum(lens) % 1000)
    gb = sum(lens) * 8 * D * 2 * 2 / 1e9
    r = dict(tag=tag, rows=n, mean_keys=sum(lens) / n, gb=gb)
    outs = {}
    order = (None, 168, 160) if n % 3 else (160, 168, None)
    for cap in order:
        pa._paged_attention_kernel = Capped(cap)
        o = torch.empty_like(b.q)
        fn = lambda: pa.paged_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, D ** -0.5, max_seqlen_q=1,
                                        max_seqlen_k=max(lens), merge_in_kernel=True, out=o)
        us = timed(fn)
        fn(); torch.cuda.synchronize()
        outs[cap] = o.clone()
        r[f"maxnreg_{cap}_us"] = us
        r[f"maxnreg_{cap}_tbs"] = gb / us * 1e3
    pa._paged_attention_kernel = ORIG
    r["same_bits"] = all(torch.equal(outs[None], outs[c]) for c in (168, 160))
    print(json.dumps(r), flush=True)
    rows_out.append(r)
    json.dump(rows_out, open(sys.argv[1], "w"), indent=1)
    del b
    torch.cuda.empty_cache()
