"""The Gemma 3 text family (Gemma3ForCausalLM).

Against Llama: local (sliding-window) layers interleave with global ones, each kind with its
own RoPE base; Gemma's RMSNorm is x * (1 + w); four norms per layer (before and after both
attention and MLP); per-head q/k norms; a GeGLU (gelu-tanh) MLP; embeddings scaled by
sqrt(hidden_size); attention scaled by query_pre_attn_scalar**-0.5; optional final logit
softcapping. The residual stream stays float32, as everywhere in tiergen.

Per layer: h += post_attn_norm(o_proj(attn(...over input_norm(h)))),
           h += post_ffw_norm(mlp(pre_ffw_norm(h))).
"""

from __future__ import annotations

import math
import torch

from tiergen.cache.kv import KVView
from tiergen.cache.step import StepMeta
from tiergen.config import ModelConfig
from tiergen.models.base import (Weights, causal_lm_global_specs, no_reduce,
                                 fuse_causal_lm_globals)
from tiergen.models.layers import (LayerKind, Step, apply_rope, cat_rows, embedding, fused_step,
                                   gelu_tanh_mlp, gemma_rms_norm, linear, rope_cos_sin,
                                   rope_inv_freq, run_steps)

CosSin = tuple[torch.Tensor, torch.Tensor]
# the names of tiergen.kernels.layer -> this family's (see fuse_layer)
FUSED_NAMES = {"attn_norm": "input_norm", "q_norm": "q_norm", "k_norm": "k_norm",
               "attn_out_norm": "post_attn_norm", "ffn_norm": "pre_ffw_norm",
               "ffn_out_norm": "post_ffw_norm", "qkv": "qkv", "o": "o", "gate_up": "gate_up",
               "down": "down"}


class Gemma3:
    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg, self.reduce = cfg, no_reduce
        self.inv_freq_global = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.inv_freq_local = rope_inv_freq(cfg.rope_local or cfg.rope, cfg.head_dim)
        # The shared attention scales scores by head_dim**-0.5; Gemma wants
        # query_pre_attn_scalar**-0.5, so q is pre-scaled by the ratio (1 when they agree).
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.q_scale = math.sqrt(cfg.head_dim / scalar)
        self.kind = LayerKind(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                              shift=1.0, q_scale=self.q_scale, gelu=True)

    def global_specs(self) -> dict[str, tuple[int, ...]]:
        return causal_lm_global_specs(self.cfg)

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        p = f"model.layers.{i}."
        q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
        return {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (c.head_dim,),
            p + "self_attn.k_norm.weight": (c.head_dim,),
            p + "post_attention_layernorm.weight": (h,),
            p + "pre_feedforward_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (c.intermediate_size, h),
            p + "mlp.up_proj.weight": (c.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, c.intermediate_size),
            p + "post_feedforward_layernorm.weight": (h,),
        }

    def fused_specs(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Names and shapes of what :meth:`fuse_layer` returns (the same for every layer)."""
        c = self.cfg
        q, kv, i, h = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                       c.intermediate_size, c.hidden_size)
        return {"input_norm": (h,), "qkv": (q + 2 * kv, h), "q_norm": (c.head_dim,),
                "k_norm": (c.head_dim,), "o": (h, q), "post_attn_norm": (h,),
                "pre_ffw_norm": (h,), "gate_up": (2 * i, h), "down": (h, i),
                "post_ffw_norm": (h,)}

    def fuse_globals(self, raw: Weights) -> Weights:
        return fuse_causal_lm_globals(self.cfg, raw)

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        r = {k.removeprefix(f"model.layers.{i}."): v for k, v in raw.items()}
        return {
            "input_norm": r["input_layernorm.weight"],
            "qkv": cat_rows([r[f"self_attn.{n}_proj.weight"] for n in "qkv"]),
            "q_norm": r["self_attn.q_norm.weight"],
            "k_norm": r["self_attn.k_norm.weight"],
            "o": r["self_attn.o_proj.weight"],
            "post_attn_norm": r["post_attention_layernorm.weight"],
            "pre_ffw_norm": r["pre_feedforward_layernorm.weight"],
            "gate_up": cat_rows([r["mlp.gate_proj.weight"], r["mlp.up_proj.weight"]]),
            "down": r["mlp.down_proj.weight"],
            "post_ffw_norm": r["post_feedforward_layernorm.weight"],
        }

    def prepare(self, meta: StepMeta, dtype: torch.dtype) -> dict[bool, CosSin]:
        """RoPE tables for global (False) and sliding (True) layers."""
        dev = meta.positions.device
        return {False: rope_cos_sin(self.inv_freq_global.to(dev), meta.positions, dtype),
                True: rope_cos_sin(self.inv_freq_local.to(dev), meta.positions, dtype)}

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        # transformers multiplies by sqrt(hidden) cast to the weights' dtype (55.4256 -> 55.5
        # in bfloat16), in that dtype; the residual stream then continues in float32.
        e = embedding(w["embed"], ids, w["norm"].dtype)
        return (e * torch.tensor(self.cfg.hidden_size**0.5, dtype=e.dtype)).float()

    def decode_step(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
                    shared: dict[bool, CosSin],
                    known: Step | None = None) -> Step | None:
        """Layer i of a decode step as the native layer runs it, or None (see fused_step)."""
        if (h.shape[1] != 1 and not meta.checks) or self.reduce is not no_reduce:
            return None
        return fused_step(self.kind, FUSED_NAMES, w, h, meta, cache,
                          shared[bool(self.cfg.window(i))], known)

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
              shared: dict[bool, CosSin]) -> torch.Tensor:
        if (step := self.decode_step(i, w, h, meta, cache, shared)) is not None:
            return run_steps([step], h)
        c = self.cfg
        eps = c.rms_norm_eps
        B, T, _ = h.shape
        cos, sin = shared[bool(c.window(i))]
        x = gemma_rms_norm(h, w["input_norm"], eps)
        q, k, v = linear(x, w["qkv"]).split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                              c.num_kv_heads * c.head_dim], dim=-1)
        q = gemma_rms_norm(q.view(B, T, c.num_heads, c.head_dim), w["q_norm"], eps)
        k = gemma_rms_norm(k.view(B, T, c.num_kv_heads, c.head_dim), w["k_norm"], eps)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, D)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, KVH, T, D)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        o = cache.attend(q, k, v, meta).transpose(1, 2).reshape(B, T, -1)
        h = h + gemma_rms_norm(self.reduce(linear(o, w["o"])), w["post_attn_norm"], eps).float()
        x = gemma_rms_norm(h, w["pre_ffw_norm"], eps)
        y = self.reduce(gelu_tanh_mlp(x, w["gate_up"], w["down"]))
        return h + gemma_rms_norm(y, w["post_ffw_norm"], eps).float()

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        logits = linear(gemma_rms_norm(h, w["norm"], self.cfg.rms_norm_eps), w["lm_head"])
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits.float() / cap) * cap
        return logits
