"""The sampler's Triton kernels compile for an H100 / H200 (sm_90) on a machine without a GPU.

The interpreter runs their logic here (tests/test_race_sample.py, test_exp_noise.py,
test_argmax.py) but does not check what only the compiler checks: a constexpr assigned in each
round of a static_range ran interpreted and failed to compile on the GPU
(benchmarks/h200/race_sample.md, section 6). A child process without TRITON_INTERPRET, with a
driver that names sm_90 (scripts/sm90_target.py), compiles each variant the engine launches (triton's wheel carries
ptxas).
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import torch

from scripts.sm90_target import Ptr   # the active driver now names sm_90
import kernels.argmax as am
import kernels.exp_noise as en
import kernels.race_sample as rs

f32, i32, i64, bf16 = (Ptr(t) for t in (torch.float32, torch.int32, torch.int64, torch.bfloat16))
V = 128256
for num_rows in (1, 256):
    block, num_warps = rs.config_for(num_rows)
    for x in (f32, bf16):
        rs._race_sample_kernel.warmup(x, f32, f32, i64, f32, f32, i64, V, V, V, 1, 1, 1, BLOCK=block,
                                      num_warps=num_warps, grid=(1,))
    print("race_sample", block, num_warps)
en._exponential_noise_kernel.warmup(i64, i32, f32, V, V, BLOCK=en.BLOCK, num_warps=4, grid=(1,))
print("exp_noise")
chunks = -(-V // am.CHUNK)
am._chunk_max_kernel.warmup(f32, V, f32, i32, V, chunks, BLOCK=am.CHUNK, num_warps=4, grid=(1,))
am._pick_kernel.warmup(f32, i32, i64, V, chunks, BLOCK_C=32, num_warps=1, grid=(1,))
print("argmax")
print("ok")
'''


def test_sampler_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.splitlines()[-1:] == ["ok"], r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.splitlines()[:4] == ["race_sample 8192 16", "race_sample 4096 16", "exp_noise", "argmax"]
