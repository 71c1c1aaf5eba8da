"""Every GPU kernel at real shapes (Llama-3.1-8B, bf16): correctness against its reference,
time, achieved GB/s or TFLOP/s, and the ratio to the PyTorch reference / SDPA.

Runs scripts/gpu_check_attention.py (paged attention: decode at 1k/8k/32k context, prefill
chunks of 512 and 2048, mixed batches) and scripts/gpu_check_layers.py (RMSNorm(+residual),
rotary, SiLU-and-mul, KV write), writing OUT_attention.json and OUT_layers.json.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="benchmarks/h200/kernels")
    args = ap.parse_args()
    rc = 0
    for name in ("attention", "layers"):
        cmd = [sys.executable, os.path.join(HERE, f"gpu_check_{name}.py"),
               "--out", f"{args.out}_{name}.json"]
        print("$", " ".join(cmd), flush=True)
        rc |= subprocess.run(cmd).returncode
    sys.exit(rc)


if __name__ == "__main__":
    main()
