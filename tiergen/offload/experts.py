"""Routed experts kept off the compute device: in host RAM, or on disk.

A MoE layer asks for experts by id after routing, so an offloaded store can do better than
moving the whole layer: from disk it reads only the experts this step's tokens chose, and for
an expert in host RAM behind a GPU it decides by arithmetic intensity whether to ship the
expert's weights to the device or to run the expert on the CPU where they already are
(few tokens per weight byte: the CPU wins; many: the device).
"""

from __future__ import annotations

import ctypes
import math
from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import torch

from tiergen.calibration import Calibration
from tiergen.config import MoEConfig
from tiergen.kernels.layer import expert_table, set_expert
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

    @classmethod
    def calibrated(cls, host: Calibration | None, gpu: Calibration | None) -> HostRates:
        """Rates from a machine's calibrations (``tiergen calibrate``): its host's fastest
        matmul and memcpy, and its GPU's link from host RAM."""
        return cls.measured(max(host.matmul.values(), default=None) if host else None,
                            host.host_memcpy if host else None,
                            gpu.host_to_device if gpu else None)

    def on_host(self, tokens: int, weight_bytes: int, params: int, hidden: int,
                itemsize: int) -> bool:
        """Whether running an expert (``params`` weights in ``weight_bytes``) on ``tokens``
        tokens is cheaper on the host than moving its weights to the device (device compute
        is taken as free); ``itemsize``: of the hidden states."""
        host = max(weight_bytes / self.host_bandwidth, 2 * params * tokens / self.host_flops)
        host += 2 * tokens * hidden * itemsize / self.link_bandwidth  # hidden states there and back
        return host < weight_bytes / self.link_bandwidth


class ExpertCache:
    """Routed experts read from disk, kept in host RAM for reuse: up to ``capacity`` bytes,
    the least recently used out first. A token's experts recur from step to step (and a
    prompt's tokens share many), so a step often needs no read at all for most of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self.entries: OrderedDict[tuple[int, int], dict[str, torch.Tensor]] = OrderedDict()
        # an entry's expert as its layer multiplies it (OffloadedExperts.weights), made once,
        # and, by layer, the experts the one-token native call finds at hand (moe_row)
        self.views: dict[tuple[int, int], tuple] = {}
        self.tables: dict[int, ctypes.Array] = {}
        self.hits = self.misses = 0

    def get(self, layer: int, expert: int) -> dict[str, torch.Tensor] | None:
        rows = self.entries.get((layer, expert))
        if rows is None:
            self.misses += 1
            return None
        self.entries.move_to_end((layer, expert))
        self.hits += 1
        return rows

    def room(self, layer: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Empty tensors shaped as ``like`` to read an expert of ``layer`` into, making room
        by dropping the least recently used experts of other layers (the layer in use keeps
        its own); None where the capacity does not allow it. A dropped expert's tensors of
        the same shapes are reused: fresh ones would be mapped and faulted in page by page
        (about 1,200 faults for an expert of 4.9 MB) at every read."""
        nbytes = sum(t.nbytes for t in like.values())
        dropped = []
        while self.used + nbytes > self.capacity:
            oldest = next((k for k in self.entries if k[0] != layer), None)
            if oldest is None:
                return None
            dropped.append(self.entries.pop(oldest))
            self._forget(oldest)
            self.used -= sum(t.nbytes for t in dropped[-1].values())
        for rows in dropped:
            if rows.keys() == like.keys() and all(
                    (rows[n].shape, rows[n].dtype) == (t.shape, t.dtype) for n, t in like.items()):
                return rows
        return {n: torch.empty_like(t) for n, t in like.items()}

    def put(self, layer: int, expert: int, rows: dict[str, torch.Tensor]) -> None:
        self.entries[(layer, expert)] = rows
        self.used += sum(t.nbytes for t in rows.values())

    def drop(self, layer: int, expert: int) -> None:
        rows = self.entries.pop((layer, expert), None)
        self._forget((layer, expert))
        if rows is not None:
            self.used -= sum(t.nbytes for t in rows.values())

    def _forget(self, key: tuple[int, int]) -> None:
        self.views.pop(key, None)
        if key[0] in self.tables:
            set_expert(self.tables[key[0]], key[1], None)

    def keep_views(self, layer: int, expert: int, views: tuple) -> None:
        """Expert ``expert`` of ``layer``, in the cache, as its layer multiplies it: kept for
        the next steps, and in the layer's table where the native call takes it."""
        self.views[(layer, expert)] = views
        if layer in self.tables:  # (a layer has a table only without biases: see table)
            set_expert(self.tables[layer], expert, views[:2])

    def table(self, layer: int, experts: int) -> ctypes.Array:
        """Layer ``layer``'s experts whose views are kept, as the native call takes them."""
        if layer not in self.tables:
            self.tables[layer] = expert_table([None] * experts)
            for (j, e), views in self.views.items():
                if j == layer:
                    self.keep_views(j, e, views)
        return self.tables[layer]


class OffloadedExperts(Experts):
    """One layer's routed experts, each of the stacked tensors either in host RAM
    (``resident``) or on disk: read expert by expert into the ``cache``, or where it has no
    room into ``buffers`` (host tensors of full shape owned by the caller and reused layer
    after layer). The reads of a step's experts run at once on ``pool``'s threads (a disk
    serves several requests faster than one after another), where a pool is given."""

    def __init__(self, layer: int, resident: dict[str, torch.Tensor | Packed],
                 disk: OffloadedWeights | None, buffers: dict[str, torch.Tensor | Packed],
                 device: torch.device, rates: HostRates, cache: ExpertCache | None = None,
                 pool: Executor | None = None) -> None:
        self.layer, self.disk, self.device, self.rates = layer, disk, device, rates
        self.cache, self.pool = cache or ExpertCache(0), pool
        self.tensors = {n: resident[n] if n in resident else buffers[n] for n in NAMES
                        if n in resident or n in buffers}
        self.on_disk = [n for n in self.tensors if n not in resident]
        self.rows: dict[int, dict[str, torch.Tensor]] = {}  # this layer's experts read, by id
        self._reading: dict[int, list[Future]] = {}  # experts whose reads are under way
        super().__init__(*(self.tensors.get(n) for n in NAMES))

    def announce(self, ids: torch.Tensor, local: range) -> None:
        if self.on_disk:
            self._start([e - local.start for e in ids.unique().tolist() if e in local])

    def _start(self, ids: list[int]) -> None:
        """Start reading this layer's experts ``ids`` that are neither at hand nor in the
        cache (into the cache where it has room, else into the buffers); :meth:`fetch` waits
        for them."""
        for e in ids:
            if e in self.rows or not self.on_disk:
                continue
            rows = self.cache.get(self.layer, e)
            if rows is None:
                buffers = {n: _raw(self.tensors[n][e]) for n in self.on_disk}
                room = self.cache.room(self.layer, buffers)
                rows = buffers if room is None else room
                if room is not None:  # (taken now, so that the next expert's room counts it)
                    self.cache.put(self.layer, e, rows)
                self._reading[e] = [self._read(e, name, rows[name]) for name in self.on_disk]
            self.rows[e] = rows

    def _read(self, e: int, name: str, out: torch.Tensor) -> Future:
        if self.pool is not None:
            return self.pool.submit(self.disk.read_row, self.layer, name, e, out)
        done: Future = Future()
        done.set_result(self.disk.read_row(self.layer, name, e, out))
        return done

    def fetch(self, ids: list[int]) -> None:
        """Have the chosen experts at hand for this layer (micro-batches of a block share the
        reads): from the cache, else from disk."""
        self._start(ids)
        reading, self._reading = self._reading, {}
        failed = None
        for e, reads in reading.items():
            for read in reads:
                if read.exception() is not None:
                    failed = failed or read.exception()
                    self.cache.drop(self.layer, e)  # not left in the cache half-read
                    self.rows.pop(e, None)
        if failed is not None:
            raise failed

    def weights(self, e: int) -> tuple[torch.Tensor | Packed | None, ...]:
        rows = self.rows.get(e)
        if rows is None:
            return super().weights(e)
        key = (self.layer, e)
        kept = self.cache.entries.get(key) is rows  # (else read into the buffers)
        if kept and key in self.cache.views:
            return self.cache.views[key]
        views = tuple(None if t is None else _view(t, rows[n]) if n in rows else t[e]
                      for n, t in zip(NAMES, (self.gate_up, self.down, self.gate_up_bias,
                                              self.down_bias)))
        if kept:
            self.cache.keep_views(self.layer, e, views)
        return views

    def used(self, ids: list[int]) -> None:
        for e in ids:  # hits, and the most recently used
            self.cache.get(self.layer, e)

    def table(self) -> ctypes.Array | None:
        """The layer's experts in the cache (see :meth:`Experts.table`): those multiplied
        since they were read."""
        if not isinstance(self.gate_up, Packed) or self.biased:
            return None
        return self.cache.table(self.layer, self.gate_up.shape[0])

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


def _raw(row: torch.Tensor | Packed) -> torch.Tensor:
    """The stored form of one expert's tensor (a packed one's bytes)."""
    return row.data if isinstance(row, Packed) else row


def _view(stack: torch.Tensor | Packed, row: torch.Tensor) -> torch.Tensor | Packed:
    """One expert's tensor of ``stack`` over ``row``, its stored form read elsewhere."""
    return Packed(row, stack.shape[1:], stack.parts) if isinstance(stack, Packed) else row
