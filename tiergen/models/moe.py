"""Mixture of experts: routing, and the routed experts' weights as something a layer asks
for by expert id, so that they can live wherever the policy puts them.

A MoE MLP over tokens x (N, H)::

    ids, weights = route(x)                  # (N, k) experts and mixing weights per token
    y = sum over chosen e of weights * expert_e(x)   # expert_e: SwiGLU (2I, H), (H, I)
    y += shared(x) [* sigmoid(gate(x))]      # shared experts, if any

Only the experts some token chose run; the experts object is told which ones first
(:meth:`Experts.fetch`) so that a disk-backed store reads just those.
"""

from __future__ import annotations

import ctypes
from itertools import accumulate

import torch
import torch.nn.functional as F

from tiergen import kernels
from tiergen.config import ModelConfig, MoEConfig
from tiergen.kernels import integer_kernels_take
from tiergen.kernels.layer import expert_table, experts_row, moe_row, route_rows
from tiergen.models.layers import cat_rows, linear, swiglu_mlp
from tiergen.weights.moe_names import checkpoint_names
from tiergen.weights.packed import Packed, stack

Specs = dict[str, tuple[int, ...]]


class Experts:
    """Routed experts' weights as two stacked tensors, gate_up (E, 2I, H) and down (E, H, I)
    (float, or :class:`~tiergen.weights.packed.Packed` stacks), and their biases (E, 2I) and
    (E, H) where the model has them, resident where compute runs. Offloaded stores (host RAM
    behind a GPU, disk) subclass it."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor,
                 gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None) -> None:
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        self._table: tuple | None = None  # (table, the views it points to), made once

    def table(self) -> ctypes.Array | None:
        """The experts at hand as the one-token native call takes them
        (:func:`~tiergen.kernels.layer.moe_row`), or None where it cannot take them: all of
        them, packed in host RAM without biases."""
        if self._table is None:
            pairs = [(self.gate_up[e], self.down[e]) for e in range(self.gate_up.shape[0])
                     ] if isinstance(self.gate_up, Packed) and not self.biased else []
            self._table = (expert_table(pairs) if pairs else None), pairs
        return self._table[0]

    def announce(self, ids: torch.Tensor, local: range) -> None:
        """The experts chosen in ``ids`` (global ids; this store holds ``local``) will be
        fetched soon: a store may start reading them."""

    def fetch(self, ids: list[int]) -> None:
        """Experts ``ids`` are about to run (the others will not be asked for)."""

    @property
    def biased(self) -> bool:
        return self.gate_up_bias is not None or self.down_bias is not None

    def used(self, ids: list[int]) -> None:
        """Experts ``ids`` of :meth:`table` ran (a store may count them as used)."""

    def weights(self, e: int) -> tuple[torch.Tensor | None, ...]:
        """Expert e's gate_up, down, gate_up bias and down bias (None: no bias)."""
        return (self.gate_up[e], self.down[e],
                None if self.gate_up_bias is None else self.gate_up_bias[e],
                None if self.down_bias is None else self.down_bias[e])

    def mlp(self, e: int, x: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
        """Expert e on its tokens x (n, H)."""
        return expert_mlp(cfg, x, *self.weights(e))


def expert_mlp(cfg: MoEConfig, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               gate_up_bias: torch.Tensor | None = None,
               down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert's MLP: SwiGLU, or gpt-oss's clamped form (see MoEConfig)."""
    if cfg.expert_act == "silu":
        return swiglu_mlp(x, gate_up, down, gate_up_bias, down_bias)
    gate_up = linear(x, gate_up, gate_up_bias)
    if cfg.gate_up_interleaved:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=cfg.swiglu_limit)
    up = up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
    return linear((up + 1) * (gate * _sigmoid(gate * cfg.swiglu_alpha)), down, down_bias)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch's sigmoid; batch invariant, of each token's values alone: torch takes one path
    for fewer than 32 values and another beyond, and where a tensor's values fall in its
    vectors depends on the rows before them; the paths can differ in the last bit."""
    if kernels.batch_invariant():
        return torch.cat([torch.sigmoid(t) for t in x.split(1)])
    return torch.sigmoid(x)


def route(cfg: MoEConfig, x: torch.Tensor, gate: torch.Tensor,
          bias: torch.Tensor | None = None, logit_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen experts (N, k) and their float32 mixing weights (N, k) for tokens x (N, H).
    ``bias`` (E,): added to the scores to choose experts, not to weigh them (DeepSeek-V3);
    ``logit_bias`` (E,): the router's own bias (gpt-oss)."""
    if cfg.router_float32:  # (llama.cpp keeps routers float; a quantised one is decoded)
        gate = gate.dequantize() if isinstance(gate, Packed) else gate.float()
        x = x.float()
        if (native := route_rows(cfg, x, gate, bias if bias is None else bias.float())
                ) is not None:
            return native
        logits = F.linear(x, gate)
    else:
        logits = linear(x, gate, logit_bias)
    if cfg.scoring == "topk_softmax":  # gpt-oss: a softmax over the chosen experts' logits
        top, ids = logits.topk(cfg.top_k, dim=-1)
        return ids, torch.softmax(top.float(), dim=-1) * cfg.routed_scaling_factor
    if cfg.scoring == "sigmoid":
        scores = _sigmoid(logits.float())
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores if bias is None else scores + bias.float()
    if cfg.topk_method != "greedy":
        # Keep the topk_groups groups that score highest: by their best expert (DeepSeek-V2)
        # or by the sum of their best two (V3); the others' experts cannot be chosen.
        groups = choice.view(len(x), cfg.num_groups, -1)
        group_score = (groups.max(dim=-1).values if cfg.topk_method == "group_limited_greedy"
                       else groups.topk(2, dim=-1).values.sum(dim=-1))
        best = group_score.topk(cfg.topk_groups, dim=-1).indices
        keep = torch.zeros(len(x), cfg.num_groups, dtype=torch.bool, device=x.device)
        keep.scatter_(1, best, True)
        # as transformers does: V2 zeroes the other groups' scores, V3 sets them to -inf
        masked = 0.0 if cfg.topk_method == "group_limited_greedy" else float("-inf")
        choice = groups.masked_fill(~keep[..., None], masked).view(len(x), -1)
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = (scores if bias is not None else choice).gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   experts: Experts, cfg: MoEConfig, tiles: bool = False) -> torch.Tensor:
    """Mix the chosen experts' outputs for tokens x (N, H); returns (N, H) in x's dtype.
    Under tensor parallelism a rank holds ``cfg.local_experts``, ``experts`` indexed from
    its first; the others' shares are left to their ranks. ``tiles``: the tokens are of rows
    on AMX tiles, and so are their experts' products (:func:`moe_mlp`)."""
    local = cfg.local_experts
    if (len(x) == 1 and not tiles
            and (out := _one_token(x, ids, weights, experts, cfg)) is not None):
        return out
    k = ids.shape[1]
    flat, mix = ids.flatten(), weights.flatten()
    order = flat.argsort(stable=True)  # token slots grouped by expert
    counts = torch.bincount(flat).tolist()
    ends = list(accumulate(counts))
    active = [e for e, c in enumerate(counts) if c and e in local]
    experts.fetch([e - local.start for e in active])
    out = torch.zeros_like(x)
    for e in active:
        slots = order[ends[e] - counts[e]:ends[e]]
        tokens = slots // k
        y = _tokens_mlp(lambda t: experts.mlp(e - local.start, t, cfg), x[tokens], tiles)
        out.index_add_(0, tokens, y * mix[slots, None].to(y.dtype))
    return out


def _one_token(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts,
               cfg: MoEConfig, shared: tuple[Packed, Packed, float] | None = None
               ) -> torch.Tensor | None:
    """:func:`routed_experts` for one token whose experts the C kernels take (packed, on the
    CPU, SwiGLU without biases) in one native call, experts in the order the general path
    adds them, then the ``shared`` expert (gate_up, down, its weight) if given (checked
    first: where it cannot join, the caller reads the routed experts while it computes);
    None for any other, and where products are batch invariant (one token then goes as
    several do, operation by operation)."""
    if (kernels.batch_invariant() or cfg.expert_act != "silu" or x.device.type != "cpu"
            or (shared and not all(map(integer_kernels_take, shared[:2])))):
        return None
    local = cfg.local_experts
    chosen = sorted((e, m) for e, m in zip(ids[0].tolist(), weights[0].tolist()) if e in local)
    if not chosen:
        return None
    experts.fetch([e - local.start for e, _ in chosen])
    pairs = []
    for e, _ in chosen:
        gate_up, down, gate_up_bias, down_bias = experts.weights(e - local.start)
        if gate_up_bias is not None or down_bias is not None:
            return None
        pairs.append((gate_up, down))
    mix = [m for _, m in chosen]
    if shared:
        pairs.append(shared[:2])
        mix.append(shared[2])
    out = experts_row(x, pairs, mix)
    return None if out is None else out.to(x.dtype)


def _one_token_at_hand(cfg: MoEConfig, w: dict, x: torch.Tensor
                       ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """One token's routing, and its experts where all are at hand, in one native call
    (:func:`~tiergen.kernels.layer.moe_row`): what :func:`route` and :func:`_one_token`
    compute. (out, ids, weights), out None where an expert is still to be read; None where
    the call cannot take them (routing other than DeepSeek's float32 one, a gated shared
    expert, experts over ranks, batch invariant products: see :func:`_one_token`)."""
    experts = w["experts"]
    if (kernels.batch_invariant() or not cfg.router_float32 or cfg.shared_gate
            or cfg.expert_act != "silu"
            or len(cfg.local_experts) != experts.gate_up.shape[0] or x.dtype != torch.float32
            or x.device.type != "cpu"
            or isinstance(w["router"], Packed) or (table := experts.table()) is None):
        return None
    shared = ((w["shared_gate_up"], w["shared_down"], 1.0) if cfg.shared_intermediate_size
              else None)
    bias = w.get("router_bias")
    done = moe_row(cfg, x, w["router"].float(), None if bias is None else bias.float(), table,
                   shared)
    if done is not None and done[0] is not None:
        experts.used(done[1][0].tolist())
    return done


def _shared_gate(x: torch.Tensor, weight: torch.Tensor | Packed) -> torch.Tensor:
    """The shared experts' gate, sigmoid(x @ weight.T) (N, 1)."""
    return _sigmoid(linear(x, weight))


def routed_on_tiles(cfg: MoEConfig) -> bool:
    """Whether the routed experts of a long prompt's tokens multiply on AMX tiles, as the
    shared ones do: where an expert takes a quarter of the tokens or more on average (128 of a
    prompt chunk of 512), since amx.c decodes an expert's matrices at every product. 64 tokens
    do not repay it (0.89x), 128 about do (1.03-1.05x), 256 do (1.09-1.16x): 32 experts of
    512 choosing 4, chunks of 512, 1,024 and 2,048 (``python benchmarks/bench_amx.py
    --experts [--chunk N]``, 2-core AMX Xeon). The model's choice, not the step's: a token's
    numbers stay what its row gets alone."""
    return 4 * cfg.top_k >= cfg.num_experts


def _tokens_mlp(mlp, x: torch.Tensor, tiles: bool) -> torch.Tensor:
    """``mlp`` on tokens x (N, H); with ``tiles``, as tokens of rows on AMX tiles."""
    return kernels.tokens_on_amx(mlp, x) if tiles else mlp(x)


def moe_mlp(cfg: MoEConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The MoE MLP of a layer on x (B, T, H): routed experts plus shared experts.

    ``w`` holds "router" (E, H), "experts" (an :class:`Experts`) and, with shared experts,
    "shared_gate_up", "shared_down" and optionally "shared_gate" (1, H). The tokens of a
    step's rows on AMX tiles (long prompts, :func:`~tiergen.kernels.rows_on_amx`) go apart
    from the others', through their shared experts on the tiles too, and through their routed
    ones there where :func:`routed_on_tiles`.
    """
    amx = kernels.on_amx(x.shape[0]) if x.dim() == 3 else None
    if amx is not None and not bool(amx.all()):
        return kernels.split_rows(amx, lambda r: moe_mlp(cfg, w, x[r]))
    tiles = amx is not None
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    one = len(x) == 1 and not tiles  # one token: the native calls, where they take it
    routed = _one_token_at_hand(cfg, w, x) if one else None
    if routed is not None and routed[0] is not None:
        return routed[0].to(x.dtype).view(shape)
    ids, weights = routed[1:] if routed else route(cfg, x, w["router"], w.get("router_bias"),
                                                     w.get("router_logit_bias"))
    routed_tiles = tiles and routed_on_tiles(cfg)
    if not cfg.shared_intermediate_size:
        return routed_experts(x, ids, weights, w["experts"], cfg, routed_tiles).view(shape)
    gate = _shared_gate(x, w["shared_gate"]) if cfg.shared_gate else None
    # one token: the shared expert in the routed experts' native call, after them
    if one and (out := _one_token(x, ids, weights, w["experts"], cfg, shared=(
            w["shared_gate_up"], w["shared_down"], 1.0 if gate is None else gate.item()))
            ) is not None:
        return out.view(shape)
    w["experts"].announce(ids, cfg.local_experts)  # read while the shared experts run
    shared = _tokens_mlp(lambda t: swiglu_mlp(t, w["shared_gate_up"], w["shared_down"]), x, tiles)
    if gate is not None:
        shared = gate * shared
    return (routed_experts(x, ids, weights, w["experts"], cfg, routed_tiles) + shared
            ).view(shape)


# -- the feed-forward part of a layer: a dense SwiGLU MLP, or a MoE one ---------------------

def ffn_checkpoint_specs(cfg: ModelConfig, layer: int) -> Specs:
    """Checkpoint names (layer prefix removed) and shapes of a layer's feed-forward part."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if cfg.is_moe_layer(layer):
        return checkpoint_moe_specs(cfg.moe, h, checkpoint_names(cfg))
    specs = {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
             "mlp.down_proj.weight": (h, i)}
    if cfg.mlp_bias:
        specs |= {"mlp.gate_proj.bias": (i,), "mlp.up_proj.bias": (i,), "mlp.down_proj.bias": (h,)}
    return specs


def ffn_fused_specs(cfg: ModelConfig, layer: int) -> Specs:
    """Names and shapes of what :func:`fuse_ffn` returns (gate and up fused)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if cfg.is_moe_layer(layer):
        return moe_specs(cfg.moe, h)
    specs = {"gate_up": (2 * i, h), "down": (h, i)}
    if cfg.mlp_bias:
        specs |= {"gate_up_bias": (2 * i,), "down_bias": (h,)}
    return specs


def fuse_ffn(cfg: ModelConfig, layer: int, r: dict[str, torch.Tensor]) -> dict:
    """A layer's feed-forward tensors (checkpoint names, layer prefix removed), fused."""
    if cfg.is_moe_layer(layer):
        return fuse_moe(cfg.moe, r, checkpoint_names(cfg))
    w = {"gate_up": cat_rows([r["mlp.gate_proj.weight"], r["mlp.up_proj.weight"]]),
         "down": r["mlp.down_proj.weight"]}
    if cfg.mlp_bias:
        w["gate_up_bias"] = torch.cat([r["mlp.gate_proj.bias"], r["mlp.up_proj.bias"]])
        w["down_bias"] = r["mlp.down_proj.bias"]
    return w


def ffn(cfg: ModelConfig, layer: int, w: dict, x: torch.Tensor) -> torch.Tensor:
    """A layer's feed-forward part on x (B, T, H)."""
    if cfg.is_moe_layer(layer):
        return moe_mlp(cfg.moe, w, x)
    return swiglu_mlp(x, w["gate_up"], w["down"], w.get("gate_up_bias"), w.get("down_bias"))


def moe_specs(cfg: MoEConfig, hidden: int) -> Specs:
    """Packed tensor names and shapes of a MoE MLP (experts stacked, gate and up fused)."""
    e, i = len(cfg.local_experts), cfg.intermediate_size
    specs = {"router": (cfg.num_experts, hidden), "experts.gate_up": (e, 2 * i, hidden),
             "experts.down": (e, hidden, i)}
    if cfg.router_bias:
        specs["router_bias"] = (cfg.num_experts,)
    if cfg.router_logit_bias:
        specs["router_logit_bias"] = (cfg.num_experts,)
    if cfg.expert_bias:
        specs |= {"experts.gate_up_bias": (e, 2 * i), "experts.down_bias": (e, hidden)}
    if cfg.shared_intermediate_size:
        s = cfg.shared_intermediate_size
        specs |= {"shared_gate_up": (2 * s, hidden), "shared_down": (hidden, s)}
        if cfg.shared_gate:
            specs["shared_gate"] = (1, hidden)
    return specs


def fuse_moe(cfg: MoEConfig, r: dict[str, torch.Tensor], names: dict[str, str]) -> dict:
    """Stack checkpoint experts into the fused MoE tensors.

    ``names`` gives the checkpoint names (layer prefix removed) with ``{e}`` for the expert
    index: keys "router", "gate", "up", "down", and "shared_gate"/"shared_up"/"shared_down"/
    "shared_expert_gate" as the model has them.
    """
    n = cfg.local_experts
    if "stacked" in names:
        return {"router": r[names["router"]], "router_logit_bias": r[names["router_logit_bias"]],
                "experts.gate_up": r[names["gate_up"]][n.start:n.stop].mT.contiguous(),
                "experts.gate_up_bias": r[names["gate_up_bias"]][n.start:n.stop],
                "experts.down": r[names["down"]][n.start:n.stop].mT.contiguous(),
                "experts.down_bias": r[names["down_bias"]][n.start:n.stop]}
    w = {"router": r[names["router"]],
         "experts.gate_up": stack([cat_rows([r[names["gate"].format(e=e)],
                                             r[names["up"].format(e=e)]]) for e in n]),
         "experts.down": stack([r[names["down"].format(e=e)] for e in n])}
    if cfg.router_bias:
        w["router_bias"] = r[names["router_bias"]]
    if cfg.router_logit_bias:
        w["router_logit_bias"] = r[names["router_logit_bias"]]
    if cfg.expert_bias:
        w["experts.gate_up_bias"] = torch.stack([torch.cat([r[names["gate_bias"].format(e=e)],
                                                            r[names["up_bias"].format(e=e)]])
                                                 for e in n])
        w["experts.down_bias"] = torch.stack([r[names["down_bias"].format(e=e)] for e in n])
    if cfg.shared_intermediate_size:
        w["shared_gate_up"] = cat_rows([r[names["shared_gate"]], r[names["shared_up"]]])
        w["shared_down"] = r[names["shared_down"]]
        if cfg.shared_gate:
            w["shared_gate"] = r[names["shared_expert_gate"]]
    return w


def checkpoint_moe_specs(cfg: MoEConfig, hidden: int, names: dict[str, str]
                         ) -> dict[str, tuple[int, ...]]:
    """Checkpoint names (as in :func:`fuse_moe`) and shapes of a MoE MLP."""
    i, e = cfg.intermediate_size, cfg.num_experts
    if "stacked" in names:
        return {names["router"]: (e, hidden), names["router_logit_bias"]: (e,),
                names["gate_up"]: (e, hidden, 2 * i), names["gate_up_bias"]: (e, 2 * i),
                names["down"]: (e, i, hidden), names["down_bias"]: (e, hidden)}
    specs = {names["router"]: (cfg.num_experts, hidden)}
    if cfg.router_bias:
        specs[names["router_bias"]] = (cfg.num_experts,)
    if cfg.router_logit_bias:
        specs[names["router_logit_bias"]] = (cfg.num_experts,)
    for e in cfg.local_experts:
        specs |= {names["gate"].format(e=e): (i, hidden), names["up"].format(e=e): (i, hidden),
                  names["down"].format(e=e): (hidden, i)}
        if cfg.expert_bias:
            specs |= {names["gate_bias"].format(e=e): (i,), names["up_bias"].format(e=e): (i,),
                      names["down_bias"].format(e=e): (hidden,)}
    if cfg.shared_intermediate_size:
        s = cfg.shared_intermediate_size
        specs |= {names["shared_gate"]: (s, hidden), names["shared_up"]: (s, hidden),
                  names["shared_down"]: (hidden, s)}
        if cfg.shared_gate:
            specs[names["shared_expert_gate"]] = (1, hidden)
    return specs
