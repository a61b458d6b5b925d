"""Tensor parallelism: a rank's slice of every layer (some attention heads, some MLP
columns, some routed experts) read straight from the checkpoint, and the sums that join the
slices: one all-reduce after attention, one after the MLP.

The projections that read the hidden state (q, k, v; gate, up) are cut by output rows: each
rank gets whole heads (whole KV groups with the query heads that share them; where there are
fewer KV heads than ranks, ranks share a KV head and split its query heads) and a run of MLP
columns. The projections that write the hidden state (o, down) are cut by input columns, so
each rank's output is a partial sum, added up over the ranks by the family's ``reduce``; their
biases are added by the first rank only. Routed experts are dealt out whole (expert
parallelism): the router runs on every rank on the same input, so all agree where each token
goes, and each runs the experts it holds. MLA's latent (shared by all heads) and the
projections that make it are replicated, its heads split. The KV cache follows the heads.
The LM head is cut by vocabulary rows, its logits gathered on every rank; the embeddings are
replicated (a lookup reads only the rows it needs).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from tiergen.config import ModelConfig
from tiergen.errors import TiergenError
from tiergen.models.base import ModelFamily, Weights
from tiergen.parallel.stage import LM_HEAD
from tiergen.weights import WeightSource
from tiergen.weights.packed import Packed, narrow


def even_ranges(n: int, parts: int, what: str, unit: int = 1) -> list[range]:
    """[0, n) cut into ``parts`` consecutive ranges as even as possible, every cut on a
    multiple of ``unit``."""
    units = -(-n // unit)
    if units < parts:
        raise TiergenError(f"cannot split the model's {n} {what} over tensor_parallel={parts} "
                           "ranks; use fewer ranks")
    base, extra = divmod(units, parts)
    bounds = [0]
    for r in range(parts):
        bounds.append(bounds[-1] + base + (r < extra))
    return [range(min(a * unit, n), min(b * unit, n)) for a, b in zip(bounds, bounds[1:])]


def _unit(n: int, parts: int) -> int:
    """The widest power-of-two unit, up to 256 (a quantised block: packed matrices are then
    cut between blocks), that cuts ``n`` into equal parts; 1 if none does."""
    return next((u for u in (256 >> s for s in range(9)) if n % (u * parts) == 0), 1)


def _scaled(r: range, unit: int) -> range:
    return range(r.start * unit, r.stop * unit)


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds: query and KV heads, dense and shared-expert MLP
    columns, routed experts and vocabulary rows (each a range of the whole model's)."""

    rank: int
    size: int
    heads: range
    kv_heads: range
    columns: range
    shared_columns: range
    experts: range
    vocab: list[range]  # every rank's rows, for gathering the logits

    @classmethod
    def make(cls, cfg: ModelConfig, size: int, rank: int) -> ShardPlan:
        if not isinstance(size, int) or size < 1:
            raise TiergenError(f"tensor_parallel must be a positive integer, got {size!r}")
        h, kv = cfg.num_heads, cfg.num_kv_heads
        if cfg.linear is not None and size > 1:
            raise TiergenError(f"tensor_parallel={size}: {cfg.architecture}'s linear-attention "
                               "layers are not split over ranks; run it on one rank, or over "
                               "pipeline_parallel ranks")
        if cfg.qk_norm_across_heads and size > 1:
            raise TiergenError(f"tensor_parallel={size}: {cfg.architecture}'s q and k norms "
                               "are each over all heads together, which one rank's heads "
                               "cannot compute alone; run it on one rank, or over "
                               "pipeline_parallel ranks")
        if cfg.mla is not None:  # one latent for all heads: every rank keeps it
            heads = kv_heads = even_ranges(h, size, "attention heads")[rank]
        elif kv >= size:
            kv_heads = even_ranges(kv, size, "key-value heads")[rank]
            heads = _scaled(kv_heads, h // kv)
        elif size % kv == 0:
            sharing = size // kv
            k = rank // sharing
            kv_heads = range(k, k + 1)
            part = even_ranges(h // kv, sharing, "query heads per key-value head")[rank % sharing]
            heads = range(k * (h // kv) + part.start, k * (h // kv) + part.stop)
        else:
            raise TiergenError(f"tensor_parallel={size} cannot share the model's {kv} key-value "
                               f"heads among its ranks; use a divisor or a multiple of {kv}")
        i = cfg.intermediate_size
        columns = even_ranges(i, size, "MLP columns", _unit(i, size))[rank]
        shared = experts = range(0)
        if cfg.moe is not None:
            experts = even_ranges(cfg.moe.num_experts, size, "routed experts")[rank]
            s = cfg.moe.shared_intermediate_size
            if s:
                shared = even_ranges(s, size, "shared-expert columns", _unit(s, size))[rank]
        vocab = even_ranges(cfg.vocab_size, size, "vocabulary rows", _unit(cfg.vocab_size, size))
        return cls(rank, size, heads, kv_heads, columns, shared, experts, vocab)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank computes it: its heads, columns and experts."""
        moe = cfg.moe and replace(cfg.moe, shared_intermediate_size=len(self.shared_columns),
                                  experts=(self.experts.start, self.experts.stop))
        return replace(cfg, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=len(self.columns), moe=moe)

    def rules(self, cfg: ModelConfig) -> dict[str, tuple[int, range] | None]:
        """How this rank reads each checkpoint tensor of a layer (names without the layer
        prefix) or of the globals: (dim, range) to keep, None for a bias only the first
        rank adds; tensors not named are read whole."""
        m = cfg.mla
        q_unit = m.qk_nope_head_dim + m.qk_rope_head_dim if m else cfg.head_dim
        o_unit = m.v_head_dim if m else cfg.head_dim
        q, kv = _scaled(self.heads, q_unit), _scaled(self.kv_heads, cfg.head_dim)
        bias = None if self.rank else (0, range(cfg.hidden_size))
        rules = {"self_attn.q_proj.weight": (0, q), "self_attn.q_proj.bias": (0, q),
                 "self_attn.q_b_proj.weight": (0, q), "self_attn.sinks": (0, self.heads),
                 "self_attn.o_proj.weight": (1, _scaled(self.heads, o_unit)),
                 "self_attn.o_proj.bias": bias, "mlp.down_proj.bias": bias,
                 LM_HEAD: (0, self.vocab[self.rank])}
        if m:
            rules["self_attn.kv_b_proj.weight"] = (0, _scaled(self.heads,
                                                               m.qk_nope_head_dim + m.v_head_dim))
            rules["self_attn.k_b_proj.weight"] = (0, _scaled(self.heads, m.kv_lora_rank))
            rules["self_attn.v_b_proj.weight"] = (0, _scaled(self.heads, m.v_head_dim))
        for p in "kv":
            rules |= {f"self_attn.{p}_proj.weight": (0, kv), f"self_attn.{p}_proj.bias": (0, kv)}
        for mlp, cols in (("mlp", self.columns), ("mlp.shared_expert", self.shared_columns),
                          ("mlp.shared_experts", self.shared_columns)):
            for p in ("gate", "up"):
                rules |= {f"{mlp}.{p}_proj.weight": (0, cols), f"{mlp}.{p}_proj.bias": (0, cols)}
            rules[f"{mlp}.down_proj.weight"] = (1, cols)
        return rules


class ShardedSource:
    """A checkpoint as one rank of tensor parallelism reads it: each tensor only as far as
    its :meth:`ShardPlan.rules` say (a safetensors file reads just those rows or columns; a
    GGUF's packed rows are views of the mapped file)."""

    def __init__(self, source: WeightSource, plan: ShardPlan, cfg: ModelConfig) -> None:
        self.source, self.rules = source, plan.rules(cfg)

    def _rule(self, name: str) -> tuple[int, range] | None | bool:
        """(dim, range), None (a bias another rank adds: zeros here) or True (whole)."""
        local = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        return self.rules.get(local, True)

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str) -> torch.Tensor | Packed:
        rule = self._rule(name)
        if rule is True:
            return self.source.get(name)
        if rule is None:
            return torch.zeros_like(self.source.get(name))
        return self.source.get_slice(name, *rule)

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor | Packed:
        return narrow(self.get(name), dim, rows)

    def locate(self, name: str) -> None:
        """None: a shard's tensors are cut from the checkpoint's, not read as they lie."""
        return None

    def meta(self, name: str) -> Packed | None:
        """The layout of a packed tensor as :meth:`get` gives it (None: not packed)."""
        full = self.source.meta(name)
        rule = self._rule(name)
        if full is None or rule is True:
            return full
        if rule is None:
            return None
        return full.narrow(rule[0], rule[1].start, rule[1].stop)


class Shard:
    """A model family as shard ``rank`` of ``size`` computes it: the family over this
    rank's config, its ``reduce`` summing over the ranks of ``group``, its LM head over this
    rank's vocabulary rows with the logits gathered. (Without a group: the shard's weights
    and shapes only, as the planner sees them.)"""

    def __init__(self, model: ModelFamily, size: int, rank: int, group=None) -> None:
        self.plan = ShardPlan.make(model.cfg, size, rank)
        self.full, self.group = model.cfg, group
        # a family's other fields (RoPE tables, scales) depend on nothing sharding changes
        self.model = copy.copy(model)
        self.model.cfg = self.cfg = self.plan.config(model.cfg)
        if group is not None:
            self.model.reduce = group.all_reduce

    def source(self, source: WeightSource) -> ShardedSource:
        return ShardedSource(source, self.plan, self.full)

    def global_specs(self) -> dict[str, tuple[int, ...]]:
        specs = self.model.global_specs()
        if LM_HEAD in specs:
            specs[LM_HEAD] = (len(self.plan.vocab[self.plan.rank]), self.cfg.hidden_size)
        return specs

    def fuse_globals(self, raw: Weights) -> Weights:
        w = self.model.fuse_globals(raw)
        embed = w["embed"]
        if self.full.tie_word_embeddings and tuple(embed.shape) == (self.full.vocab_size,
                                                                     self.full.hidden_size):
            r = self.plan.vocab[self.plan.rank]
            w["lm_head"] = embed.narrow(0, r.start, r.stop) if isinstance(embed, Packed) \
                else embed[r.start:r.stop]
        return w

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        return self.model.layer_specs(i)

    def fused_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        return self.model.fused_specs(i)

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        return self.model.fuse_layer(i, raw)

    def prepare(self, meta, dtype: torch.dtype) -> object:
        return self.model.prepare(meta, dtype)

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(w, ids)

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta, cache, shared) -> torch.Tensor:
        return self.model.layer(i, w, h, meta, cache, shared)

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank."""
        return self.group.all_gather(self.model.head(w, h), [len(r) for r in self.plan.vocab])
