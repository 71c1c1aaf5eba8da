"""Does a prefill chunk's GEMM run faster cut into row chunks than whole (issue 13), on a GPU:
each projection of a Llama-3.1-8B layer at --rows rows (bf16, cuBLAS through torch.mm into one
output), whole and in chunks of 4096 ... 512 rows, in a CUDA graph over 32 layers' own weights
(as scripts/gpu_gemm_rate.py times them), each timed twice; then the four projections in layer
order, whole and chunked. Run beside `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,
clocks_throttle_reasons.active --format=csv -lms 250` to see the clocks the GEMMs run at.

    PYTHONPATH=. python3 scripts/gpu_prefill_gemm_chunks.py --out $OUT/prefill_gemm_chunks.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.gemm_tuning import replay_ms  # noqa: E402
from scripts.bench_common import PRESETS, git_commit  # noqa: E402
from scripts.gpu_gemm_rate import layer_shapes  # noqa: E402

CHUNKS = (4096, 2048, 1024, 512)


def mm_chunked(x: torch.Tensor, w: torch.Tensor, chunk: int, y: torch.Tensor) -> None:
    for i in range(0, x.shape[0], chunk):
        torch.mm(x[i:i + chunk], w.t(), out=y[i:i + chunk])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, m, layers = torch.device("cuda"), args.rows, args.layers
    gen = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    shapes = layer_shapes(PRESETS["llama-3.1-8b"])
    chunks = [m] + [c for c in CHUNKS if c < m]
    results = []
    weights = {name: [rand(n, k) * 0.02 for _ in range(layers)] for name, (n, k) in shapes.items()}
    inputs = {name: rand(m, k) for name, (n, k) in shapes.items()}
    outputs = {name: torch.empty(m, n, device=dev, dtype=torch.bfloat16) for name, (n, k) in shapes.items()}
    for name, (n, k) in shapes.items():
        for chunk in chunks:
            for rep in range(2):
                us = replay_ms(lambda: [mm_chunked(inputs[name], w, chunk, outputs[name])
                                        for w in weights[name]], dev) * 1e3 / layers
                tflops = 2 * m * n * k / us / 1e6
                results.append({"proj": name, "rows": m, "chunk": chunk, "rep": rep, "us": us, "tflops": tflops})
                print(f"{name:>12} {m} rows, chunks of {chunk:5d}: {us:8.1f} us {tflops:6.1f} TFLOP/s", flush=True)

    def layer_order(chunk: int) -> None:
        for i in range(layers):
            for name in shapes:
                mm_chunked(inputs[name], weights[name][i], chunk, outputs[name])

    flops = sum(2 * m * n * k for n, k in shapes.values()) * layers
    for chunk in chunks + [m]:
        ms = replay_ms(lambda: layer_order(chunk), dev)
        results.append({"proj": "layers", "rows": m, "chunk": chunk, "ms": ms, "tflops": flops / ms / 1e9})
        print(f"layer order, {m} rows, chunks of {chunk}: {ms:8.2f} ms {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
