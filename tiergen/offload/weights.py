"""Layer weights spread over device, host RAM and disk, brought to the device ahead of use."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from tiergen import kernels
from tiergen.errors import TiergenError
from tiergen.paths import cache_dir
from tiergen.models.base import ModelFamily, Weights
from tiergen.models.moe import Experts
from tiergen.offload.compress import Compressed, decompress, compress, compressed_nbytes
from tiergen.offload.disk import CheckpointWeights, OffloadedWeights, Segments, open_store
from tiergen.offload.experts import (NAMES as EXPERT_NAMES, ExpertCache, HostRates,
                                     OffloadedExperts, is_expert)
from tiergen.offload.policy import Policy, tier_at
from tiergen.weights import WeightSource
from tiergen.weights.packed import Packed, Parts, cat_rows, packed_nbytes

Specs = dict[str, tuple[int, ...]]


def load_tensors(source: WeightSource, specs: Specs, dtype: torch.dtype, device: torch.device | str) -> Weights:
    """Read the named tensors, check their shapes, and convert them (packed matrices stay
    packed: they only move)."""
    out = {}
    for name, shape in specs.items():
        t = source.get(name)
        if tuple(t.shape) != shape:
            raise TiergenError(f"tensor {name!r} has shape {tuple(t.shape)} but the model config "
                               f"implies {shape}; the checkpoint does not match its config")
        out[name] = t.to(device) if isinstance(t, Packed) else t.to(device=device, dtype=dtype)
    return out


def meta_tensors(source: WeightSource, specs: Specs, dtype: torch.dtype) -> Weights:
    """The tensors :func:`load_tensors` would give, as layouts without data (meta device)."""
    return {n: source.meta(n) or torch.empty(s, dtype=dtype, device="meta")
            for n, s in specs.items()}


def packed_layouts(packed: Weights) -> dict[str, Parts]:
    return {n: t.parts for n, t in packed.items() if isinstance(t, Packed)}


def place(sizes: dict[str, int], split: tuple[float, float, float]) -> dict[str, str]:
    """Give each tensor of a layer a tier so that the tiers hold about ``split`` percent of
    the layer's bytes: a tensor goes where the middle of its byte range falls."""
    total = sum(sizes.values()) or 1
    tiers, done = {}, 0
    for name, size in sizes.items():
        tiers[name] = tier_at(100 * (done + size / 2) / total, split)
        done += size
    return tiers


def offload_root(policy: Policy) -> Path:
    """Where converted weights and spill files go: the policy's offload_dir, or else
    the cache directory's offload/ (see :func:`tiergen.paths.cache_dir`)."""
    if policy.offload_dir:
        return Path(policy.offload_dir)
    return cache_dir() / "offload"


@dataclass
class WeightPlan:
    """Which tier each fused tensor of each layer goes to, and the bytes that makes per tier.

    Routed experts (MoE) are not streamed with their layer: off the device they stay where
    they are and the layer asks for the experts it routes to (:mod:`tiergen.offload.experts`).
    """

    shapes: list[Specs]  # fused tensor shapes of each layer
    tiers: list[dict[str, str]]
    itemsize: int
    global_bytes: int
    device_type: str
    compress: tuple[int, int] | None = None  # (bits, group size) of compressed matrices
    blocks: list[dict[str, Parts]] = field(default_factory=list)  # matrices kept in GGML blocks
    expert_cache: int = 0  # host bytes keeping routed experts read from disk (ExpertCache)

    @classmethod
    def make(cls, model: ModelFamily, dtype: torch.dtype, policy: Policy,
             device: torch.device, source: WeightSource | None = None) -> WeightPlan:
        layers = range(model.cfg.num_layers)
        shapes = [model.fused_specs(j) for j in layers]
        compress = (policy.compress_bits, policy.compress_group_size) if policy.compress_weights else None
        blocks = [packed_layouts(model.fuse_layer(j, meta_tensors(source, model.layer_specs(j), dtype)))
                  if source is not None else {} for j in layers]
        plan = cls(shapes, [], dtype.itemsize, 0, device.type, compress, blocks)
        for j, layer in enumerate(shapes):
            sizes = {n: plan.nbytes(j, n) for n in layer}
            pinned = {n: policy.experts for n in sizes if policy.experts and is_expert(n)}
            placed = place({n: b for n, b in sizes.items() if n not in pinned}, policy.weight_split)
            plan.tiers.append({n: pinned.get(n) or placed[n] for n in layer})
        specs = model.global_specs()
        raw = meta_tensors(source, specs, dtype) if source is not None else {}
        plan.global_bytes = sum(raw[n].nbytes if isinstance(raw.get(n), Packed) else
                                torch.Size(s).numel() * dtype.itemsize for n, s in specs.items())
        return plan

    def __post_init__(self) -> None:
        self.blocks = self.blocks or [{} for _ in self.shapes]

    def packed(self, j: int, name: str) -> bool:
        """Whether layer j's tensor is kept in the checkpoint's quantised blocks."""
        return name in self.blocks[j]

    def compressed(self, j: int, name: str) -> bool:
        """Whether layer j's tensor is stored quantised: the matrices of a layer (norms and
        biases stay as they are; routed experts too, as they are read an expert at a time)."""
        shape = self.shapes[j][name]
        return (self.compress is not None and len(shape) == 2 and not is_expert(name)
                and shape[-1] % self.compress[1] == 0 and not self.packed(j, name))

    def dense_bytes(self, j: int, name: str) -> int:
        return torch.Size(self.shapes[j][name]).numel() * self.itemsize

    def nbytes(self, j: int, name: str) -> int:
        """Bytes of a tensor as stored (packed or quantised, if it is)."""
        if self.packed(j, name):
            return packed_nbytes(self.shapes[j][name], self.blocks[j][name])
        if self.compressed(j, name):
            return compressed_nbytes(self.shapes[j][name], *self.compress)
        return self.dense_bytes(j, name)

    def stored_spec(self, j: int, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        """Shape and dtype of a tensor as stored: itself (dtype None: the compute dtype), or,
        compressed, one flat uint8 piece (codes, scales, minima: Compressed.to_bytes), or
        packed, its blocks as one flat uint8 piece (routed experts: a row per expert)."""
        if not self.compressed(j, name) and not self.packed(j, name):
            return self.shapes[j][name], None
        if is_expert(name):  # packed experts: a row of bytes per expert, read one by one
            experts = self.shapes[j][name][0]
            return (experts, self.nbytes(j, name) // experts), torch.uint8
        return (self.nbytes(j, name),), torch.uint8

    def layer_bytes(self, j: int, tier: str, experts: bool | None = None) -> int:
        """Bytes of layer j on a tier (only routed experts, or only the rest, if asked)."""
        return sum(self.nbytes(j, n) for n, t in self.tiers[j].items()
                   if t == tier and (experts is None or is_expert(n) == experts))

    def buffer_shapes(self, tier: str, experts: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
        """Shapes (and dtypes) of the reusable buffers for one layer's stored tensors on
        ``tier`` (the union over layers: layers may differ, e.g. dense and MoE layers; a
        packed matrix's blocks take the most bytes any layer's do, as a Q4_K_M file mixes
        block types from layer to layer)."""
        out: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
        for j in range(len(self.shapes)):
            for n, t in self.tiers[j].items():
                if t == tier and is_expert(n) == experts:
                    spec = self.stored_spec(j, n)
                    if n not in out or torch.Size(spec[0]).numel() > torch.Size(out[n][0]).numel():
                        out[n] = spec
        return out

    def size_expert_cache(self, policy: Policy, host_budget: int | None) -> None:
        """Set :attr:`expert_cache` for routed experts on disk: the policy's bytes, else half
        of what ``host_budget`` leaves after the weights (none without a budget)."""
        if not any(t == "disk" and is_expert(n) for layer in self.tiers for n, t in layer.items()):
            return
        if policy.expert_cache is not None:
            self.expert_cache = policy.expert_cache
        elif host_budget is not None:
            self.expert_cache = self.host_left(host_budget) // 2

    def host_left(self, host_budget: int) -> int:
        """What ``host_budget`` leaves after the weights in host RAM (the device's too when
        the device is the CPU) and the expert cache (0 when they take it all)."""
        needs = self.needs()
        used = needs["host"] + (needs["device"] if self.device_type == "cpu" else 0)
        return max(0, host_budget - used - self.expert_cache)

    def needs(self) -> dict[str, int]:
        """Bytes per tier: placed weights plus the buffers that stream the rest."""
        layers = range(len(self.shapes))
        total = {t: sum(self.layer_bytes(j, t) for j in layers) for t in ("device", "host", "disk")}

        def size(specs: dict) -> int:
            return sum(torch.Size(s).numel() * (d.itemsize if d else self.itemsize)
                       for s, d in specs.values())

        # compressed matrices are decompressed into one dense set for the layer in use; packed
        # ones, multiplied by many rows, are decoded one at a time into one buffer (a
        # routed expert at a time)
        device = total["device"] + self.global_bytes + max(
            (sum(self.dense_bytes(j, n) for n in self.shapes[j] if self.compressed(j, n))
             for j in layers), default=0) + max(
            (self.dense_bytes(j, n) // (self.shapes[j][n][0] if is_expert(n) else 1)
             for j in layers for n in self.blocks[j]), default=0)
        # two buffer sets stream disk layers; one set holds a layer's experts read from disk
        host = total["host"] + 2 * size(self.buffer_shapes("disk", False)) \
            + size(self.buffer_shapes("disk", True)) + self.expert_cache
        if self.device_type == "cuda":  # the layer in use and the one arriving
            device += 2 * max((self.layer_bytes(j, "host", False) + self.layer_bytes(j, "disk", False)
                               for j in layers), default=0)
        return {"device": device, "host": host, "disk": total["disk"]}


@dataclass
class StoredLayers:
    """A model's layers read from its checkpoint in stored form: compressed matrices
    compressed, packed ones their blocks as flat bytes."""

    model: ModelFamily
    source: WeightSource
    dtype: torch.dtype
    plan: WeightPlan

    def _stored(self, j: int, n: str, t: torch.Tensor | Packed) -> torch.Tensor:
        plan = self.plan
        return (t.data.view(plan.stored_spec(j, n)[0]) if isinstance(t, Packed) else
                compress(t, *plan.compress).to_bytes() if plan.compressed(j, n) else t)

    def layer(self, j: int) -> Weights:
        """Layer j's tensors."""
        raw = load_tensors(self.source, self.model.layer_specs(j), self.dtype, "cpu")
        return {n: self._stored(j, n, t) for n, t in self.model.fuse_layer(j, raw).items()}

    def some(self, j: int, names: list[str], runs: dict[str, Segments]) -> Weights:
        """Layer j's tensors ``names``, reading only the checkpoint tensors they are made of
        where each is whole checkpoint tensors one after the other (``runs``: see
        layer_segments; the rest of the layer is read in place)."""
        specs = self.model.layer_specs(j)
        if not all(n in runs and all(first == 0 and count == specs[raw][0]
                                     for raw, first, count in runs[n]) for n in names):
            return {n: t for n, t in self.layer(j).items() if n in names}
        raw = load_tensors(self.source, {r: specs[r] for n in names for r, _, _ in runs[n]},
                           self.dtype, "cpu")
        return {n: self._stored(j, n, cat_rows([raw[r] for r, _, _ in runs[n]])) for n in names}


class TieredWeights:
    """Owns every layer's fused weights on the tier the policy gives each tensor.

    ``prefetch(j)`` starts bringing layer j to the compute device on an I/O thread (disk
    reads into one of two reusable buffer sets, host-to-device copies on a side stream);
    ``take(j)`` waits for it; ``release(j)`` hands the buffers back. Globals (embeddings,
    final norm, LM head) stay on the device.
    """

    def __init__(self, model: ModelFamily, source: WeightSource, dtype: torch.dtype, device: torch.device,
                 policy: Policy, plan: WeightPlan, model_id: str, io_threads: int = 2,
                 expert_rates: HostRates | None = None) -> None:
        self.device, self.dtype, self.policy, self.plan = device, dtype, policy, plan
        cfg = model.cfg
        self.num_layers = cfg.num_layers
        self.tiers = plan.tiers
        self.globals = model.fuse_globals(load_tensors(source, model.global_specs(), dtype, device))
        reader = StoredLayers(model, source, dtype, plan)
        self.disk: OffloadedWeights | CheckpointWeights | None = None
        if any("disk" in layer.values() for layer in self.tiers):
            self.disk = open_store(offload_root(policy), model_id, source, model, dtype,
                                   plan.shapes, plan.blocks, plan.compress, is_expert, reader.some)
        pin = policy.pin_memory and device.type == "cuda"
        self.resident = self._place_resident(reader, pin)
        # what loading read from a mapped file only to make other tensors of goes back
        page_out = getattr(source, "page_out_unused", None)
        if page_out is not None:
            page_out([t for ws in (self.globals, *self.resident) for t in ws.values()])
        # Two buffer sets stream disk tensors; routed experts read from disk share one set.
        self.streamed = [[n for n, t in tiers.items() if t == "disk" and not is_expert(n)]
                         for tiers in self.tiers]
        # layers whose weights compute already reads where they are (routed experts aside)
        self._in_place = [not streamed and (device.type == "cpu" or all(
            t == "device" or is_expert(n) for n, t in tiers.items()))
            for streamed, tiers in zip(self.streamed, self.tiers)]
        self._free: queue.Queue[Weights] = queue.Queue()
        shapes = plan.buffer_shapes("disk", experts=False)
        for _ in range(2 if shapes else 0):
            self._free.put({n: torch.empty(s, dtype=d or dtype, pin_memory=pin)
                            for n, (s, d) in shapes.items()})
        self._expert_buffers = {n: torch.empty(s, dtype=d or dtype, pin_memory=pin)
                                for n, (s, d) in plan.buffer_shapes("disk", experts=True).items()}
        self._dense: dict[str, torch.Tensor] = {}  # where compressed matrices are decompressed
        self._views: dict[int, Weights] = {}  # layers read where they live, as handed out
        self._expert_views: dict[int, tuple[Weights, Weights]] = {}  # see _with_experts
        self._experts: dict[int, Experts] = {}  # the layers' resident experts (_with_experts)
        self.tile_allowance = 0  # bytes of kept tiles still to allow (see allow_tiles)
        self.expert_rates = expert_rates or HostRates()
        self.expert_cache = ExpertCache(plan.expert_cache)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="tiergen-io")
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Slots per layer: filled by prefetch and emptied by take (pending), by the load and
        # by release (buffers, and the copy that must finish before they are reused).
        # a load in flight, or (resident layers) what take returns
        self._pending: dict[int, Future | tuple[Weights, None]] = {}
        self._buffers: dict[int, tuple[Weights, torch.cuda.Event | None]] = {}

    def _place_resident(self, reader: StoredLayers, pin: bool) -> list[Weights]:
        """Each layer's device- and host-tier tensors, on their tier."""
        resident = []
        for j, tiers in enumerate(self.tiers):
            if self.disk is not None:  # read back only what is not on disk
                layer = {n: self.disk.read_into(j, n, torch.empty(*self.disk.shape(j, n)[0],
                                                                  dtype=self.disk.shape(j, n)[1]))
                         for n, tier in tiers.items() if tier != "disk"}
            else:
                layer = reader.layer(j)
            resident.append({n: (t.to(self.device) if tiers[n] == "device" else
                                 t.pin_memory() if pin else t) for n, t in layer.items()})
        return resident

    def in_place(self) -> bool:
        """Whether every layer is read where it lives, the same tensors each step (nothing
        streamed, nothing decompressed into shared buffers)."""
        return self.plan.compress is None and all(self._in_place)

    # -- the schedule's interface --------------------------------------------------------
    def prefetch(self, j: int) -> None:
        if j >= self.num_layers or j in self._pending:
            return
        if self._in_place[j]:
            self._pending[j] = (self.resident[j], None)
        else:
            self._pending[j] = self._pool.submit(self._load, j)

    def take(self, j: int) -> Weights:
        self.prefetch(j)
        pending = self._pending.pop(j)
        weights, event = pending.result() if isinstance(pending, Future) else pending
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for t in weights.values():  # memory copied on the side stream is in use here too
                t.record_stream(compute)
        return self._with_experts(j, self._unpacked(j, weights))

    def _unpacked(self, j: int, stored: Weights) -> Weights:
        """Decompress compressed matrices on the compute device, into one reused buffer set;
        give packed ones their layout (they are multiplied packed)."""
        if self.plan.compress is None and not self.plan.blocks[j]:
            return stored
        if j in self._views:  # a layer read where it lives: the same tensors each step
            return self._views[j]
        weights = dict(stored)
        for n, shape in self.plan.shapes[j].items():
            if is_expert(n):  # see _with_experts
                continue
            if self.plan.packed(j, n):
                weights[n] = Packed(stored[n], shape, self.plan.blocks[j][n])
            elif self.plan.compressed(j, n):
                q = Compressed.from_bytes(stored[n], shape, self.dtype, *self.plan.compress)
                out = self._dense.get(n)
                if out is None or tuple(out.shape) != shape:
                    out = self._dense[n] = torch.empty(shape, dtype=self.dtype, device=self.device)
                weights[n] = decompress(q, out)
        if self.plan.compress is None and self._in_place[j]:  # (compressed: shared buffers)
            self._views[j] = weights
            self.allow_tiles(weights)
        return weights

    def allow_tiles(self, weights: Weights) -> None:
        """Let packed matrices in host RAM that stay where they are (a layer read in place,
        the globals) keep their integer kernels' tiles (:func:`tiergen.kernels.keep_tiles`)
        while ``tile_allowance`` lasts, in the order they come."""
        for t in weights.values():
            if kernels.integer_kernels_take(t) and not t.may_keep_tiles:
                need = kernels.tile_bytes(t)
                if 0 < need <= self.tile_allowance:
                    t.may_keep_tiles = True
                    self.tile_allowance -= need

    def _with_experts(self, j: int, weights: Weights) -> Weights:
        """Hand a MoE layer its routed experts as one object under "experts"."""
        if EXPERT_NAMES[0] not in self.tiers[j]:
            return weights
        weights = {n: t for n, t in weights.items() if not is_expert(n)}
        if j not in self._expert_views:  # (the same tensors at every step: made once)
            resident = {n: self._expert_view(j, n, self.resident[j][n])
                        for n in EXPERT_NAMES if n in self.resident[j]}
            buffers = {n: self._expert_view(j, n, b) for n, b in self._expert_buffers.items()
                       if n in self.tiers[j]}
            self._expert_views[j] = resident, buffers
        resident, buffers = self._expert_views[j]
        if (len(resident) == sum(n in self.tiers[j] for n in EXPERT_NAMES)
                and all(t.device == self.device for t in resident.values())):
            if j not in self._experts:  # (nothing of a step in it: one for every step)
                self._experts[j] = Experts(*(resident.get(n) for n in EXPERT_NAMES))
            weights["experts"] = self._experts[j]
        else:
            weights["experts"] = OffloadedExperts(j, resident, self.disk, buffers,
                                                  self.device, self.expert_rates,
                                                  self.expert_cache, self._pool)
        return weights

    def _expert_view(self, j: int, name: str, stored: torch.Tensor) -> torch.Tensor | Packed:
        """Layer j's stacked expert tensor over its stored form (or over a buffer for it,
        which may be larger: packed layers differ in bytes)."""
        if not self.plan.packed(j, name):
            return stored
        shape, _ = self.plan.stored_spec(j, name)
        data = stored.view(-1)[:torch.Size(shape).numel()]
        return Packed(data, self.plan.shapes[j][name], self.plan.blocks[j][name])

    def release(self, j: int) -> None:
        if j in self._buffers:
            buffers, copied = self._buffers.pop(j)
            if copied is not None:
                copied.synchronize()  # the device copy must have read the buffers
            self._free.put(buffers)

    def _load(self, j: int) -> tuple[Weights, torch.cuda.Event | None]:
        # routed experts stay where they are: the layer asks for the ones it needs
        weights = {n: t for n, t in self.resident[j].items() if not is_expert(n)}
        buffers = None
        if self.streamed[j]:
            buffers = self._free.get()
            try:
                for n in self.streamed[j]:
                    shape, _ = self.plan.stored_spec(j, n)
                    buf = buffers[n]
                    if tuple(buf.shape) != tuple(shape):  # this layer's blocks take fewer bytes
                        buf = buf.view(-1)[:torch.Size(shape).numel()].view(shape)
                    weights[n] = self.disk.read_into(j, n, buf)
            except BaseException:
                self._free.put(buffers)
                raise
        event = None
        if self.device.type == "cuda":
            with torch.cuda.stream(self._copy_stream):
                weights = {n: t.to(self.device, non_blocking=True) for n, t in weights.items()}
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        # On a CPU, host and device are the same memory: the buffers are the weights.
        if buffers is not None:
            assert j not in self._buffers, f"layer {j} loaded twice without release"
            self._buffers[j] = (buffers, event)
        return weights, event

    def abort(self) -> None:
        """After a failed step: wait for loads in flight and take every buffer back."""
        for future in self._pending.values():
            try:
                if isinstance(future, Future):
                    future.result()
            except BaseException:
                pass
        self._pending.clear()
        for j in list(self._buffers):
            self.release(j)
