"""A pipeline stage's share of a model: a span of consecutive layers, plus the embeddings
where the span begins the model and the final norm and LM head where it ends it."""

from __future__ import annotations

import torch

from tiergen.errors import TiergenError
from tiergen.models.base import ModelFamily, Weights

EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def layer_costs(model: ModelFamily) -> tuple[list[float], float]:
    """Multiply-adds per token of each layer (routed experts at the share a token uses)
    and of the LM head: what a stage's share of the work is measured in."""
    cfg = model.cfg
    share = cfg.moe.top_k / cfg.moe.num_experts if cfg.moe else 1.0
    costs = [float(sum(torch.Size(s).numel() * (share if n.startswith("experts.") else 1.0)
                       for n, s in model.fused_specs(j).items() if len(s) > 1))
             for j in range(cfg.num_layers)]
    return costs, float(cfg.vocab_size * cfg.hidden_size)


def split_layers(costs: list[float], stages: int, head: float = 0.0) -> list[range]:
    """Consecutive spans of layers, at least one each, that make the costliest stage (the
    last also runs the LM head, of cost ``head``) as cheap as possible."""
    n = len(costs)
    if not isinstance(stages, int) or not 1 <= stages <= n:
        raise TiergenError(f"pipeline_parallel must be an integer from 1 to the model's "
                           f"{n} layers, got {stages!r}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the least possible cost of the costliest of s stages over layers 0..i-1
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        extra = head if s == stages else 0.0
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j] + (extra if i == n else 0.0))
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    ends = [n]
    for s in range(stages, 1, -1):
        ends.append(cut[s][ends[-1]])
    ends.reverse()
    return [range(a, b) for a, b in zip([0] + ends[:-1], ends)]


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

    def fuse_globals(self, raw: Weights) -> Weights:
        missing = {n: torch.empty(0) for n in self.model.global_specs() if n not in raw}
        return self.model.fuse_globals({**raw, **missing})

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        return self.model.layer_specs(self.layers[i])

    def fused_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        return self.model.fused_specs(self.layers[i])

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        return self.model.fuse_layer(self.layers[i], raw)

    def prepare(self, meta, dtype: torch.dtype) -> object:
        return self.model.prepare(meta, dtype)

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(w, ids)

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta, cache, shared) -> torch.Tensor:
        return self.model.layer(self.layers[i], w, h, meta, cache, shared)

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return self.model.head(w, h)
