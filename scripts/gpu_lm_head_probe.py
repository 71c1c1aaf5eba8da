"""lm_head at decode sizes (N=128256, K=4096, bf16; Llama-3.1-8B) on a GPU: cuBLAS (what
compute_logits runs) against the skinny GEMM's configs, us per call in a CUDA graph of 8.

    PYTHONPATH=. OUT=$OUT python3 scripts/gpu_lm_head_probe.py    (writes $OUT/lm_head_probe.json)
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.gemm_tuning import replay_ms  # noqa: E402
from kernels.skinny_gemm import SkinnyConfig, candidate_configs, skinny_gemm  # noqa: E402

N, K, CALLS = 128256, 4096, 8


def main() -> None:
    dev = torch.device("cuda")
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    configs = candidate_configs(N, K, num_sms) + [
        SkinnyConfig(128, 128, 1, 8, 3), SkinnyConfig(64, 128, 1, 4, 4), SkinnyConfig(128, 256, 1, 8, 3),
        SkinnyConfig(256, 64, 1, 8, 4), SkinnyConfig(64, 256, 1, 4, 4)]
    out = {"gpu": torch.cuda.get_device_name(), "rows": {}}
    for rows in (1, 8):
        x = torch.randn(rows, K, device=dev, dtype=torch.bfloat16)
        r = {"cublas_us": replay_ms(lambda: [F.linear(x, w) for _ in range(CALLS)], dev) * 1e3 / CALLS}
        for c in configs:
            try:
                r[str(c)] = replay_ms(lambda c=c: [skinny_gemm(x, w, None, config=c) for _ in range(CALLS)],
                                      dev) * 1e3 / CALLS
            except Exception as e:          # a config that does not compile or fit: say so, go on
                r[str(c)] = f"failed {type(e).__name__}"
        r["tb_per_s_cublas"] = N * K * 2 / (r["cublas_us"] * 1e-6) / 1e12
        out["rows"][rows] = r
        print(rows, json.dumps({a: round(b, 2) if isinstance(b, float) else b for a, b in r.items()}), flush=True)
    with open(os.path.join(os.environ["OUT"], "lm_head_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
