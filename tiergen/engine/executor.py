"""The executor: the one place that decides where weights live and runs the layers.

All weights are resident on the compute device here; the offloading policies replace how
layer weights are fetched, not this loop.
"""

from __future__ import annotations

import torch

from tiergen.cache.kv import KVCache
from tiergen.engine.step import StepMeta
from tiergen.errors import TiergenError
from tiergen.models.base import ModelFamily, Weights
from tiergen.weights import WeightSource


def load_tensors(source: WeightSource, specs: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device) -> Weights:
    """Read the named tensors, check their shapes, and convert them for the compute device."""
    out = {}
    for name, shape in specs.items():
        t = source.get(name)
        if tuple(t.shape) != shape:
            raise TiergenError(f"tensor {name!r} has shape {tuple(t.shape)} but the model config "
                               f"implies {shape}; the checkpoint does not match its config")
        out[name] = t.to(device=device, dtype=dtype)
    return out


class Executor:
    def __init__(self, model: ModelFamily, source: WeightSource, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.cfg = model.cfg
        self.dtype = dtype
        self.device = device
        self.globals = model.pack_globals(load_tensors(source, model.global_specs(), dtype, device))
        self.layers = [model.pack_layer(i, load_tensors(source, model.layer_specs(i), dtype, device))
                       for i in range(self.cfg.num_layers)]

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, batch, c.num_kv_heads, capacity, c.head_dim, self.dtype,
                       self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, meta: StepMeta, cache: KVCache) -> torch.Tensor:
        """Run tokens (B, T) through the model; return float32 logits of the last position (B, V)."""
        shared = self.model.prepare(meta, self.dtype)
        h = self.model.embed(self.globals, ids)
        for i, w in enumerate(self.layers):
            h = self.model.layer(i, w, h, meta, cache.layer(i), shared)
        return self.model.head(self.globals, h[:, -1]).float()
