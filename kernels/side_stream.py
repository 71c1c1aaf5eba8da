"""One side stream a device, for two launches of one step that may run side by side (the
cascade step's prefix and own passes: kernels/cascade_attention.py; a mixed step's prompt chunks
beside its decode rows: engine/models/attention.py)."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["side_stream", "SIDE_STREAMS"]

SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def side_stream(device: torch.device, enabled: bool = True):
    """Two launches side by side: yields a context that runs what it holds on a side stream of
    `device`, which has waited for the current stream's work; on leaving, the current stream
    waits for the side stream's. What follows the held launches inside this context runs on the
    current stream beside them:

        with side_stream(device) as on_side:
            with on_side:
                first()       # the side stream
            second()          # the current stream, beside first()

    On the CPU, or with enabled False, the held launches run on the current stream, in turn.
    One stream a device, made on first use (a warm-up call: making it under CUDA-graph capture
    is not asked of CUDA). What the side stream reads or writes must stay alive until the
    current stream has waited, which leaving does, by an exception too."""
    if device.type != "cuda" or not enabled:
        yield contextlib.nullcontext()
        return
    side = SIDE_STREAMS.get(device)
    if side is None:
        side = SIDE_STREAMS[device] = torch.cuda.Stream(device)
    main = torch.cuda.current_stream(device)
    side.wait_stream(main)
    try:
        yield torch.cuda.stream(side)
    finally:    # also when a launch raised: nothing after may reuse what the side stream holds
        main.wait_stream(side)
