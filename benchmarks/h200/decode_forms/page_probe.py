"""One-off (twenty-second session), kept as run: decode attention reading whole page regions (kernels/page_decode.py, every kv head a
program) against the plain kernel as the engine calls it; 32 layers' calls in a CUDA graph, us a
layer (do_bench median), TB/s of K and V read.

    PYTHONPATH=. python3 benchmarks/h200/decode_forms/page_probe.py $OUT/page.json 200
"""
import json, sys, time, random
import torch, triton.testing
import kernels.paged_attention as pa
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import page_decode as pd  # noqa: E402
from scripts.bench_common import capture_graph
from scripts.gpu_check_attention import D
from scripts.gpu_check_cascade import Batch

LAYERS = 32
T0 = time.time()
BUDGET = float(sys.argv[2])
out_rows = []

def timed(fn):
    graph, _ = capture_graph(lambda: [fn() for _ in range(LAYERS)])
    us = triton.testing.do_bench(graph.replay, warmup=20, rep=60, return_mode="median") * 1e3 / LAYERS
    del graph
    return us

def case(lens, variants, tag):
    n = len(lens)
    b = Batch([], [(1, L) for L in lens], seed=n + sum(lens) % 1000)
    keys = max(lens)
    scale = D ** -0.5
    ref = torch.empty_like(b.q)
    plain = lambda: pa.paged_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, scale, max_seqlen_q=1,
                                       max_seqlen_k=keys, merge_in_kernel=True, out=ref)
    gb = sum(lens) * 8 * D * 2 * 2 / 1e9
    r = dict(tag=tag, rows=n, mean_keys=sum(lens) / n, max_keys=keys, gb=gb)
    r["plain_us"] = timed(plain)
    r["plain_tbs"] = gb / r["plain_us"] * 1e3
    plain(); torch.cuda.synchronize()
    res = {}
    for (kk, st, nw, sp) in variants:
        if time.time() - T0 > BUDGET:
            break
        o = torch.empty_like(b.q)
        fn = lambda: pd.page_decode_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, o, scale, num_kv_splits=sp,
                                              keys=kk, num_stages=st, num_warps=nw)
        name = f"keys{kk}_st{st}_w{nw}_s{sp}"
        try:
            us = timed(fn)
            fn(); torch.cuda.synchronize()
            res[name] = dict(us=us, tbs=gb / us * 1e3, max_diff=(o.float() - ref.float()).abs().max().item())
        except Exception as e:
            res[name] = dict(error=repr(e)[:300])
    r["page"] = res
    print(json.dumps(r), flush=True)
    out_rows.append(r)
    json.dump(out_rows, open(sys.argv[1], "w"), indent=1)
    del b
    torch.cuda.empty_cache()

rng = random.Random(0)
full = [(8, 3, 4, 1), (8, 3, 4, 2), (8, 3, 4, 4), (8, 3, 4, 8), (16, 3, 8, 2), (16, 3, 8, 4), (8, 2, 4, 4),
        (4, 3, 4, 4), (8, 3, 8, 4)]
case([1500] * 256, full, "equal")
case([rng.randrange(1000, 2001) for _ in range(256)], full, "mixed 1000-2000")
few = [(8, 3, 4, 1), (8, 3, 4, 2), (8, 3, 4, 4), (16, 3, 8, 4), (4, 3, 4, 4)]
case([1000] * 256, few, "equal")
case([rng.randrange(1000, 2001) for _ in range(512)], few, "mixed 1000-2000")
case([rng.randrange(1000, 2001) for _ in range(128)], few, "mixed 1000-2000")
case([rng.randrange(300, 4001) for _ in range(64)], few + [(8, 3, 4, 8)], "mixed 300-4000")
case([rng.randrange(50, 400) for _ in range(256)], few, "mixed 50-400")
