"""What the decode kernels compile to for an H100/H200 (sm_90), on a machine without a GPU: each
kernel's shared memory, its registers and spills (cuobjdump on the cubin), and whether its key
loop was software-pipelined (async copies in the TTGIR). Triton compiles for a target given by
hand; the driver is replaced by one that names sm_90, and pointers by stand-ins aligned to 16.
Kept as run (twenty-second session); writes each kernel's TTGIR to /tmp.

    python3 benchmarks/h200/decode_forms/compile_sm90.py
"""
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import triton  # noqa: E402
from scripts.sm90_target import Ptr  # noqa: E402 - makes the sm_90 stand-in the active driver


def report(name, kernel):
    ttgir = kernel.asm["ttgir"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    print(f"{name:42} smem {kernel.metadata.shared:6d} B  regs {regs.group(1):>3}  stack {regs.group(2):>3}  "
          f"async copies {ttgir.count('async_copy_global_to_local'):2d}")
    with open(f"/tmp/{name.replace(' ', '_')}.ttgir", "w") as f:
        f.write(ttgir)


I32, F32 = torch.int32, torch.float32
# Llama-8B decode: q [T, 32, 128], caches [N, 16, 8, 128], out like q, block table rows of 128.
STRIDES = [4096, 128, 1, 16384, 1024, 128, 1, 16384, 1024, 128, 1, 4096, 128, 1, 128]
TENSORS = [Ptr(), Ptr(), Ptr(), Ptr()]
META = [Ptr(I32), Ptr(I32), Ptr(I32), Ptr(I32)]

import kernels.paged_attention as pa  # noqa: E402
import page_decode as pd  # noqa: E402
import stream_decode as sd  # noqa: E402

for cap in (None, 168):
    opts = {"maxnreg": cap} if cap else {}
    k = pa._paged_attention_kernel.warmup(
        *TENSORS, Ptr(), Ptr(), Ptr(), *META, 0.127, 0, 256, 256, 32, 1, *STRIDES,
        GROUP=4, G_PAD=4, BLOCK_M=4, BLOCK_Q=16, BLOCK_N=128, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=1,
        MERGE_IN_KERNEL=False, HAS_WINDOW=False, DOT_PRECISION="tf32", USE_PDL=False, KV_AHEAD=False,
        PROMPT=False, I32=True, ONE_LOOP=True, num_warps=4, num_stages=3, grid=(1,), **opts)
    report(f"plain 128 keys st3 w4 maxnreg={cap}", k)
for bn, st in ((128, 3), (128, 2), (64, 3)):
    k = sd._stream_decode_kernel.warmup(
        *TENSORS, Ptr(F32), Ptr(F32), Ptr(F32), *META, 0.127, 0, 256, 256, 8, *STRIDES,
        GROUP=4, BLOCK_Q=16, BLOCK_N=bn, HEAD_DIM=128, PAGE_SIZE=16, SEQ_CHUNK=256, SEQS=16, HAS_WINDOW=False,
        DOT_PRECISION="tf32", USE_PDL=False, I32=True, NUM_STAGES=st, num_warps=4, num_stages=st, grid=(1,))
    report(f"stream {bn} keys st{st} w4", k)
for keys, st, nw in ((8, 3, 4), (16, 3, 8), (4, 3, 4)):
    k = pd._page_decode_kernel.warmup(
        *TENSORS, Ptr(F32), Ptr(F32), Ptr(F32), *META, 0.127, 0, 256, 256, *STRIDES,
        NUM_HEADS=32, NUM_KV_HEADS=8, H_PAD=32, HEAD_DIM=128, PAGE_SIZE=16, KEYS=keys, NUM_SPLITS=1,
        HAS_WINDOW=False, DOT_PRECISION="tf32", USE_PDL=False, NUM_STAGES=st, num_warps=nw, num_stages=st,
        grid=(1,))
    report(f"page {keys} keys st{st} w{nw}", k)

import tile_gemm as tg  # noqa: E402

for c in tg.candidate_configs():
    k = tg._tile_gemm_kernel.warmup(
        Ptr(), Ptr(), Ptr(), Ptr(F32), Ptr(I32), 256, 4096, 4096, 4096, 4096, 4096,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SPLIT_K=c.split_k, EVEN_K=True,
        NUM_STAGES=c.num_stages, DOT_PRECISION="tf32", num_warps=c.num_warps, num_stages=c.num_stages, grid=(1,))
    report("tile_gemm " + str(c).replace("/", "_"), k)
