"""The view of one layer's dense KV cache that a layer receives; the executor owns the storage."""

from __future__ import annotations

import torch

from tiergen.engine.step import StepMeta
from tiergen.models.layers import attention


class KVView:
    """One layer's K and V buffers (B, KVH, capacity, D); the layer appends and reads.

    Attention runs where the buffers are: a view over host RAM (``cpu_attention``) takes
    q, k, v there and hands the output back, so the cache never crosses the link.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = k
        self.v = v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """Append this step's k, v (B, KVH, T, D) and attend q (B, H, T, D) over the cache."""
        where = q.device
        if self.k.device != where:
            q, k, v, meta = q.to(self.k.device), k.to(self.k.device), v.to(self.k.device), meta.to(self.k.device)
        k_all, v_all = self.update(k, v, meta)
        return attention(q, k_all, v_all, meta).to(where)

    def update(self, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, KVH, T, D) and return what the step attends to: its own
        k, v when it starts the sequence, else the whole buffer (see StepMeta)."""
        self.k[:, :, meta.start:meta.end] = k
        self.v[:, :, meta.start:meta.end] = v
        if meta.start == 0:
            return k, v
        return self.k, self.v
