"""Programmatic dependent launch (PDL) for a chain of small kernels: a decode step of a few rows.

A decode step of one sequence is ~330 kernels one after another; the weight GEMMs move nearly all
the bytes, and between two of them the RMSNorm, rotary + KV write, attention and SiLU kernels
(2-9 us each, bound by latency, not bandwidth) leave the memory idle: ~0.6 ms of a 4.6 ms step
on the H200 (benchmarks/h200/decode_kernels.md).

With PDL (CUDA, compute capability 9.0 and up) the GPU may start a kernel before the one ahead
of it in the stream has finished. Each kernel launched so (`launch_pdl=True`) begins with
`griddepcontrol.wait`, which returns once the kernel ahead has finished and its writes are
visible, and then at once `griddepcontrol.launch_dependents`, which lets the next kernel start.
What PDL buys: the next kernel is launched and its programs placed while the one ahead still
runs, so the gap between two kernels (launch, ramp-up, tail) shrinks. Our kernels do nothing but
address arithmetic before their wait. Starting the skinny GEMM's weight stream before it (weights
are read-only) was tried on the H200 and made the step slower: prefetching into L2 (2 MB in all
as fast as none, 16 MB +0.3 ms, 48 MB +1.2 ms a step) and loading the first weight step (PDL's
gain fell from 0.22 to 0.08 ms a step); benchmarks/h200/decode_pdl.md.

Why the chain stays ordered: a kernel passes its wait only after the kernel ahead finished, and
that one finished only after passing its own wait; so every earlier kernel has finished too.
Kernels launched without PDL (cuBLAS, torch) wait for the one ahead to finish, as always.

The engine launches with PDL only inside decode CUDA graphs of up to 16 rows
(EngineConfig.decode_pdl, engine/cuda_graphs.py); each kernel's Python function takes `pdl`.
"""
from __future__ import annotations

import os

import torch

__all__ = ["check", "launch_options", "supported"]


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def supported(device: torch.device) -> bool:
    """PDL can be used for kernels on `device`: CUDA, compute capability >= 9.0, compiled
    (the Triton interpreter has no griddepcontrol)."""
    return (device.type == "cuda" and not _interpreted()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def check(pdl: bool, device: torch.device, kernel: str) -> None:
    if pdl and not supported(device):
        raise ValueError(f"{kernel}: pdl=True needs a CUDA device of compute capability >= 9.0 and "
                         f"compiled Triton kernels (not TRITON_INTERPRET), got {device}")


def launch_options(pdl: bool) -> dict:
    """Keyword arguments of a Triton launch: with PDL or as usual."""
    return {"launch_pdl": True} if pdl else {}


