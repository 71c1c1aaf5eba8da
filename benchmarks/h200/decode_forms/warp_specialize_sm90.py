"""Does triton 3.6 warp-specialize a flash-attention key loop for an H100/H200 (sm_90)? A
FlashAttention-3-class prompt kernel needs one warp group's softmax to overlap another's wgmma
(ncu_attention_and_rows.md: the prompt tiles are compute-bound at ~335 TFLOP/s, FA2-structured).
Compiles ws_attention_probe.py's key loops (the ones it times) on a machine without a GPU,
with `tl.range(..., warp_specialize=...)` off and on, with pointer loads and with TMA tensor
descriptors, at 4 and 8 warps, and counts what the TTGIR holds: `ttg.warp_specialize` (the
partitioned region), TMA copies, wgmmas, and the warps and shared memory the kernel ends
with. The same loops for a B200 (sm_100) are the control. Each compile runs in a process of
its own (triton keeps the first target it sees).
Twenty-third session: on sm_90 the loop is partitioned only with TMA descriptors at 4 warps
(12 warps in all: a producer and two consumer warp groups); pointer loads at 4 warps stop the
compiler (an assertion in its Hopper warp specialization); at 8 warps nothing is partitioned.

    python3 benchmarks/h200/decode_forms/warp_specialize_sm90.py
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
sys.path.insert(0, HERE)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from scripts.sm90_target import Ptr, Sm90Driver  # noqa: E402 - makes the sm_90 stand-in the active driver
from ws_attention_probe import _attn_descriptors, _attn_pointers  # noqa: E402 - the loops it times


class Sm100Driver(Sm90Driver):
    def get_current_target(self):
        return GPUTarget("cuda", 100, 32)


def compile_one(arch: int, form: str, warps: int, ws: bool) -> str:
    """One compile, in this process: what its TTGIR holds, as a line."""
    if arch != 90:
        driver.set_active(Sm100Driver())
    triton.set_allocator(lambda size, align, stream: Ptr())      # the descriptors' scratch
    args = (Ptr(), Ptr(), Ptr(), Ptr(), 4096) + ((0.1,) if form == "pointers" else (32, 0.1))
    kernel = {"pointers": _attn_pointers, "descriptors": _attn_descriptors}[form]
    k = kernel.warmup(*args, WS=ws, BM=128, BN=64, D=128, num_warps=warps, num_stages=3, grid=(1,))
    ttgir = k.asm["ttgir"]
    return (f"ttg.warp_specialize {ttgir.count('ttg.warp_specialize')}, warps {k.metadata.num_warps}, "
            f"smem {k.metadata.shared} B, TMA copies {ttgir.count('async_tma_copy_global_to_local')}, "
            f"wgmma {ttgir.count('warp_group_dot ')}")


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--one":
        print(compile_one(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "True"))
        return
    print(f"triton {triton.__version__}, 128 x 64 tiles, head dim 128, 3 stages")
    for arch in (90, 100):
        for form in ("pointers", "descriptors"):
            for warps in (4, 8):
                for ws in (False, True):
                    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(arch), form,
                                           str(warps), str(ws)], capture_output=True, text=True)
                    line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 else \
                        "compile failed: " + next((l for l in done.stderr.splitlines() if "Assertion" in l),
                                                  done.stderr.strip().splitlines()[-1])[-150:]
                    print(f"sm_{arch} {form:11} {warps} warps warp_specialize={ws!s:5}: {line}", flush=True)


if __name__ == "__main__":
    main()
