"""Routed experts kept off the compute device: in host RAM, or on disk.

A MoE layer asks for experts by id after routing, so an offloaded store can do better than
moving the whole layer: from disk it reads only the experts this step's tokens chose, and for
an expert in host RAM behind a GPU it decides by arithmetic intensity whether to ship the
expert's weights to the device or to run the expert on the CPU where they already are
(few tokens per weight byte: the CPU wins; many: the device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tiergen.config import MoEConfig
from tiergen.models.moe import Experts, expert_mlp
from tiergen.offload.disk import OffloadedWeights
from tiergen.weights.packed import Packed

# the stacked tensors of a layer's routed experts (the biases where the model has them)
NAMES = ("experts.gate_up", "experts.down", "experts.gate_up_bias", "experts.down_bias")


def is_expert(name: str) -> bool:
    return name in NAMES


@dataclass
class HostRates:
    """What placing an expert's work costs: the host's matmul rate (FLOP/s) and memory
    bandwidth (bytes/s) against the host-to-device link (bytes/s). Calibration
    (``tiergen calibrate``) replaces these defaults with measured values."""

    host_flops: float = 2e11
    host_bandwidth: float = 5e10
    link_bandwidth: float = 2e10

    @classmethod
    def measured(cls, host_flops: float | None, host_bandwidth: float | None,
                 link_bandwidth: float | None) -> HostRates:
        """Rates from a calibration, the defaults standing in for what it lacks."""
        d = cls()
        return cls(host_flops or d.host_flops, host_bandwidth or d.host_bandwidth,
                   link_bandwidth or d.link_bandwidth)

    def on_host(self, tokens: int, weight_bytes: int, params: int, hidden: int,
                itemsize: int) -> bool:
        """Whether running an expert (``params`` weights in ``weight_bytes``) on ``tokens``
        tokens is cheaper on the host than moving its weights to the device (device compute
        is taken as free); ``itemsize``: of the activations."""
        host = max(weight_bytes / self.host_bandwidth, 2 * params * tokens / self.host_flops)
        host += 2 * tokens * hidden * itemsize / self.link_bandwidth  # activations there and back
        return host < weight_bytes / self.link_bandwidth


class OffloadedExperts(Experts):
    """One layer's routed experts, each of the stacked tensors either in host RAM
    (``resident``) or on disk (read row by row into ``buffers``, host tensors of full shape
    owned by the caller and reused layer after layer)."""

    def __init__(self, layer: int, resident: dict[str, torch.Tensor | Packed],
                 disk: OffloadedWeights | None, buffers: dict[str, torch.Tensor | Packed],
                 device: torch.device, rates: HostRates) -> None:
        self.layer, self.disk, self.device, self.rates = layer, disk, device, rates
        self.tensors = {n: resident[n] if n in resident else buffers[n] for n in NAMES
                        if n in resident or n in buffers}
        self.on_disk = [n for n in self.tensors if n not in resident]
        self.loaded: set[int] = set()  # experts of this layer now in the buffers
        super().__init__(*(self.tensors.get(n) for n in NAMES))

    def fetch(self, ids: list[int]) -> None:
        """Read the chosen experts not yet read for this layer (micro-batches of a block
        share the reads)."""
        for e in ids:
            if e not in self.loaded:
                for name in self.on_disk:
                    row = self.tensors[name][e]
                    self.disk.read_row(self.layer, name, e,
                                       row.data if isinstance(row, Packed) else row)
                self.loaded.add(e)

    def mlp(self, e: int, x: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
        weights = self.weights(e)
        gate_up = weights[0]
        if x.device == gate_up.device:
            return expert_mlp(cfg, x, *weights)
        nbytes = sum(t.nbytes for t in weights if t is not None)
        params = sum(math.prod(t.shape) for t in weights if t is not None)
        if self.rates.on_host(x.shape[0], nbytes, params, x.shape[-1], x.element_size()):
            return expert_mlp(cfg, x.to(gate_up.device), *weights).to(x.device)
        return expert_mlp(cfg, x, *(None if t is None else t.to(x.device, non_blocking=True)
                                    for t in weights))
