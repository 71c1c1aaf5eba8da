"""One-off (twenty-second session), kept as run: tile_gemm.py's configs (here) against F.linear
(cuBLAS) for a Llama-8B layer's projections at 256 / 384 / 512 rows; CUDA graphs over 32 layers'
weights (HBM), us a call.

    PYTHONPATH=. python3 benchmarks/h200/decode_forms/tile_gemm_probe.py $OUT/tile_gemm.json 200
"""
import json, sys, time
import torch
import torch.nn.functional as F
from engine.gemm_tuning import replay_ms
import os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tile_gemm import TileConfig, candidate_configs, tile_gemm  # noqa: E402

T0 = time.time()
BUDGET = float(sys.argv[2])
dev = torch.device("cuda")
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
CONFIGS = candidate_configs() + [TileConfig(64, 128, 64, 8, 4), TileConfig(64, 128, 128, 4, 3),
                                 TileConfig(64, 64, 64, 4, 4, 2)]
LAYERS = 32
gen = torch.Generator(device=dev).manual_seed(0)
out = []
for name, (n, k) in SHAPES.items():
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(LAYERS)]
    for rows in (256, 384, 512):
        if time.time() - T0 > BUDGET:
            break
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = F.linear(x, weights[0]).float()
        base = replay_ms(lambda: [F.linear(x, w) for w in weights], dev) * 1e3 / LAYERS
        flops = 2 * rows * n * k
        r = dict(proj=name, rows=rows, n=n, k=k, cublas_us=base, cublas_tflops=flops / base / 1e6, tile={})
        for c in CONFIGS:
            try:
                us = replay_ms(lambda: [tile_gemm(x, w, c) for w in weights], dev) * 1e3 / LAYERS
                err = (tile_gemm(x, weights[0], c).float() - ref).abs().max().item()
                r["tile"][str(c)] = dict(us=us, tflops=flops / us / 1e6, max_diff=err)
            except Exception as e:
                r["tile"][str(c)] = dict(error=repr(e)[:200])
        best = min(((v["us"], kk) for kk, v in r["tile"].items() if "us" in v), default=None)
        r["best"] = best
        print(json.dumps(dict(proj=name, rows=rows, cublas_us=round(base, 1), cublas_tflops=round(r["cublas_tflops"]),
                              best=best and (round(best[0], 1), best[1], round(flops / best[0] / 1e6))),
                         ), flush=True)
        out.append(r)
        json.dump(out, open(sys.argv[1], "w"), indent=1)
    del weights
    torch.cuda.empty_cache()
