"""Dense KV cache: preallocated once per batch, handed to layers as per-layer views."""

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


class KVCache:
    """K/V for every layer of a batch, sized for the longest sequence it will hold."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        # Zeroed: masked slots get probability 0, and 0 * (uninitialised NaN) would be NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, i: int) -> KVView:
        return KVView(self.k[i], self.v[i])

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished sequences so later steps compute only the live ones."""
        self.k = self.k[:, rows]
        self.v = self.v[:, rows]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
