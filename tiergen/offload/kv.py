"""KV cache of one micro-batch, each layer's part on the tier the policy gives it."""

from __future__ import annotations

import copy
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from tiergen.cache.kv import KVView, LatentKVView, RollingKVView, StateView
from tiergen.config import ModelConfig
from tiergen.cache.step import StepMeta
from tiergen.errors import TiergenError
from tiergen.offload.compress import decompress_rows, compress_rows, compressed_width
from tiergen.offload.disk import SpillFile


def cache_group_size(width: int, group_size: int) -> int:
    """The quantisation group of a cache row of ``width`` numbers: the largest even divisor
    of the width not above ``group_size`` (a head_dim of 64 with groups of 64: one group per
    head per token)."""
    return max(g for g in range(2, min(width, group_size) + 1, 2) if width % g == 0)


def stored_width(cfg: ModelConfig, dtype: torch.dtype, compress: tuple[int, int] | None
                 ) -> tuple[int, torch.dtype]:
    """Numbers (or bytes, compressed) per cached row, and their dtype."""
    width = cfg.kv_layout()[2]
    if compress is None:
        return width, dtype
    bits, group = compress
    return compressed_width(width, bits, cache_group_size(width, group)), torch.uint8


def cache_dtype(cfg: ModelConfig, dtype: torch.dtype, device_type: str, integer: bool
                ) -> torch.dtype:
    """The dtype a KV cache holds: float16 on the integer path on a CPU (``integer``: packed
    weights multiplied with 8-bit activations; float32 compute), whose decode steps at large
    batches read the whole cache each step (half the bytes; the C decode kernels convert as
    they read, and llama.cpp's cache is float16 too), else the compute dtype: the float path
    stays exact. gpt-oss's attention sinks run in torch, which would convert the cache at
    every step: float32 for them."""
    if integer and device_type == "cpu" and dtype == torch.float32 and not cfg.attention_sinks:
        return torch.float16
    return dtype


def layer_slots(capacity: int, window: int | None) -> int:
    """Slots a layer keeps: a sliding-window layer never more than its window."""
    return min(capacity, window) if window else capacity


def state_bytes(cfg: ModelConfig, rows: int) -> int:
    """Bytes of ``rows`` sequences' linear-attention state in one layer (float32)."""
    return rows * cfg.linear.state_numel * 4


def cache_moves(tier: str, device_type: str, compressed: bool, cpu_attention: bool,
                prompt: bool = False) -> bool:
    """Whether a layer's cache on ``tier`` is loaded into a device working buffer before use
    and stored back after: from disk, from host RAM behind a GPU (unless a decode step's
    attention runs there, ``cpu_attention``: a prompt step's runs on the device, where its
    hidden states are, and only its new K/V go down), and always when compressed (it is
    decompressed for use)."""
    return compressed or tier == "disk" or (
        tier == "host" and device_type != "cpu" and (prompt or not cpu_attention))


def cache_needs(cfg: ModelConfig, dtype: torch.dtype, tiers: list[str],
                micro_batches: list[tuple[int, int]], device_type: str,
                compress: tuple[int, int] | None = None) -> dict[str, int]:
    """Bytes per tier of the caches of a block of micro-batches given as (rows, capacity)."""
    needs = {"device": 0, "host": 0, "disk": 0}
    parts, heads, width = cfg.kv_layout()
    stored, stored_dtype = stored_width(cfg, dtype, compress)
    states = Counter(t for j, t in enumerate(tiers) if cfg.keeps_state(j))
    # (tier, window): count of the layers with a KV cache
    layers = Counter((t, cfg.window(j)) for j, t in enumerate(tiers) if not cfg.keeps_state(j))
    for rows, capacity in micro_batches:
        slots = {key: layer_slots(capacity, key[1]) for key in layers}
        for (tier, window), count in layers.items():
            needs[tier] += count * parts * rows * heads * slots[tier, window] * stored \
                * stored_dtype.itemsize
        for tier, count in states.items():
            needs[tier] += count * state_bytes(cfg, rows)
        if compress or "disk" in tiers or ("host" in tiers and device_type != "cpu"):
            # working buffers: one for the KV caches, one for the states
            if slots:
                needs["device"] += parts * rows * heads * max(slots.values()) * width \
                    * dtype.itemsize
            if states:
                needs["device"] += state_bytes(cfg, rows)
    return needs


class Recycled:
    """The CPU tensors of closed caches, handed on to new caches (flat storage, cut to the
    shape asked for), so that a new cache needs no zeroing and no fresh pages: for 64 rows
    of a 1,000-token shared prefix that was most of a block's set-up.

    A cache's slots are read only where its rows wrote them or under an attention mask, and a
    mask weighs any finite value exactly 0; a recycled tensor is finite throughout (it began
    as zeros and held K/V since), so it serves as zeros do: the tests of every cache kind,
    shared prefixes and merges gave the same results with new caches filled with 7.25 (with
    NaN, which a mask's 0 does not cancel, they do not). Nothing is kept that a closed cache
    did not hold, a kept tensor serves a request at most 25 % smaller, and a request none can
    serve drops them all."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # flat, by size
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel()
        with self._lock:
            for i, flat in enumerate(self._free):
                if flat.dtype == dtype and n <= flat.numel() <= n + n // 4:  # waste <= 25 %
                    return self._free.pop(i)[:n].view(shape)
            self._free.clear()
        return torch.zeros(n, dtype=dtype).view(shape)

    def give(self, t: torch.Tensor) -> None:
        """Keep ``t``'s memory (all of it: a tensor that is part of another is not kept)."""
        whole = t if t._base is None else t._base
        if (whole.device.type == "cpu" and whole.is_contiguous() and not whole.is_pinned()
                and whole.untyped_storage().nbytes() == whole.nbytes):
            with self._lock:
                self._free.append(whole.view(-1))
                self._free.sort(key=torch.Tensor.numel)


RECYCLED = Recycled()


class _Done:
    """The event of a copy that finished when it was made (a CPU's plain copies)."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


@dataclass
class _Store:
    """A store in flight: ``staged`` (pinned host RAM) holds the new rows once ``event`` has
    passed; they then go to ``dest``. ``source`` must not be overwritten before then."""

    event: object
    staged: torch.Tensor
    dest: torch.Tensor
    source: torch.Tensor


class Stores:
    """New K/V rows going down to their host tier without holding up the compute stream.

    On a GPU each store is copied on its own copy stream into pinned staging, with an
    event; a device buffer it read from is written again only after that event
    (``before_reuse``), and the host rows are read only once it has passed and the staging
    has been copied into place (``settle``). On a CPU a store is a plain copy, done at once:
    the same order with nothing in flight."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: dict[int, list[_Store]] = {}  # by layer
        self._lock = threading.Lock()  # the cache thread stores; close may settle elsewhere

    def put(self, j: int, source: torch.Tensor, dest: torch.Tensor) -> None:
        """Store ``source`` (device) into ``dest`` (a view of layer j's host rows)."""
        if self.stream is None:
            dest.copy_(source)
            with self._lock:
                self.pending.setdefault(j, []).append(_Store(_Done(), dest, dest, source))
            return
        self.stream.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(self.stream):
            staged = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
            staged.copy_(source, non_blocking=True)
            source.record_stream(self.stream)  # its memory kept until the copy has read it
            event = torch.cuda.Event()
            event.record(self.stream)
        with self._lock:
            self.pending.setdefault(j, []).append(_Store(event, staged, dest, source))

    def before_reuse(self, buffer: torch.Tensor) -> None:
        """Hold the next write to ``buffer`` (on the current stream) until every store that
        reads it has been copied out."""
        with self._lock:
            stores = [s for layer in self.pending.values() for s in layer]
        for s in stores:
            if s.source.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                s.event.wait(None if self.stream is None else
                             torch.cuda.current_stream(buffer.device))

    def settle(self, j: int | None = None) -> None:
        """Finish the stores of layer j (all layers: None): its host rows are then whole."""
        with self._lock:
            done = [s for layer in ([j] if j is not None else list(self.pending))
                    for s in self.pending.pop(layer, [])]
        for s in done:
            s.event.synchronize()
            if s.staged is not s.dest:
                s.dest.copy_(s.staged)


class TieredKV:
    """K/V for every layer of one micro-batch, sized for its longest sequence (a
    sliding-window layer: for its window, as a ring).

    Device layers live in device tensors (P, B, KVH, slots, D), P = 2 for K and V or 1 for
    an MLA latent row. Host layers live in host RAM
    and are copied to a device working buffer for use (on a CPU, host is the device: no
    copy), or, with ``cpu_attention``, stay there and attention runs on the CPU. Disk layers
    live in a spill file laid out slot-major (slots, P, B, KVH, D), so that a step writes
    contiguous runs, and are read back into the working buffer before use.
    """

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device, tiers: list[str], spill_dir: Path | None,
                 pin: bool = False, cpu_attention: bool = False,
                 compress: tuple[int, int] | None = None, sparsity: float = 1.0) -> None:
        self.batch = batch
        self.parts, self.heads, self.head_dim = cfg.kv_layout()
        # compressed (bits, group size): every tier holds compressed rows (see
        # compress.compress_rows) and the layer works on a dense buffer, decompressed before use
        # and compressed after
        self.compress = None if compress is None else (
            compress[0], cache_group_size(self.head_dim, compress[1]))
        self.stored_width, self.stored_dtype = stored_width(cfg, dtype, compress)
        self.sparsity = sparsity
        self.latent_rank = cfg.mla.kv_lora_rank if cfg.mla is not None else None
        self.dtype, self.device, self.tiers = dtype, device, tiers
        self.cpu_attention = cpu_attention
        # A linear-attention layer keeps one slot, its state after the last token: a ring of
        # one slot, which every step writes whole (see StateView).
        self.states = [cfg.keeps_state(j) for j in range(len(tiers))]
        if cfg.keeps_states and compress is not None:
            raise TiergenError("compressed KV caches are not supported for models with "
                               "linear-attention layers (their states stay float32); leave "
                               "compress_cache off")
        self.state_numel = cfg.linear.state_numel if cfg.keeps_states else 0
        self.slots = [1 if state else layer_slots(capacity, cfg.window(j))
                      for j, state in enumerate(self.states)]
        # A layer is a ring when its window is shorter than what the batch will hold.
        self.rings = [1 if state else cfg.window(j) if n < capacity else None
                      for j, (n, state) in enumerate(zip(self.slots, self.states))]
        self.layers: list[torch.Tensor | SpillFile] = []
        for j, tier in enumerate(tiers):
            if tier == "disk":
                assert spill_dir is not None
                # a new spill file reads back as zeros: no need to write them
                self.layers.append(SpillFile(spill_dir, self._nbytes(j)))
            elif device.type == "cpu":
                self.layers.append(RECYCLED.take(self.stored_shape(j), self._dtype(j)))
            else:
                host = tier == "host"
                self.layers.append(torch.zeros(self.stored_shape(j), dtype=self._dtype(j),
                                               device="cpu" if host else device,
                                               pin_memory=host and pin))
        self._work: dict[int, torch.Tensor] = {}  # device working buffers by slot count
        self._moves = [cache_moves(t, device.type, self.compress is not None, cpu_attention)
                       for t in tiers]
        self._prompt_moves = [cache_moves(t, device.type, self.compress is not None,
                                          cpu_attention, prompt=True) for t in tiers]
        self.stores = Stores(device)  # new rows on their way to host RAM
        self._resident: dict[int, KVView] = {}  # views of the layers used where they live

    def shape(self, j: int) -> tuple[int, ...]:
        """Layer j's cache as the layer sees it (a state: one slot of its numbers)."""
        if self.states[j]:
            return (1, self.batch, 1, 1, self.state_numel)
        return (self.parts, self.batch, self.heads, self.slots[j], self.head_dim)

    def stored_shape(self, j: int) -> tuple[int, ...]:
        """Layer j's cache as its tier holds it (compressed rows when compressed)."""
        if self.states[j]:
            return self.shape(j)
        return (self.parts, self.batch, self.heads, self.slots[j], self.stored_width)

    def _dtype(self, j: int) -> torch.dtype:
        """What layer j's tier holds: float32 states, the cache dtype (or compressed bytes)."""
        return torch.float32 if self.states[j] else self.stored_dtype

    def _nbytes(self, j: int) -> int:
        return torch.Size(self.stored_shape(j)).numel() * self._dtype(j).itemsize

    def _slot_major(self, j: int, slots: int) -> torch.Tensor:
        """An empty (slots, parts, batch, heads, width) buffer: layer j as a spill file
        lays it out."""
        p, b, h, _, w = self.stored_shape(j)
        return torch.empty((slots, p, b, h, w), dtype=self._dtype(j))

    @property
    def nbytes(self) -> int:
        """Bytes its layers hold, on whichever tier."""
        return sum(self._nbytes(j) for j in range(len(self.layers)))

    def on_disk(self, j: int) -> bool:
        return isinstance(self.layers[j], SpillFile)

    def moves(self, j: int, prompt: bool = False) -> bool:
        """Whether layer j's K/V must travel to and from the device around its use in a
        prompt step or a decode step (see ``cache_moves``)."""
        return (self._prompt_moves if prompt else self._moves)[j]

    def _view(self, j: int, kv: torch.Tensor) -> KVView:
        ring, sparsity = self.rings[j], self.sparsity
        if self.states[j]:
            return StateView(kv)
        if self.latent_rank is not None:
            return LatentKVView(kv, self.latent_rank, sparsity)
        return KVView(kv, sparsity) if ring is None else RollingKVView(kv, ring, sparsity)

    def _working(self, j: int) -> torch.Tensor:
        key = self.shape(j)
        if key not in self._work:
            dtype = torch.float32 if self.states[j] else self.dtype
            self._work[key] = torch.zeros(key, dtype=dtype, device=self.device)
        return self._work[key]

    @torch.inference_mode()  # on the compute thread or the cache thread alike
    def load(self, j: int, end: int, prompt: bool = False) -> KVView:
        """Layer j's K/V on the device, holding the slots before ``end`` (the step's new
        slots are written by the layer itself), for a prompt step or a decode step."""
        store = self.layers[j]
        used = min(end, self.slots[j])  # a ring fills indices 0.. in order, then wraps
        self.stores.settle(j)  # its host rows whole before they are read
        if not self.moves(j, prompt):
            view = self._resident.get(j)
            if view is None:
                view = self._resident[j] = self._view(j, store)
            return view
        work = self._working(j)
        self.stores.before_reuse(work)
        if not used:
            return self._view(j, work)
        if isinstance(store, SpillFile):
            slots = self._slot_major(j, used)
            store.read_into(slots)
            rows = slots.permute(1, 2, 3, 0, 4).to(self.device)
        else:
            rows = store[:, :, :, :used].to(self.device, non_blocking=True)
        if self.compress:
            bits, group = self.compress
            rows = decompress_rows(rows, self.head_dim, bits, group, self.dtype)
        work[:, :, :, :used].copy_(rows)
        return self._view(j, work)

    def _runs(self, j: int, meta: StepMeta) -> list[tuple[int, int]]:
        """Buffer index ranges [lo, hi) that this step wrote in layer j."""
        ring = self.rings[j]
        if ring is None:
            return [(meta.start, meta.end)]
        first = max(meta.start, meta.end - ring)
        lo, hi = first % ring, (meta.end - 1) % ring + 1
        return [(lo, hi)] if lo < hi else [(lo, ring), (0, hi)]

    @torch.inference_mode()
    def store(self, j: int, view: KVView, meta: StepMeta) -> None:
        """Write the step's new slots back to layer j's tier (to host RAM: asynchronously,
        see ``Stores``)."""
        store = self.layers[j]
        prompt = meta.start == 0 or meta.positions.shape[1] > 1
        for lo, hi in self._runs(j, meta):
            new = view.kv[:, :, :, lo:hi]
            if self.compress:
                new = compress_rows(new, *self.compress)
            if isinstance(store, SpillFile):
                store.write(new.permute(3, 0, 1, 2, 4).cpu(), lo * self._nbytes(j) // self.slots[j])
            elif self.moves(j, prompt):
                self.stores.put(j, new, store[:, :, :, lo:hi])

    def read_layer(self, j: int) -> torch.Tensor:
        """Layer j as its tier holds it (stored shape; compressed rows when compressed)."""
        self.stores.settle(j)
        store = self.layers[j]
        if not isinstance(store, SpillFile):
            return store
        full = self._slot_major(j, self.slots[j])
        store.read_into(full)
        return full.permute(1, 2, 3, 0, 4)

    def write_layer(self, j: int, stored: torch.Tensor) -> None:
        """Replace layer j with ``stored`` (stored shape, this cache's batch and slots)."""
        store = self.layers[j]
        if isinstance(store, SpillFile):
            store.write(stored.permute(3, 0, 1, 2, 4).contiguous().cpu())
        else:
            self.layers[j] = stored.to(store.device)
            self._resident.pop(j, None)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished sequences (rows of the batch) on every tier."""
        for j in range(len(self.layers)):
            stored = self.read_layer(j)
            self.write_layer(j, stored[:, rows.to(stored.device)])
        self.batch = len(rows)
        self._work = {}

    def absorb(self, parts: list[tuple[TieredKV, int]]) -> None:
        """Fill this (new, empty) cache with other caches' rows, one after another along the
        batch, each shifted ``later`` slots along the timeline: timeline slot s of a part
        becomes s + later here, which a ring (slot s at index s % W) turns into a roll."""
        for j in range(len(self.layers)):
            olds = [cache.read_layer(j) for cache, _ in parts]  # all on this layer's tier
            merged = torch.zeros(self.stored_shape(j), dtype=self._dtype(j),
                                 device=olds[0].device)
            row = 0
            for (cache, later), old in zip(parts, olds):
                index = torch.arange(old.shape[3], device=old.device) + later
                if self.rings[j] is not None:
                    index %= self.slots[j]
                merged[:, row:row + cache.batch, :, index] = old
                row += cache.batch
            self.write_layer(j, merged)
        self._work = {}

    def spilled(self, spill_dir: Path) -> TieredKV:
        """A copy of this cache with every layer in a spill file under ``spill_dir``, to read
        rows back from (:meth:`read_layer`)."""
        self.stores.settle()
        other = copy.copy(self)
        other.layers = []
        try:
            for j in range(len(self.layers)):
                other.layers.append(SpillFile(spill_dir, self._nbytes(j)))
                other.write_layer(j, self.read_layer(j))
        except BaseException:
            other.close()
            raise
        other.tiers = ["disk"] * len(self.layers)
        other._moves, other._work, other._resident = [True] * len(self.layers), {}, {}
        other._prompt_moves, other.stores = other._moves, Stores(self.device)
        return other

    def share_prefix(self, src: TieredKV, slots: int) -> None:
        """Copy timeline slots [0, ``slots``) of ``src``'s single row into every row of this
        (new, empty) cache: a shared prompt prefix computed once. A ring layer holds slot s at
        index s % W in both, so the same indices copy."""
        for j in range(len(self.layers)):
            n = min(slots, src.slots[j])
            stored = self.read_layer(j)
            stored[:, :, :, :n] = src.read_layer(j)[:, :1, :, :n].to(stored.device)
            self.write_layer(j, stored)
        self._work = {}

    def close(self) -> None:
        self.stores.settle()
        for store in self.layers:
            if isinstance(store, SpillFile):
                store.close()
            elif self.device.type == "cpu":
                RECYCLED.give(store)
        self.layers, self._resident, self._work = [], {}, {}
