"""Hidden states of the micro-batches of a block between layers, on the tier the policy gives."""

from __future__ import annotations

from pathlib import Path

import torch

from tiergen.offload.disk import SpillFile


class HiddenStates:
    """One slot per micro-batch: ``put`` parks a hidden state on its tier, ``take`` brings it
    back to the device and empties the slot."""

    def __init__(self, tiers: list[str], device: torch.device, spill_dir: Path | None) -> None:
        self.tiers, self.device, self.spill_dir = tiers, device, spill_dir
        self._slots: list[object] = [None] * len(tiers)
        self._files: dict[int, SpillFile] = {}

    def put(self, k: int, h: torch.Tensor) -> None:
        assert self._slots[k] is None, f"hidden-state slot {k} stored twice"
        tier = self.tiers[k]
        if tier == "disk":
            f = self._files.get(k)
            if f is None or f.nbytes < h.nbytes:
                if f is not None:
                    f.close()
                f = self._files[k] = SpillFile(self.spill_dir, h.nbytes)
            f.write(h)
            self._slots[k] = (h.shape, h.dtype)
        elif tier == "host":
            self._slots[k] = h.to("cpu", non_blocking=True)
        else:
            self._slots[k] = h

    def take(self, k: int) -> torch.Tensor:
        value, self._slots[k] = self._slots[k], None
        assert value is not None, f"hidden-state slot {k} is empty"
        if self.tiers[k] == "disk":
            shape, dtype = value
            value = self._files[k].read_into(torch.empty(shape, dtype=dtype))
        return value.to(self.device, non_blocking=True)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
