"""KV cache of one micro-batch, each layer's part on the tier the policy gives it."""

from __future__ import annotations

from pathlib import Path

import torch

from tiergen.cache.kv import KVView
from tiergen.config import ModelConfig
from tiergen.engine.step import StepMeta
from tiergen.offload.disk import SpillFile


def cache_needs(cfg: ModelConfig, dtype: torch.dtype, tiers: list[str],
                micro_batches: list[tuple[int, int]], device_type: str) -> dict[str, int]:
    """Bytes per tier of the caches of a block of micro-batches given as (rows, capacity)."""
    needs = {"device": 0, "host": 0, "disk": 0}
    for rows, capacity in micro_batches:
        layer = 2 * rows * cfg.num_kv_heads * capacity * cfg.head_dim * dtype.itemsize
        for tier in tiers:
            needs[tier] += layer
        if "disk" in tiers or ("host" in tiers and device_type != "cpu"):
            needs["device"] += layer  # working buffer
    return needs


class TieredKV:
    """K/V for every layer of one micro-batch, sized for its longest sequence.

    Device layers live in device tensors (B, KVH, C, D). Host layers live in host RAM and are
    copied to a device working buffer for use (on a CPU, host is the device: no copy), or,
    with ``cpu_attention``, stay there and attention runs on the CPU. Disk
    layers live in a spill file laid out slot-major (C, 2, B, KVH, D), so that a step appends
    one contiguous range, and are read back into the working buffer before use.
    """

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device, tiers: list[str], spill_dir: Path | None,
                 pin: bool = False, cpu_attention: bool = False) -> None:
        self.shape = (2, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.dtype, self.device, self.tiers = dtype, device, tiers
        self.cpu_attention = cpu_attention
        self.layers: list[torch.Tensor | SpillFile] = []
        for tier in tiers:
            if tier == "disk":
                assert spill_dir is not None
                f = SpillFile(spill_dir, self.numel * dtype.itemsize)
                f.write(torch.zeros(self.shape, dtype=dtype))
                self.layers.append(f)
            else:
                host = tier == "host" and device.type != "cpu"
                self.layers.append(torch.zeros(self.shape, dtype=dtype,
                                               device="cpu" if host else device,
                                               pin_memory=host and pin))
        self._work: torch.Tensor | None = None

    def moves(self, j: int) -> bool:
        """Whether layer j's K/V must travel to and from the device around its use."""
        store = self.layers[j]
        if isinstance(store, SpillFile):
            return True
        return store.device != self.device and not self.cpu_attention

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()

    def _working(self) -> torch.Tensor:
        if self._work is None:
            self._work = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self._work

    def load(self, j: int, end: int) -> KVView:
        """Layer j's K/V on the device, valid up to slot ``end`` (the step's new slots are
        written by the layer itself)."""
        store = self.layers[j]
        if isinstance(store, SpillFile):
            work = self._working()
            if end:
                slots = torch.empty((end,) + self.shape[:3] + self.shape[4:], dtype=self.dtype)
                store.read_into(slots)
                work[:, :, :, :end] = slots.permute(1, 2, 3, 0, 4).to(self.device)
            return KVView(work[0], work[1])
        if self.moves(j):
            work = self._working()
            work[:, :, :, :end].copy_(store[:, :, :, :end], non_blocking=True)
            return KVView(work[0], work[1])
        return KVView(store[0], store[1])

    def store(self, j: int, view: KVView, meta: StepMeta) -> None:
        """Write the step's new slots back to layer j's tier."""
        store = self.layers[j]
        new = torch.stack([view.k[:, :, meta.start:meta.end], view.v[:, :, meta.start:meta.end]])
        if isinstance(store, SpillFile):
            slot_bytes = self.numel // self.shape[3] * self.dtype.itemsize
            store.write(new.permute(3, 0, 1, 2, 4).cpu(), meta.start * slot_bytes)
        elif self.moves(j):
            store[:, :, :, meta.start:meta.end].copy_(new)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished sequences (rows of the batch) on every tier."""
        old_shape = self.shape
        self.shape = (2, len(rows)) + old_shape[2:]
        for j, store in enumerate(self.layers):
            if isinstance(store, SpillFile):
                full = torch.empty((old_shape[3], 2) + old_shape[1:3] + old_shape[4:], dtype=self.dtype)
                store.read_into(full)
                store.write(full[:, :, rows.cpu()].contiguous())
            else:
                self.layers[j] = store[:, rows.to(store.device)]
        self._work = None

    def close(self) -> None:
        for store in self.layers:
            if isinstance(store, SpillFile):
                store.close()
