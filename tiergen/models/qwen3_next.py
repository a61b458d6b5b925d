"""Qwen3-Next and Qwen3.5 (text): three layers in four are linear attention (Gated
DeltaNet), whose cache is a state of fixed size per sequence; the fourth is gated attention. Every norm multiplies by
(1 + w) (as Gemma's), and the MLPs are Qwen2-MoE's routed experts with a gated shared expert.

Gated DeltaNet, per layer: q, k, v, z, b, a = projections of x (grouped by key head); q, k, v
pass a short causal convolution (kernel K, its last K - 1 inputs kept) and SiLU; q and k are
l2-normalised, q scaled by key_head_dim**-0.5; per value head (value heads share key heads in
groups) the state S (key_head_dim x value_head_dim) decays by exp(g), g = -exp(A_log) *
softplus(a + dt_bias), and learns v at rate beta = sigmoid(b) by the delta rule:
S <- S exp(g); S += k (beta (v - S^T k))^T; the output S^T q goes through an RMSNorm gated by
silu(z). A prompt runs the chunked form (chunks of 64 tokens: a triangular solve inside each
chunk, the state carried between them), a decode step the recurrent one; both are the same
arithmetic up to rounding.

Gated attention: q's projection is doubled, its second half (per head) gating the output
through a sigmoid; q and k are normalised per head; a quarter of each head rotates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiergen import kernels
from tiergen.cache.kv import KVView, StateView
from tiergen.cache.step import StepMeta
from tiergen.config import LinearAttentionConfig, ModelConfig
from tiergen.models.base import (Weights, causal_lm_global_specs, fuse_causal_lm_globals,
                                 no_reduce)
from tiergen.models.layers import (apply_rope, cat_rows, embedding, gemma_rms_norm, linear,
                                   rope_cos_sin, rope_inv_freq)
from tiergen.models.moe import ffn, ffn_checkpoint_specs, ffn_fused_specs, fuse_ffn

CHUNK = 64  # tokens of the chunked delta rule's blocks
FEW_TOKENS = 16  # a step's tokens up to which the convolution is a sum of K products


class Qwen3Next:
    def __init__(self, cfg: ModelConfig) -> None:
        assert cfg.linear is not None
        self.cfg, self.linear, self.reduce = cfg, cfg.linear, no_reduce
        self.inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)

    def global_specs(self) -> dict[str, tuple[int, ...]]:
        return causal_lm_global_specs(self.cfg)

    def _widths(self) -> tuple[int, int, int]:
        """The linear layer's in-projection rows (q, k, v, z then b, a), its convolution's
        channels and its value heads' width."""
        m = self.linear
        keys, values = m.key_heads * m.key_head_dim, m.value_heads * m.value_head_dim
        return 2 * keys + 2 * values + 2 * m.value_heads, m.conv_dim, values

    def _in_projections(self) -> list[tuple[str, int]]:
        """The linear layer's in-projections (checkpoint name, rows), in the order fused."""
        m = self.linear
        keys, values = m.key_heads * m.key_head_dim, m.value_heads * m.value_head_dim
        if m.grouped:  # Qwen3-Next: q, k, v, z grouped by key head, then b, a likewise
            return [("qkvz", 2 * keys + 2 * values), ("ba", 2 * m.value_heads)]
        ba = [("ba", 2 * m.value_heads)] if m.ba_grouped else [("b", m.value_heads),
                                                               ("a", m.value_heads)]
        return [("qkv", 2 * keys + values), ("z", values), *ba]

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        c, m, p = self.cfg, self.linear, f"model.layers.{i}."
        h = c.hidden_size
        specs = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if c.keeps_state(i):
            _, channels, values = self._widths()
            a = p + "linear_attn."
            specs |= {a + f"in_proj_{n}.weight": (r, h) for n, r in self._in_projections()}
            specs |= {a + "conv1d.weight": (channels, 1, m.conv_kernel),
                      a + "dt_bias": (m.value_heads,), a + "A_log": (m.value_heads,),
                      a + "norm.weight": (m.value_head_dim,), a + "out_proj.weight": (h, values)}
        else:
            q, kv, a = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, p + "self_attn."
            specs |= {a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h),
                      a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q),
                      a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)}
        return specs | {p + n: s for n, s in ffn_checkpoint_specs(c, i).items()}

    def fused_specs(self, layer: int) -> dict[str, tuple[int, ...]]:
        c, m, h = self.cfg, self.linear, self.cfg.hidden_size
        specs = {"input_norm": (h,), "post_norm": (h,), **ffn_fused_specs(c, layer)}
        if c.keeps_state(layer):
            rows, channels, values = self._widths()
            return specs | {"in": (rows, h), "conv": (channels, 1, m.conv_kernel),
                            "dt_bias": (m.value_heads,), "A_log": (m.value_heads,),
                            "gated_norm": (m.value_head_dim,), "out": (h, values)}
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return specs | {"qkv": (2 * q + 2 * kv, h), "o": (h, q), "q_norm": (c.head_dim,),
                        "k_norm": (c.head_dim,)}

    def fuse_globals(self, raw: Weights) -> Weights:
        return fuse_causal_lm_globals(self.cfg, raw)

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        r = {k.removeprefix(f"model.layers.{i}."): v for k, v in raw.items()}
        w = {"input_norm": r["input_layernorm.weight"],
             "post_norm": r["post_attention_layernorm.weight"], **fuse_ffn(self.cfg, i, r)}
        if self.cfg.keeps_state(i):
            a = "linear_attn."
            return w | {"in": cat_rows([r[a + f"in_proj_{n}.weight"]
                                        for n, _ in self._in_projections()]),
                        "conv": r[a + "conv1d.weight"], "dt_bias": r[a + "dt_bias"],
                        "A_log": r[a + "A_log"], "gated_norm": r[a + "norm.weight"],
                        "out": r[a + "out_proj.weight"]}
        a = "self_attn."
        return w | {"qkv": cat_rows([r[a + f"{n}_proj.weight"] for n in "qkv"]),
                    "o": r[a + "o_proj.weight"], "q_norm": r[a + "q_norm.weight"],
                    "k_norm": r[a + "k_norm.weight"]}

    def prepare(self, meta: StepMeta, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq.to(meta.positions.device), meta.positions, dtype)

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        return embedding(w["embed"], ids, w["norm"].dtype).float()

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta,
              cache: KVView | StateView, shared: tuple[torch.Tensor, torch.Tensor]
              ) -> torch.Tensor:
        c = self.cfg
        x = gemma_rms_norm(h, w["input_norm"], c.rms_norm_eps)
        mix = (self._linear_attention(w, x, meta, cache) if c.keeps_state(i)
               else self._attention(w, x, meta, cache, shared))
        h = h + self.reduce(mix)
        return h + self.reduce(ffn(c, i, w, gemma_rms_norm(h, w["post_norm"], c.rms_norm_eps)))

    def _attention(self, w: Weights, x: torch.Tensor, meta: StepMeta, cache: KVView,
                   shared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        c = self.cfg
        B, T, _ = x.shape
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        qg, k, v = linear(x, w["qkv"]).split([2 * H * D, KVH * D, KVH * D], dim=-1)
        q, gate = qg.view(B, T, H, 2 * D).chunk(2, dim=-1)
        q = gemma_rms_norm(q, w["q_norm"], c.rms_norm_eps)
        k = gemma_rms_norm(k.view(B, T, KVH, D), w["k_norm"], c.rms_norm_eps)
        cos, sin = shared
        q, k = (apply_rope(t.transpose(1, 2), cos, sin) for t in (q, k))
        o = cache.attend(q, k, v.view(B, T, KVH, D).transpose(1, 2), meta)
        o = o.transpose(1, 2).reshape(B, T, H * D) * torch.sigmoid(gate.reshape(B, T, H * D))
        return linear(o, w["o"])

    def _linear_attention(self, w: Weights, x: torch.Tensor, meta: StepMeta,
                          cache: StateView) -> torch.Tensor:
        m = self.linear
        B, T, _ = x.shape
        KH, VH, dk, dv, K = (m.key_heads, m.value_heads, m.key_head_dim, m.value_head_dim,
                             m.conv_kernel)
        g = VH // KH
        valid = meta.valid[:, meta.start:meta.end].to(x.device)
        x = x * valid[..., None].to(x.dtype)  # padding enters no state
        proj = linear(x, w["in"])
        if m.grouped:  # per key head: its q, k, then its value heads' v and z; b, a likewise
            qkvz, ba = proj.split([proj.shape[-1] - 2 * VH, 2 * VH], dim=-1)
            q, k, v, z = qkvz.view(B, T, KH, 2 * dk + 2 * g * dv).split(
                [dk, dk, g * dv, g * dv], dim=-1)
            b, a = ba.view(B, T, KH, 2 * g).split([g, g], dim=-1)
            mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)],
                              dim=-1)
        else:
            mixed, z, ba = proj.split([m.conv_dim, VH * dv, 2 * VH], dim=-1)
            b, a = (ba.view(B, T, KH, 2 * g) if m.ba_grouped else ba).split(
                [g, g] if m.ba_grouped else [VH, VH], dim=-1)

        conv, S = causal_conv(cache, meta, mixed, w["conv"], m)
        q, k, v = conv.split([KH * dk, KH * dk, VH * dv], dim=-1)
        q, k = (l2norm(t.reshape(B, T, KH, dk)) for t in (q, k))
        q, k = ((t.repeat(1, 1, g, 1) if m.tiled else t.repeat_interleave(g, dim=2))
                for t in (q, k))
        beta = torch.sigmoid(b.reshape(B, T, VH).float()) * valid[..., None]
        decay = (-w["A_log"].float().exp() * F.softplus(a.reshape(B, T, VH).float()
                                                         + w["dt_bias"].float())) * valid[..., None]
        out, S = delta_rule(q * dk**-0.5, k, v.reshape(B, T, VH, dv), decay, beta,
                            S.view(B, VH, dk, dv))
        keep_state(cache, m, S)

        normed = F.rms_norm(out, (dv,), None, self.cfg.rms_norm_eps)  # gated RMSNorm, float32
        y = normed * w["gated_norm"].float() * F.silu(z.reshape(B, T, VH, dv).float())
        return linear(y.reshape(B, T, VH * dv).to(x.dtype), w["out"])

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(gemma_rms_norm(h, w["norm"], self.cfg.rms_norm_eps), w["lm_head"])


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def keep_state(cache: StateView, m: LinearAttentionConfig, S: torch.Tensor) -> None:
    """Put the delta rule's state after a step into the layer's state rows (where the step
    updated them in place, they hold it already)."""
    rows = cache.rows[:, m.conv_dim * (m.conv_kernel - 1):]
    if S.data_ptr() != rows.data_ptr():
        rows.copy_(S.reshape(len(rows), -1))


def causal_conv(cache: StateView, meta: StepMeta, mixed: torch.Tensor, weight: torch.Tensor,
                m: LinearAttentionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's short causal convolution and SiLU over its inputs mixed (B, T,
    conv_dim), after the last K - 1 inputs its state kept, which it replaces with its own
    last K - 1. Returns the output (B, T, conv_dim) and the delta rule's state (B, numel) as
    the step found it, float32. A sequence starts from zeros (its cache's memory may have held
    another's: see offload.kv.Recycled)."""
    B, C, K = len(mixed), m.conv_dim, m.conv_kernel
    state = (cache.rows.to(mixed.device) if meta.start else
             mixed.new_zeros(cache.rows.shape, dtype=torch.float32))
    kept, S = state.split([C * (K - 1), state.shape[-1] - C * (K - 1)], dim=-1)
    seq = torch.cat([kept.view(B, C, K - 1), mixed.float().transpose(1, 2)], dim=-1)
    if seq.shape[-1] - (K - 1) <= FEW_TOKENS:  # (oneDNN's convolution: 2.6 ms for one step)
        conv = (seq.unfold(-1, K, 1) * weight.float().view(C, 1, K)).sum(-1)
    else:
        conv = F.conv1d(seq, weight.float(), groups=C)
    conv = F.silu(conv).transpose(1, 2)
    cache.rows[:, :C * (K - 1)].copy_(seq[:, :, seq.shape[-1] - (K - 1):].reshape(B, -1))
    return conv, S


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens: q, k (B, T, H, dk), v (B, T, H, dv), rate beta
    (B, T, H), log decay g (B, T, H), or (B, T, H, dk) for a decay per key channel (Kimi),
    state S (B, H, dk, dv), all float32; returns the outputs (B, T, H, dv) and the state after
    the last token (one token on a CPU: S itself, updated in place). One token: the recurrent
    step; more: the chunked form (within a chunk, the tokens' updates as one triangular
    solve)."""
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))  # heads first
    if g.dim() == 3:  # one decay per head: as a key channel's, broadcast
        g = g[..., None]
    if q.shape[2] == 1 and (out := kernels.delta_step(
            S, q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0])) is not None:
        return out[:, None], S  # on a CPU: one call, S updated in place
    if q.shape[2] == 1:  # as products over the state, each reading it once
        B, H, dk, dv = S.shape
        S = S * g[:, :, 0, :, None].exp()
        kv = k @ S  # (B, H, 1, dv): what S recalls for k
        S.view(B * H, dk, dv).baddbmm_(k.reshape(B * H, dk, 1),
                                       ((v - kv) * beta[..., None]).reshape(B * H, 1, dv))
        return (q @ S).transpose(1, 2), S
    if g.shape[-1] > 1:
        return _per_channel_delta_rule(q, k, v, g, beta, S)
    B, H, T, dk = q.shape
    pad = -T % CHUNK
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    n = (T + pad) // CHUNK
    q, k, v = (t.view(B, H, n, CHUNK, -1) for t in (q, k, v))
    beta = beta.view(B, H, n, CHUNK, 1)
    g = g.view(B, H, n, CHUNK).cumsum(-1)  # the decay from the chunk's start, in log
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta
    # (I + strictly lower part of (k_beta k^T) decay)^-1 against v_beta and the decayed keys
    system = (k_beta @ k.mT) * decay
    values = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False,
                                              unitriangular=True)
    inner = (q @ k.mT) * decay
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    total = g[..., -1].exp()[..., None, None]
    out = torch.empty_like(v)
    for c in range(n):
        fresh = values[:, :, c] - k_decayed[:, :, c] @ S
        out[:, :, c] = q[:, :, c] @ S + inner[:, :, c] @ fresh
        S = S * total[:, :, c] + k[:, :, c].mT @ fresh
    return out.view(B, H, -1, v.shape[-1])[:, :, :T].transpose(1, 2), S


CHANNEL_CHUNK = 16  # tokens of a chunk when the decay is per channel (its pairs are per channel)


def _per_channel_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule of :func:`delta_rule` with a log decay per key channel, heads first
    (q, k, g (B, H, T, dk), v (B, H, T, dv), beta (B, H, T)). A pair of tokens (s, r) of a
    chunk decays by exp(G_s - G_r) channel by channel (G: the decay from the chunk's start),
    so their products are made chunk by chunk, of CHANNEL_CHUNK tokens, never all at once."""
    B, H, T, _ = q.shape
    C = CHANNEL_CHUNK
    later = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    out = torch.empty_like(v)
    for s in range(0, T, C):
        qc, kc, vc, gc = (t[:, :, s:s + C] for t in (q, k, v, g))
        n, bc = qc.shape[2], beta[:, :, s:s + C, None]
        G = gc.cumsum(2)  # (B, H, n, dk)
        pair = (G[:, :, :, None] - G[:, :, None]).masked_fill(later[:n, :n, None], float("-inf"))
        pair = pair.exp()  # (B, H, n, n, dk): exp(G_s - G_r) for r <= s, else 0
        kb = kc * bc
        system = torch.einsum("bhsc,bhrc,bhsrc->bhsr", kb, kc, pair)
        values = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        k_decayed = torch.linalg.solve_triangular(system, kb * G.exp(), upper=False,
                                                  unitriangular=True)
        inner = torch.einsum("bhsc,bhrc,bhsrc->bhsr", qc, kc, pair)
        fresh = values - k_decayed @ S
        out[:, :, s:s + n] = (qc * G.exp()) @ S + inner @ fresh
        last = G[:, :, -1:]
        S = S * last.mT.exp() + (kc * (last - G).exp()).mT @ fresh
    return out.transpose(1, 2), S
