"""One side stream a device, for two launches of one step that may run side by side (the
cascade step's prefix and own passes: kernels/cascade_attention.py; a mixed step's prompt chunks
beside its decode rows: engine/models/attention.py)."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["side_stream", "SIDE_STREAMS"]

SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def side_stream(device: torch.device):
    """Yields a side stream of `device` that has waited for the current stream's work (None on
    the CPU); on leaving, the current stream waits for the side stream's. One stream a device,
    made on first use (a warm-up call: making it under CUDA-graph capture is not asked of CUDA).
    What the side stream reads or writes must stay alive until the current stream has waited,
    which leaving does."""
    if device.type != "cuda":
        yield None
        return
    side = SIDE_STREAMS.get(device)
    if side is None:
        side = SIDE_STREAMS[device] = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)
    yield side
    main.wait_stream(side)
