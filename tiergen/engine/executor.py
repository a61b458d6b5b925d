"""The executor: the one place that decides where tensors live and runs the layers.

Every policy, from everything on the device to everything on disk, goes through the same
block schedule::

    for layer j:                      # weights of j cross the slow link once per block
        take j's weights; start fetching j+1's
        for micro-batch k:
            start loading k+1's cache of layer j
            h[k] = layer j (h[k], cache of k)
            write k's new cache entries back (I/O thread)
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiergen.cache.kv import KVView
from tiergen.engine.step import StepMeta
from tiergen.models.base import ModelFamily
from tiergen.offload.activations import Activations, micro_batch_tiers
from tiergen.offload.kv import TieredKV, layer_tiers
from tiergen.offload.policy import Policy
from tiergen.offload.weights import TieredWeights, default_offload_dir


@dataclass
class MicroBatch:
    """Tokens of one micro-batch for one step, with its step metadata and cache."""

    ids: torch.Tensor  # (b, T)
    meta: StepMeta
    cache: TieredKV


@dataclass
class Timings:
    """Seconds spent computing and waiting for each link, per layer (summed over steps)."""

    compute: list[float] = field(default_factory=list)
    wait_weights: list[float] = field(default_factory=list)
    wait_cache: list[float] = field(default_factory=list)

    def reset(self, num_layers: int) -> None:
        self.compute = [0.0] * num_layers
        self.wait_weights = [0.0] * num_layers
        self.wait_cache = [0.0] * num_layers


class Executor:
    def __init__(self, model: ModelFamily, source, dtype: torch.dtype, device: torch.device,
                 policy: Policy | None = None, model_id: str = "") -> None:
        self.model = model
        self.cfg = model.cfg
        self.dtype = dtype
        self.device = device
        self.policy = policy or Policy()
        self.weights = TieredWeights(model, source, dtype, device, self.policy, model_id)
        self.globals = self.weights.globals
        self.cache_tiers = layer_tiers(self.cfg.num_layers, self.policy.cache_split)
        root = Path(self.policy.offload_dir) if self.policy.offload_dir else default_offload_dir()
        self.spill_dir = root / "spill"
        self._cache_io = ThreadPoolExecutor(1, thread_name_prefix="tiergen-cache")  # FIFO
        self.timings = Timings()
        self.timings.reset(self.cfg.num_layers)

    def new_cache(self, batch: int, capacity: int) -> TieredKV:
        return TieredKV(self.cfg, batch, capacity, self.dtype, self.device, self.cache_tiers,
                        self.spill_dir, self.policy.pin_memory)

    def forward(self, ids: torch.Tensor, meta: StepMeta, cache: TieredKV) -> torch.Tensor:
        """Run one micro-batch (B, T); return float32 logits of the last position (B, V)."""
        return self.forward_block([MicroBatch(ids, meta, cache)])[0]

    @torch.inference_mode()
    def forward_block(self, block: list[MicroBatch]) -> list[torch.Tensor]:
        """Run every micro-batch of a block through all layers, layer by layer."""
        model, t = self.model, self.timings
        acts = Activations(micro_batch_tiers(len(block), self.policy.activation_split),
                           self.device, self.spill_dir)
        shared = [model.prepare(mb.meta, self.dtype) for mb in block]
        for k, mb in enumerate(block):
            acts.put(k, model.embed(self.globals, mb.ids))
        self.weights.prefetch(0)
        stored: list[Future | None] = [None] * len(block)
        try:
            for j in range(self.cfg.num_layers):
                t0 = time.perf_counter()
                w = self.weights.take(j)
                self.weights.prefetch(j + 1)
                t.wait_weights[j] += time.perf_counter() - t0
                loading = self._load_cache(block, 0, j, stored)
                for k, mb in enumerate(block):
                    t0 = time.perf_counter()
                    kv = loading.result()
                    if k + 1 < len(block):
                        loading = self._load_cache(block, k + 1, j, stored)
                    t1 = time.perf_counter()
                    h = model.layer(j, w, acts.take(k), mb.meta, kv, shared[k])
                    acts.put(k, h)
                    if mb.cache.moves(j):
                        stored[k] = self._cache_io.submit(mb.cache.store, j, kv, mb.meta)
                    t.wait_cache[j] += t1 - t0
                    t.compute[j] += time.perf_counter() - t1
                self.weights.release(j)
            for f in stored:
                if f is not None:
                    f.result()
            return [model.head(self.globals, acts.take(k)[:, -1]).float() for k in range(len(block))]
        finally:
            acts.close()

    def _load_cache(self, block: list[MicroBatch], k: int, j: int,
                    stored: list[Future | None]) -> Future[KVView]:
        """Start loading micro-batch k's cache of layer j (after its previous store)."""
        mb = block[k]
        if not mb.cache.moves(j):
            f: Future[KVView] = Future()
            f.set_result(mb.cache.load(j, mb.meta.start))
            return f
        return self._cache_io.submit(mb.cache.load, j, mb.meta.start)
