"""Arrival counters for kernels whose last program to finish merges the others' partials.

A split kernel (split-K GEMM in kernels/skinny_gemm.py, split-KV attention in
kernels/paged_attention.py) can merge its splits without a second launch: each program stores
its fp32 partial, then bumps its output tile's counter with an acq_rel atomic; the program that
brings it to the number of splits merges every partial in split order and sets the counter back
to 0. So the counters are zeroed once, here, and are back at zero after every call: a CUDA graph
replays the kernel alone, with no memset before it.

One int32 buffer per (owner, device), shared by all of that owner's calls: calls on one device
must not overlap in time (one stream). A buffer is allocated on first use, outside any CUDA graph
capture (under capture it could not be zeroed before the graph's first replay), and is never
freed: when a larger one replaces it, graphs captured over the old one still use it.
"""
from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

_MIN_COUNTERS = 8192
_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_REPLACED: list[torch.Tensor] = []          # kept alive for the graphs that captured them


def arrival_counters(owner: str, device: torch.device, needed: int) -> torch.Tensor:
    """At least `needed` int32 counters, all zero between calls, for `owner`'s kernels on
    `device` (a torch.device with its index: tensors report cuda:0, not cuda)."""
    key = (owner, device)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: run a split call once before CUDA graph capture (its "
                               f"arrival counters are allocated, zeroed, on first use)")
        if counters is not None:
            _REPLACED.append(counters)
        counters = torch.zeros(max(needed, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters
