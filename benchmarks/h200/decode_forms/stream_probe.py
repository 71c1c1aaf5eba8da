"""One-off (twenty-second session), kept as run: the stream decode kernel (stream_decode.py here)
against the plain one as the engine calls it, 32 layers' calls in a CUDA graph, us a layer.

    PYTHONPATH=. python3 benchmarks/h200/decode_forms/stream_probe.py $OUT/stream.json 200
"""
import json, sys, time, random
import torch, triton.testing
import kernels.paged_attention as pa
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stream_decode as sd  # noqa: E402
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

def case(n, lens, variants, tag):
    b = Batch([], [(1, L) for L in lens], seed=n + sum(lens) % 1000)
    keys = max(lens)
    scale = D ** -0.5
    ref = torch.empty_like(b.q)
    plain = lambda: pa.paged_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, scale, max_seqlen_q=1,
                                       max_seqlen_k=keys, merge_in_kernel=True, out=ref)
    r = dict(tag=tag, rows=n, mean_keys=sum(lens) / n, max_keys=keys,
             gb=sum(lens) * 8 * D * 2 * 2 / 1e9)
    r["plain_us"] = timed(plain)
    plain(); torch.cuda.synchronize()
    res = {}
    for (bn, st, pps, nw) in variants:
        if time.time() - T0 > BUDGET:
            break
        o = torch.empty_like(b.q)
        fn = lambda: sd.stream_decode_attention(b.q, b.k, b.v, b.table, b.cu, b.lens, o, scale, block_n=bn,
                                                num_stages=st, programs_per_sm=pps, num_warps=nw)
        try:
            us = timed(fn)
            fn(); torch.cuda.synchronize()
            diff = (o.float() - ref.float()).abs().max().item()
            res[f"bn{bn}_st{st}_pps{pps}_w{nw}"] = dict(us=us, max_diff=diff, tbs=r["gb"] / us * 1e6 / 1e3)
        except Exception as e:
            res[f"bn{bn}_st{st}_pps{pps}_w{nw}"] = dict(error=repr(e)[:300])
    r["stream"] = res
    r["plain_tbs"] = r["gb"] / r["plain_us"] * 1e3
    best = min((v["us"], k) for k, v in res.items() if "us" in v) if any("us" in v for v in res.values()) else None
    r["best"] = best
    print(json.dumps(r), flush=True)
    out_rows.append(r)
    json.dump(out_rows, open(sys.argv[1], "w"), indent=1)
    del b
    torch.cuda.empty_cache()

rng = random.Random(0)
# Form 3's run (stream_form3_bc13624.json); forms 1, 2 and 4 ran other lists (decode_attention_forms.md).
full = [(128, 3, 2, 4), (128, 2, 2, 4), (64, 3, 2, 4), (64, 2, 2, 4), (128, 3, 1, 8)]
mixed256 = [rng.randrange(1000, 2001) for _ in range(256)]
case(256, mixed256, full, "mixed 1000-2000")
few = full[:3]
case(256, [1500] * 256, few, "equal")
case(256, [1000] * 256, few, "equal")
case(256, [2000] * 256, few, "equal")
case(512, [rng.randrange(1000, 2001) for _ in range(512)], few, "mixed 1000-2000")
case(128, [rng.randrange(1000, 2001) for _ in range(128)], few, "mixed 1000-2000")
case(64, [rng.randrange(300, 4001) for _ in range(64)], few, "mixed 300-4000")
case(256, [rng.randrange(50, 400) for _ in range(256)], few, "mixed 50-400")
