"""The Llama family: Llama 2/3.x, Mistral (sliding window or not), Qwen2 (q/k/v biases),
Qwen3 (per-head q/k RMSNorm), their mixture-of-experts versions Mixtral, Qwen2-MoE and
Qwen3-MoE (``cfg.moe``: the MLP of a layer becomes routed experts), gpt-oss (attention
sinks, sliding and full layers, experts with biases), GLM-4.5 to 4.7 (partial rotary, q/k/v
biases, DeepSeek-V3's routing) and MiniMax-M2 (partial rotary, q and k normalised over all
heads together, sigmoid routing). The differences are config flags.

Per layer: h += o_proj(attn(rope(q), rope(k), v)) over rms_norm(h); h += mlp(rms_norm(h)).
"""

from __future__ import annotations

import torch

from tiergen.cache.kv import KVView
from tiergen.cache.step import StepMeta
from tiergen.config import ModelConfig
from tiergen.models.base import (Weights, causal_lm_global_specs, no_reduce,
                                 fuse_causal_lm_globals)
from tiergen.models.layers import (LayerKind, Step, apply_rope, cat_rows, embedding, fused_step,
                                   linear, run_steps, rms_norm, rope_attention_factor, rope_cos_sin,
                                   rope_inv_freq)
from tiergen.models.moe import ffn, ffn_checkpoint_specs, ffn_fused_specs, fuse_ffn

# the names of tiergen.kernels.layer -> this family's (see fuse_layer)
FUSED_NAMES = {"attn_norm": "input_norm", "q_norm": "q_norm", "k_norm": "k_norm",
               "ffn_norm": "post_norm", "qkv": "qkv", "o": "o", "gate_up": "gate_up",
               "down": "down", "qkv_bias": "qkv_bias", "o_bias": "o_bias",
               "gate_up_bias": "gate_up_bias", "down_bias": "down_bias"}


class Llama:
    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg, self.reduce = cfg, no_reduce
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)
        self.rope_factor = rope_attention_factor(cfg.rope)  # YaRN scales cos and sin
        self.kind = LayerKind(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                              pairs=cfg.rope.pairs, rotary=cfg.rotary_dim)

    def global_specs(self) -> dict[str, tuple[int, ...]]:
        return causal_lm_global_specs(self.cfg)

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        p = f"model.layers.{i}."
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        specs = {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        }
        specs |= {p + n: s for n, s in ffn_checkpoint_specs(c, i).items()}
        if c.qkv_bias:
            specs |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)}
        if c.o_bias:
            specs[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:
            specs |= {p + "self_attn.q_norm.weight": self._qk_norm_shape(q),
                      p + "self_attn.k_norm.weight": self._qk_norm_shape(kv)}
        if c.attention_sinks:
            specs[p + "self_attn.sinks"] = (c.num_heads,)
        return specs

    def fused_specs(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of what :meth:`fuse_layer` returns."""
        c = self.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        specs = {"input_norm": (c.hidden_size,), "qkv": (q + 2 * kv, c.hidden_size),
                 "o": (c.hidden_size, q), "post_norm": (c.hidden_size,),
                 **ffn_fused_specs(c, layer)}
        if c.qkv_bias:
            specs["qkv_bias"] = (q + 2 * kv,)
        if c.o_bias:
            specs["o_bias"] = (c.hidden_size,)
        if c.qk_norm:
            specs["q_norm"], specs["k_norm"] = self._qk_norm_shape(q), self._qk_norm_shape(kv)
        if c.attention_sinks:
            specs["sinks"] = (c.num_heads,)
        return specs

    def _qk_norm_shape(self, width: int) -> tuple[int]:
        """A q or k norm's weight: a head's, or the whole projection's (MiniMax-M2)."""
        return (width if self.cfg.qk_norm_across_heads else self.cfg.head_dim,)

    def fuse_globals(self, raw: Weights) -> Weights:
        return fuse_causal_lm_globals(self.cfg, raw)

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        """Fuse q/k/v and gate/up into single matrices: fewer, larger matmuls."""
        r = {k.removeprefix(f"model.layers.{i}."): v for k, v in raw.items()}
        w = {
            "input_norm": r["input_layernorm.weight"],
            "qkv": cat_rows([r[f"self_attn.{n}_proj.weight"] for n in "qkv"]),
            "o": r["self_attn.o_proj.weight"],
            "post_norm": r["post_attention_layernorm.weight"],
            **fuse_ffn(self.cfg, i, r),
        }
        if self.cfg.qkv_bias:
            w["qkv_bias"] = cat_rows([r[f"self_attn.{n}_proj.bias"] for n in "qkv"])
        if self.cfg.o_bias:
            w["o_bias"] = r["self_attn.o_proj.bias"]
        if self.cfg.qk_norm:
            w["q_norm"], w["k_norm"] = r["self_attn.q_norm.weight"], r["self_attn.k_norm.weight"]
        if self.cfg.attention_sinks:
            w["sinks"] = r["self_attn.sinks"]
        return w

    def prepare(self, meta: StepMeta, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(self.inv_freq.to(meta.positions.device), meta.positions, dtype)
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        return cos, sin

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        # the residual stream is float32 (see rms_norm); the norm weights hold the compute dtype
        return embedding(w["embed"], ids, w["norm"].dtype).float()

    def decode_step(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
                    shared: tuple[torch.Tensor, torch.Tensor],
                    known: Step | None = None) -> Step | None:
        """Layer i of a decode step as the native layer runs it, or None (see fused_step)."""
        c = self.cfg
        if ((h.shape[1] != 1 and not meta.checks) or self.reduce is not no_reduce or c.is_moe_layer(i)
                or c.attention_sinks or c.qk_norm_across_heads):
            return None
        return fused_step(self.kind, FUSED_NAMES, w, h, meta, cache, shared, known)

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
              shared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if (step := self.decode_step(i, w, h, meta, cache, shared)) is not None:
            return run_steps([step], h)
        B, T, _ = h.shape
        c = self.cfg
        x = rms_norm(h, w["input_norm"], c.rms_norm_eps)
        qkv = linear(x, w["qkv"], w.get("qkv_bias"))
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                             c.num_kv_heads * c.head_dim], dim=-1)
        if c.qk_norm_across_heads:  # each over all heads together
            q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
        q = q.view(B, T, c.num_heads, c.head_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm and not c.qk_norm_across_heads:
            q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
            k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
        cos, sin = shared
        q = apply_rope(q.transpose(1, 2), cos, sin, c.rope.pairs)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin, c.rope.pairs)  # (B, KVH, T, D)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        o = cache.attend(q, k, v, meta, w.get("sinks")).transpose(1, 2).reshape(B, T, -1)
        h = h + self.reduce(linear(o, w["o"], w.get("o_bias")))
        return h + self.reduce(ffn(c, i, w, rms_norm(h, w["post_norm"], c.rms_norm_eps)))

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(h, w["norm"], self.cfg.rms_norm_eps), w["lm_head"])
