"""lm_head at decode sizes (N=128256, K=4096, bf16; Llama-3.1-8B) on a GPU: cuBLAS (what
compute_logits runs) against the skinny GEMM's configs, us per call in a CUDA graph of 8.

    PYTHONPATH=. OUT=$OUT python3 scripts/gpu_lm_head_probe.py    (writes $OUT/lm_head_probe.json)
"""
import json, os, sys, torch, torch.nn.functional as F
sys.path.insert(0, ".")
from engine.gemm_tuning import replay_ms
from kernels.skinny_gemm import SkinnyConfig, candidate_configs, skinny_gemm
dev = torch.device("cuda"); n, k = 128256, 4096
w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
out = {"gpu": torch.cuda.get_device_name(), "rows": {}}
sms = torch.cuda.get_device_properties(dev).multi_processor_count
cfgs = candidate_configs(n, k, sms) + [SkinnyConfig(128, 128, 1, 8, 3), SkinnyConfig(64, 128, 1, 4, 4), SkinnyConfig(128, 256, 1, 8, 3), SkinnyConfig(256, 64, 1, 8, 4), SkinnyConfig(64, 256, 1, 4, 4)]
for rows in (1, 8):
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    r = {"cublas_us": replay_ms(lambda: [F.linear(x, w) for _ in range(8)], dev) * 1e3 / 8}
    for c in cfgs:
        try:
            r[str(c)] = replay_ms(lambda: [skinny_gemm(x, w, None, config=c) for _ in range(8)], dev) * 1e3 / 8
        except Exception as e:
            r[str(c)] = f"failed {type(e).__name__}"
    r["tb_per_s_cublas"] = n * k * 2 / (r["cublas_us"] * 1e-6) / 1e12
    out["rows"][rows] = r
    print(rows, json.dumps({a: (round(b, 2) if isinstance(b, float) else b) for a, b in r.items()}), flush=True)
json.dump(out, open(os.environ["OUT"] + "/lm_head_probe.json", "w"), indent=1)
