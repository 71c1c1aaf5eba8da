"""Copies between host and GPU that never make the host wait for the GPU.

With async scheduling (engine/engine_core.py) the host prepares step N+1 while the GPU still
runs step N. A blocking copy (`tensor.to("cuda")`) would wait for the stream, that is for step
N, and the overlap would be gone; so would a non-blocking one from pageable memory, which CUDA
may serialize. On CUDA every host array therefore goes through pinned memory from PyTorch's
caching host allocator, which keeps a pinned block until the copies queued from it have run.
On CPU these are plain tensors (no copy at all where none is needed).
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def list_to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list (or nested lists) as a device tensor, staged in pinned memory on CUDA."""
    device = torch.device(device)
    host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, a: np.ndarray) -> None:
    """dst[...] = a, queued on the current stream."""
    t = torch.from_numpy(a)
    dst.copy_(t.pin_memory() if dst.is_cuda else t, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host tensor that holds t once the current stream has run up to here (record an event
    and wait on it before reading; on CPU it holds t at once)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
