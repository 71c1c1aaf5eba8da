"""What the penalties read, kept on the device between steps: a row per request with a
repetition, presence or frequency penalty (engine/sampler.py `apply_penalties`).

- `counts` [R, V] int32: how often each token id occurs in the request's output;
- `prompt_seen` [R, V] bool: which ids its prompt holds (the repetition penalty's other half).

A row is filled once, when the request arrives at the runner (its prompt, and the output it
already has when it comes back after a preemption). After that the device adds each step's
sampled tokens itself (`record`, right after the sampler, on the same stream), so a step reads
its rows with one gather (`rows_for`). No step copies prompts or outputs from the host, and none
waits for the step in flight: that step's tokens are counted on the device before the next
step's sampler reads the counts. (Building those lists on the host took ~58 ms a step at 256
rows of 1,000 prompt + 500 output tokens on the CI machine, and waiting for the step in flight
took away the overlap of host and GPU.)

Memory: 5 bytes a vocabulary entry a row (0.64 MB at Llama 3's 128,256), made for the first
request with a penalty and doubled as more are held at once: ~164 MB for 256 such requests.

Row 0 is a sink: a request without penalties, in a batch where others have them, reads and
writes it. Its penalty factors are neutral (repetition 1, presence and frequency 0), under which
`apply_penalties` leaves its logits bitwise unchanged whatever the counts hold.
"""
from __future__ import annotations

import torch
from torch import Tensor

from engine.host_copy import list_to_device

SINK = 0


class PenaltyRows:
    def __init__(self, vocab_size: int, device: torch.device | str, capacity: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=self.device)
        self.free = list(range(capacity - 1, SINK, -1))

    def add(self, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A new row for a request with these prompt ids and this output so far (ids < V)."""
        if not self.free:
            self._grow()
        row = self.free.pop()
        self.counts[row].zero_()
        self.prompt_seen[row].zero_()
        if prompt_ids:      # index_fill_ takes the value as a kernel argument: no host tensor to copy
            self.prompt_seen[row].index_fill_(0, list_to_device(prompt_ids, torch.int64, self.device), True)
        if output_ids:
            ids = list_to_device(output_ids, torch.int64, self.device)
            self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return row

    def remove(self, row: int) -> None:
        """The row goes back to the pool. The device may still have this row's last `record`
        queued; a later `add` zeroes the row after it, in stream order."""
        if row != SINK:
            self.free.append(row)

    def rows_for(self, rows: list[int], prompts: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
        """The batch's output counts [B, V] int32, prompt ids seen [B, V] bool (None with
        prompts=False: no row has a repetition penalty, the only reader) and the rows' index
        tensor for `record`."""
        index = list_to_device(rows, torch.int64, self.device)
        return self.counts[index], self.prompt_seen[index] if prompts else None, index

    def record(self, index: Tensor, sampled: Tensor) -> None:
        """Count each row's sampled token: counts[index[i], sampled[i]] += 1, on the device."""
        self.counts.index_put_((index, sampled.to(torch.int64)),
                               torch.ones(index.shape, dtype=torch.int32, device=self.device), accumulate=True)

    def _grow(self) -> None:
        n = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros_like(self.prompt_seen)])
        self.free = list(range(2 * n - 1, n - 1, -1))
