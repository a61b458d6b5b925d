"""The view of one layer's dense KV cache that a layer receives; the executor owns the storage."""

from __future__ import annotations

import torch

from tiergen.engine.step import StepMeta


class KVView:
    """One layer's K and V buffers (B, KVH, capacity, D); the layer appends and reads."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k
        self.v = v

    def update(self, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, KVH, T, D) and return what the step attends to: its own
        k, v when it starts the sequence, else the whole buffer (see StepMeta)."""
        self.k[:, :, meta.start:meta.end] = k
        self.v[:, :, meta.start:meta.end] = v
        if meta.start == 0:
            return k, v
        return self.k, self.v
