"""Kimi-Linear: three layers in four are Kimi Delta Attention (KDA), whose cache is a state
of fixed size per sequence; the others are DeepSeek-V3's latent attention with nothing
rotated (its k_pe and q_pe parts still score, as they are). The MLPs are DeepSeek-V3's
(sigmoid routing with a correction bias, shared experts), the first layers dense.

KDA, per layer: q, k, v = projections of x, each through a short causal convolution (kernel
K, its last K - 1 inputs kept) and SiLU; q and k l2-normalised, q scaled by head_dim**-0.5;
per head the state S (head_dim x head_dim) decays channel by channel by exp(g), g =
-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) (a low-rank forget gate), and learns v at rate
beta = sigmoid(b(x)) by the delta rule (:func:`~tiergen.models.qwen3_next.delta_rule`); the
output S^T q goes through an RMSNorm gated by sigmoid(g_b(g_a(x))), a low-rank gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiergen.cache.kv import KVView, StateView
from tiergen.cache.step import StepMeta
from tiergen.models.base import Weights
from tiergen.models.deepseek_v2 import DeepseekV2
from tiergen.models.layers import cat_rows, linear, rms_norm
from tiergen.models.moe import ffn, ffn_checkpoint_specs, ffn_fused_specs, fuse_ffn
from tiergen.models.qwen3_next import causal_conv, delta_rule, keep_state, l2norm


class KimiLinear(DeepseekV2):
    def _kda_rows(self) -> tuple[int, int]:
        """The widths of one head row block (heads x head_dim) and of the low-rank gates."""
        m = self.cfg.linear
        return m.key_heads * m.key_head_dim, m.key_head_dim

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        if not self.cfg.keeps_state(i):
            return super().layer_specs(i)
        c, m, p = self.cfg, self.cfg.linear, f"model.layers.{i}."
        h, (width, rank) = c.hidden_size, self._kda_rows()
        a = p + "self_attn."
        specs = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        specs |= {a + f"{n}_proj.weight": (width, h) for n in "qkv"}
        specs |= {a + f"{n}_conv1d.weight": (width, 1, m.conv_kernel) for n in "qkv"}
        specs |= {a + "b_proj.weight": (m.key_heads, h), a + "f_a_proj.weight": (rank, h),
                  a + "f_b_proj.weight": (width, rank), a + "g_a_proj.weight": (rank, h),
                  a + "g_b_proj.weight": (width, rank), a + "dt_bias": (width,),
                  a + "A_log": (1, 1, m.key_heads, 1), a + "o_norm.weight": (m.key_head_dim,),
                  a + "o_proj.weight": (h, width)}
        return specs | {p + n: s for n, s in ffn_checkpoint_specs(c, i).items()}

    def fused_specs(self, layer: int) -> dict[str, tuple[int, ...]]:
        """A KDA layer's projections of x fused into "in": [q | k | v | b | f_a | g_a]."""
        if not self.cfg.keeps_state(layer):
            return super().fused_specs(layer)
        c, m = self.cfg, self.cfg.linear
        h, (width, rank) = c.hidden_size, self._kda_rows()
        return {"input_norm": (h,), "post_norm": (h,), **ffn_fused_specs(c, layer),
                "in": (3 * width + m.key_heads + 2 * rank, h),
                "conv": (3 * width, 1, m.conv_kernel), "f_b": (width, rank),
                "g_b": (width, rank), "dt_bias": (width,), "A_log": (m.key_heads,),
                "gated_norm": (m.key_head_dim,), "out": (h, width)}

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        if not self.cfg.keeps_state(i):
            return super().fuse_layer(i, raw)
        r = {k.removeprefix(f"model.layers.{i}.self_attn."): v for k, v in raw.items()}
        return {"input_norm": r[f"model.layers.{i}.input_layernorm.weight"],
                "post_norm": r[f"model.layers.{i}.post_attention_layernorm.weight"],
                **fuse_ffn(self.cfg, i, {k.removeprefix(f"model.layers.{i}."): v
                                         for k, v in raw.items()}),
                "in": cat_rows([r[f"{n}_proj.weight"] for n in ("q", "k", "v", "b", "f_a", "g_a")]),
                "conv": torch.cat([r[f"{n}_conv1d.weight"] for n in "qkv"]),
                "f_b": r["f_b_proj.weight"], "g_b": r["g_b_proj.weight"],
                "dt_bias": r["dt_bias"], "A_log": r["A_log"].reshape(-1),
                "gated_norm": r["o_norm.weight"], "out": r["o_proj.weight"]}

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta,
              cache: KVView | StateView, shared: tuple[torch.Tensor, torch.Tensor]
              ) -> torch.Tensor:
        if not self.cfg.keeps_state(i):
            return super().layer(i, w, h, meta, cache, shared)
        c = self.cfg
        h = h + self.reduce(self._delta_attention(w, rms_norm(h, w["input_norm"], c.rms_norm_eps),
                                                  meta, cache))
        return h + self.reduce(ffn(c, i, w, rms_norm(h, w["post_norm"], c.rms_norm_eps)))

    def _delta_attention(self, w: Weights, x: torch.Tensor, meta: StepMeta,
                         cache: StateView) -> torch.Tensor:
        m = self.cfg.linear
        B, T, _ = x.shape
        H, d = m.key_heads, m.key_head_dim
        valid = meta.valid[:, meta.start:meta.end].to(x.device)
        x = x * valid[..., None].to(x.dtype)  # padding enters no state
        mixed, b, f, gate = linear(x, w["in"]).split([3 * H * d, H, d, d], dim=-1)
        conv, S = causal_conv(cache, meta, mixed, w["conv"], m)
        q, k, v = (t.reshape(B, T, H, d) for t in conv.split(H * d, dim=-1))
        g = (linear(f, w["f_b"]).float() + w["dt_bias"].float()).view(B, T, H, d)
        decay = -w["A_log"].float().exp()[:, None] * F.softplus(g) * valid[..., None, None]
        beta = torch.sigmoid(b.float()) * valid[..., None]
        out, S = delta_rule(l2norm(q) * d**-0.5, l2norm(k), v, decay, beta, S.view(B, H, d, d))
        keep_state(cache, m, S)
        normed = F.rms_norm(out, (d,), None, self.cfg.rms_norm_eps)  # gated RMSNorm, float32
        y = normed * w["gated_norm"].float() * torch.sigmoid(
            linear(gate, w["g_b"]).float().view(B, T, H, d))
        return linear(y.reshape(B, T, H * d).to(x.dtype), w["out"])
