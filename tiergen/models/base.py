"""What a model family tells the executor: the tensors it needs and how to compute with them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tiergen.cache.kv import KVView
from tiergen.cache.step import StepMeta
from tiergen.config import ModelConfig

Weights = dict[str, torch.Tensor]


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """A family's ``reduce`` in one process. Under tensor parallelism each rank's attention
    and MLP outputs are partial sums that ``reduce`` adds up over the ranks
    (:mod:`tiergen.parallel.shard`)."""
    return x


def causal_lm_global_specs(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors outside the layers of a decoder-only LM: embeddings, final norm, LM head."""
    specs = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
             "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return specs


def fuse_causal_lm_globals(cfg: ModelConfig, raw: Weights) -> Weights:
    """Embeddings, final norm and LM head (the embeddings again when they are tied)."""
    embed = raw["model.embed_tokens.weight"]
    return {"embed": embed, "norm": raw["model.norm.weight"],
            "lm_head": embed if cfg.tie_word_embeddings else raw["lm_head.weight"]}


class ModelFamily(Protocol):
    """A family is stateless apart from its config: weights arrive as arguments."""

    cfg: ModelConfig
    reduce: Callable[[torch.Tensor], torch.Tensor]  # applied to attention and MLP outputs

    def global_specs(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint names and shapes of the tensors outside the layers."""

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        """Checkpoint names and shapes of layer i's tensors."""

    def fused_specs(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of what :meth:`fuse_layer` returns for a layer, for planning
        without loading. Routed experts, if any, are "experts.gate_up" (E, 2I, H) and
        "experts.down" (E, H, I); the executor hands them to the layer as one
        :class:`tiergen.models.moe.Experts` under "experts"."""

    def fuse_globals(self, raw: Weights) -> Weights:
        """Rename/fuse loaded global tensors into the form :meth:`embed`/:meth:`head` use."""

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        """Rename/fuse layer i's loaded tensors into the form :meth:`layer` uses."""

    def prepare(self, meta: StepMeta, dtype: torch.dtype) -> object:
        """Per-step tables shared by all layers (e.g. RoPE cos/sin)."""

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> hidden states (B, T, H)."""

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
              shared: object) -> torch.Tensor:
        """One decoder layer: hidden states in, hidden states out."""

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: (B, T, H) -> logits (B, T, V)."""
