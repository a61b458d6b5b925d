"""A pipeline stage's share of a model: a span of consecutive layers, plus the embeddings
where the span begins the model and the final norm and LM head where it ends it."""

from __future__ import annotations

import torch

from tiergen.errors import TiergenError
from tiergen.models.base import ModelFamily, Weights

EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def split_layers(num_layers: int, stages: int) -> list[range]:
    """Consecutive spans of layers, as even as the count allows (earlier stages, which also
    embed, get the smaller ones)."""
    if not isinstance(stages, int) or not 1 <= stages <= num_layers:
        raise TiergenError(f"pipeline_parallel must be an integer from 1 to the model's "
                           f"{num_layers} layers, got {stages!r}")
    base, extra = divmod(num_layers, stages)
    sizes = [base + (s >= stages - extra) for s in range(stages)]
    starts = [sum(sizes[:s]) for s in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


class Stage:
    """Layers ``layers`` of ``model``, numbered from 0 as the executor sees them; the
    checkpoint names and per-layer behaviour stay those of the whole model."""

    def __init__(self, model: ModelFamily, layers: range) -> None:
        self.model, self.layers = model, layers
        self.cfg = model.cfg.span(layers)
        self.first = layers.start == 0
        self.last = layers.stop == model.cfg.num_layers

    def global_specs(self) -> dict[str, tuple[int, ...]]:
        """Only the globals this stage uses: embeddings to begin, norm and head to end."""
        tied = self.model.cfg.tie_word_embeddings
        keep = {NORM} | ({EMBED} if self.first or (self.last and tied) else set()) \
            | ({LM_HEAD} if self.last else set())
        return {n: s for n, s in self.model.global_specs().items() if n in keep}

    def pack_globals(self, raw: Weights) -> Weights:
        missing = {n: torch.empty(0) for n in self.model.global_specs() if n not in raw}
        return self.model.pack_globals({**raw, **missing})

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        return self.model.layer_specs(self.layers[i])

    def packed_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        return self.model.packed_specs(self.layers[i])

    def pack_layer(self, i: int, raw: Weights) -> Weights:
        return self.model.pack_layer(self.layers[i], raw)

    def prepare(self, meta, dtype: torch.dtype) -> object:
        return self.model.prepare(meta, dtype)

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(w, ids)

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta, cache, shared) -> torch.Tensor:
        return self.model.layer(self.layers[i], w, h, meta, cache, shared)

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return self.model.head(w, h)
