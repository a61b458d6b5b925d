"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (and Kimi K2): multi-head latent attention
(MLA) and DeepSeekMoE. V3 differs only in how its router chooses experts (``MoEConfig``).

MLA compresses keys and values into one latent per token: c_kv = norm(W_DKV x) of
kv_lora_rank numbers, plus a RoPE key k_pe of qk_rope_head_dim numbers shared by all heads.
Per head, k = [W_UK c_kv | k_pe] and v = W_UV c_kv. The cache keeps only [c_kv | k_pe].

Absorbed (the default): W_UK moves into the query, q_lat = q_nope W_UK (per head, rank
numbers), so scores are q_lat . c_kv + q_pe . k_pe against the cached rows directly, and W_UV
is applied once to the attention output. Naive (``absorb=False``, kept to check the absorbed
path and to compare their speed): every step rebuilds per-head keys and values from the
cached latents.

Per layer: h += o_proj(mla(rms_norm(h))); h += mlp(rms_norm(h)), the MLP dense for the first
``first_k_dense_replace`` layers and DeepSeekMoE (shared + routed experts) after.

DeepSeek Sparse Attention (V3.2, GLM-5; ``MLAConfig.index_heads``): a small indexer scores
every cached token for each query, sum_h w_h relu(q_h . k / sqrt(d)), with its own queries
from the q latent, one key per token from x (LayerNorm, RoPE on its first rope numbers) and
per-head weights from x; each query then attends to the ``index_topk`` best rows only, which
are gathered (:meth:`~tiergen.cache.kv.LatentKVView.attend_indexed`). The indexer's key is
cached after [c_kv | k_pe] in the same row. GLM-5's "shared" layers reuse the choice of the
last layer before them that made one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiergen.cache.attention import attention
from tiergen.cache.kv import KVView
from tiergen.cache.step import StepMeta
from tiergen.config import ModelConfig
from tiergen import kernels
from tiergen.kernels import grouped_linear
from tiergen.kernels.layer import MlaKind, mla_attention
from tiergen.models.base import (Weights, causal_lm_global_specs, no_reduce,
                                 fuse_causal_lm_globals)
from tiergen.models.layers import (apply_rope, apply_rope_interleaved, cat_rows, embedding,
                                   linear, rms_norm, rope_attention_factor, rope_inv_freq,
                                   yarn_mscale)
from tiergen.models.moe import ffn, ffn_checkpoint_specs, ffn_fused_specs, fuse_ffn
from tiergen.weights.packed import Packed


class DeepseekV2:
    def __init__(self, cfg: ModelConfig, absorb: bool = True) -> None:
        assert cfg.mla is not None and cfg.moe is not None
        self.cfg, self.mla, self.absorb, self.reduce = cfg, cfg.mla, absorb, no_reduce
        m = cfg.mla
        self.inv_freq = rope_inv_freq(cfg.rope, m.qk_rope_head_dim)
        self.rope_factor = rope_attention_factor(cfg.rope)
        self.qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.scale = self.qk_dim**-0.5
        if cfg.rope.kind != "default" and cfg.rope.mscale_all_dim:
            self.scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
        self.kind = MlaKind(cfg.num_heads, m.q_lora_rank or 0, m.kv_lora_rank,
                            m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim,
                            cfg.rms_norm_eps, self.scale)

    def global_specs(self) -> dict[str, tuple[int, ...]]:
        return causal_lm_global_specs(self.cfg)

    def layer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        c, m = self.cfg, self.mla
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        h, heads, rank = c.hidden_size, c.num_heads, m.kv_lora_rank
        specs = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                 a + "kv_a_proj_with_mqa.weight": (rank + m.qk_rope_head_dim, h),
                 a + "kv_a_layernorm.weight": (rank,),
                 a + "o_proj.weight": (h, heads * m.v_head_dim)}
        if m.kv_b_split:
            specs |= {a + "k_b_proj.weight": (heads * rank, m.qk_nope_head_dim),
                      a + "v_b_proj.weight": (heads * m.v_head_dim, rank)}
        else:
            specs[a + "kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), rank)
        if m.q_lora_rank:
            specs |= {a + "q_a_proj.weight": (m.q_lora_rank, h),
                      a + "q_a_layernorm.weight": (m.q_lora_rank,),
                      a + "q_b_proj.weight": (heads * self.qk_dim, m.q_lora_rank)}
        else:
            specs[a + "q_proj.weight"] = (heads * self.qk_dim, h)
        specs |= {a + "indexer." + CHECKPOINT_INDEXER[n]: s
                  for n, s in self._indexer_specs(i).items()}
        return specs | {p + n: s for n, s in ffn_checkpoint_specs(c, i).items()}

    def _indexer_specs(self, i: int) -> dict[str, tuple[int, ...]]:
        """The indexer's tensors of layer i (none without one, or where it reuses a choice)."""
        m = self.mla
        if not m.index_heads or m.shares_choice(i):
            return {}
        return {"index_q": (m.index_heads * m.index_head_dim, m.q_lora_rank),
                "index_k": (m.index_head_dim, self.cfg.hidden_size),
                "index_norm": (m.index_head_dim,), "index_norm_bias": (m.index_head_dim,),
                "index_weights": (m.index_heads, self.cfg.hidden_size)}

    def fused_specs(self, layer: int) -> dict[str, tuple[int, ...]]:
        """The projections reading x fused into "qkv_a": [q_a | kv_a] with q_lora_rank, else
        [q | kv_a]; kv_b split into W_UK (H, nope, rank) and W_UV (H, v, rank), or where the
        checkpoint holds them so, llama.cpp's "k_b" (each head's W_UK transposed) and "v_b",
        their heads' rows one after the other (packed, if stored so)."""
        c, m = self.cfg, self.mla
        h, heads, rank = c.hidden_size, c.num_heads, m.kv_lora_rank
        q_out = m.q_lora_rank or heads * self.qk_dim
        kv = ({"k_b": (heads * rank, m.qk_nope_head_dim), "v_b": (heads * m.v_head_dim, rank)}
              if m.kv_b_split else {"w_uk": (heads, m.qk_nope_head_dim, rank),
                                    "w_uv": (heads, m.v_head_dim, rank)})
        specs = {"input_norm": (h,), "qkv_a": (q_out + rank + m.qk_rope_head_dim, h),
                 "kv_norm": (rank,), **kv, "o": (h, heads * m.v_head_dim), "post_norm": (h,)}
        if m.q_lora_rank:
            specs |= {"q_norm": (m.q_lora_rank,), "q_b": (heads * self.qk_dim, m.q_lora_rank)}
        return specs | self._indexer_specs(layer) | ffn_fused_specs(c, layer)

    def fuse_globals(self, raw: Weights) -> Weights:
        return fuse_causal_lm_globals(self.cfg, raw)

    def fuse_layer(self, i: int, raw: Weights) -> Weights:
        c, m = self.cfg, self.mla
        r = {k.removeprefix(f"model.layers.{i}."): v for k, v in raw.items()}
        a = "self_attn."
        q = r[a + "q_a_proj.weight"] if m.q_lora_rank else r[a + "q_proj.weight"]
        if m.kv_b_split:
            kv = {"k_b": r[a + "k_b_proj.weight"], "v_b": r[a + "v_b_proj.weight"]}
        else:
            kv_b = r[a + "kv_b_proj.weight"]
            if isinstance(kv_b, Packed):  # (FP8) absorbed into the attention as float tensors
                kv_b = kv_b.dequantize(r["input_layernorm.weight"].dtype)
            kv_b = kv_b.view(c.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
            kv = {"w_uk": kv_b[:, :m.qk_nope_head_dim].contiguous(),
                  "w_uv": kv_b[:, m.qk_nope_head_dim:].contiguous()}
        w = {"input_norm": r["input_layernorm.weight"],
             "qkv_a": cat_rows([q, r[a + "kv_a_proj_with_mqa.weight"]]),
             "kv_norm": r[a + "kv_a_layernorm.weight"], **kv,
             "o": r[a + "o_proj.weight"], "post_norm": r["post_attention_layernorm.weight"]}
        if m.q_lora_rank:
            w["q_norm"], w["q_b"] = r[a + "q_a_layernorm.weight"], r[a + "q_b_proj.weight"]
        w |= {n: r[a + "indexer." + CHECKPOINT_INDEXER[n]] for n in self._indexer_specs(i)}
        return w | fuse_ffn(c, i, r)

    def prepare(self, meta: StepMeta, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, 1, T, rope/2) in float32, with YaRN's magnitude factor folded in (no
        rotation: angles of zero)."""
        freqs = meta.positions.float()[..., None] * self.inv_freq.to(meta.positions.device)
        if not self.mla.rotary:
            freqs = torch.zeros_like(freqs)
        return ((freqs.cos() * self.rope_factor)[:, None], (freqs.sin() * self.rope_factor)[:, None])

    def embed(self, w: Weights, ids: torch.Tensor) -> torch.Tensor:
        return embedding(w["embed"], ids, w["norm"].dtype).float()

    def layer(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
              shared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        c = self.cfg
        out = self._native_attention(w, h, meta, cache, shared)
        h = self._attention(i, w, h, meta, cache, shared) if out is None else out
        return h + self.reduce(ffn(c, i, w, rms_norm(h, w["post_norm"], c.rms_norm_eps)))

    def _native_attention(self, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
                          shared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
        """A decode step's absorbed attention in one native call (``tg_mla_attention``),
        where it can run: on the CPU, llama.cpp's packed k_b and v_b, RoPE pairs adjacent,
        the heads all here. None for any other step."""
        if (h.shape[1] != 1 or h.device.type != "cpu" or not self.absorb or "k_b" not in w
                or self.mla.index_heads or not self.mla.rope_interleave or self.reduce is not no_reduce
                or cache.k.device.type != "cpu" or (slots := cache.decode_slots(meta)) is None):
            return None
        if "mla_rope" not in meta.derived:  # (B, rope), halves equal: made once per step
            meta.derived["mla_rope"] = [torch.cat([t, t], dim=-1).view(len(h), -1)
                                        for t in shared]
        return mla_attention(self.kind, w, h, *meta.derived["mla_rope"],
                             cache.k, *slots)

    def _attention(self, i: int, w: Weights, h: torch.Tensor, meta: StepMeta, cache: KVView,
                   shared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """h after the latent attention, operation by operation."""
        c, m = self.cfg, self.mla
        B, T, _ = h.shape
        heads, rank, rope = c.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
        x = rms_norm(h, w["input_norm"], c.rms_norm_eps)
        a = linear(x, w["qkv_a"])
        q, latent = a.split([a.shape[-1] - rank - rope, rank + rope], dim=-1)
        if m.q_lora_rank:
            q_latent = rms_norm(q, w["q_norm"], c.rms_norm_eps)
            q = linear(q_latent, w["q_b"])
        q = q.view(B, T, heads, self.qk_dim).transpose(1, 2)  # (B, H, T, nope + rope)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, rope], dim=-1)
        c_kv, k_pe = latent.split([rank, rope], dim=-1)
        cos, sin = shared
        q_pe = self._rope(q_pe, cos, sin)
        row = torch.cat([rms_norm(c_kv, w["kv_norm"], c.rms_norm_eps),
                         self._rope(k_pe[:, None], cos, sin)[:, 0]], dim=-1)[:, None]
        if self.absorb:
            # (B, H, T, rank)
            q_lat = _per_head(q_nope, w["k_b"]) if "k_b" in w else torch.matmul(q_nope, w["w_uk"])
            # attention scales by (rank + rope)**-0.5; MLA wants self.scale
            qa = torch.cat([q_lat, q_pe], dim=-1) * (self.scale * (rank + rope) ** 0.5)
            if m.index_heads:
                o_lat = self._sparse_attention(i, w, x, q_latent, row, qa, cache, meta, shared)
            else:
                o_lat = cache.attend(qa, row, None, meta)  # (B, H, T, rank)
            # (B, H, T, v)
            o = _per_head(o_lat, w["v_b"] if "v_b" in w else w["w_uv"])
        elif m.index_heads:
            raise NotImplementedError("sparse attention runs absorbed only")
        else:
            o = self._naive_attention(w, q_nope, q_pe, row, cache, meta)
        return h + self.reduce(linear(o.transpose(1, 2).reshape(B, T, -1), w["o"]))

    def _sparse_attention(self, i: int, w: Weights, x: torch.Tensor, q_latent: torch.Tensor,
                          row: torch.Tensor, qa: torch.Tensor, cache: KVView, meta: StepMeta,
                          shared: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The absorbed queries qa over the rows the indexer chooses (B, H, T, rank); the
        choice is kept in the step for the layers after that reuse it."""
        m = self.mla
        B, T, _ = x.shape
        if m.shares_choice(i):  # no indexer: the row's key part stays zero
            row = torch.cat([row, row.new_zeros(B, 1, T, m.index_head_dim)], dim=-1)
            o_lat, _ = cache.attend_indexed(qa, row, meta, m.index_topk,
                                            chosen=meta.derived.get("sparse choice"))
            return o_lat
        index_q = linear(q_latent, w["index_q"]).view(B, T, m.index_heads, m.index_head_dim)
        index_k = F.layer_norm(linear(x, w["index_k"]).float(), (m.index_head_dim,),
                               w["index_norm"].float(), w["index_norm_bias"].float(), 1e-6)
        index_q = self._index_rope(index_q.transpose(1, 2), shared).transpose(1, 2)
        index_k = self._index_rope(index_k[:, None], shared)  # (B, 1, T, index_head_dim)
        weights = F.linear(x.float(), _dense(w["index_weights"], torch.float32).float())
        row = torch.cat([row, index_k.to(row.dtype)], dim=-1)
        o_lat, meta.derived["sparse choice"] = cache.attend_indexed(
            qa, row, meta, m.index_topk, index=(index_q, weights * m.index_heads**-0.5))
        return o_lat

    def _index_rope(self, x: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor]
                    ) -> torch.Tensor:
        """The indexer's rotation of x's first qk_rope_head_dim numbers: in halves (V3.2) or
        in adjacent pairs (GLM-5); the tables cos/sin hold each angle once."""
        cos, sin = (torch.cat([t, t], dim=-1) for t in shared)
        return apply_rope(x.float(), cos, sin, pairs=self.mla.index_rope_interleave)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate RoPE dimensions laid out in adjacent pairs, or (``rope_interleave`` off) in
        halves: those are permuted into pairs first. Queries and keys are permuted alike, so
        their dot products are unchanged and the cache holds the permuted keys."""
        if not self.mla.rotary:
            return x
        if not self.mla.rope_interleave:
            x = x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        return apply_rope_interleaved(x, cos, sin)

    def _naive_attention(self, w: Weights, q_nope: torch.Tensor, q_pe: torch.Tensor,
                         row: torch.Tensor, cache: KVView, meta: StepMeta) -> torch.Tensor:
        """Decompress the cached latents into per-head keys and values, then attend."""
        rank = self.mla.kv_lora_rank
        rows, _ = cache.update(row.to(cache.k.device), None, meta.to(cache.k.device))
        rows = rows.to(q_nope.device, q_nope.dtype)[:, 0]  # (B, S, rank + rope)
        c_kv, k_pe = rows.split([rank, rows.shape[-1] - rank], dim=-1)
        w_uk, w_uv = w.get("w_uk"), w.get("w_uv")
        if w_uk is None:  # from llama.cpp's k_b and v_b
            heads = q_nope.shape[1]
            w_uk = _dense(w["k_b"], c_kv.dtype).view(heads, rank, -1).mT
            w_uv = _dense(w["v_b"], c_kv.dtype).view(heads, -1, rank)
        k_nope = torch.einsum("bsr,hdr->bhsd", c_kv, w_uk)
        v = torch.einsum("bsr,hvr->bhsv", c_kv, w_uv)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1) * (self.scale * self.qk_dim**0.5)
        return attention(q, k, v, meta.mask, key_valid=meta.valid[:, :meta.end])

    def head(self, w: Weights, h: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(h, w["norm"], self.cfg.rms_norm_eps), w["lm_head"])


# the indexer's tensors (fused names) under self_attn.indexer. in a checkpoint
CHECKPOINT_INDEXER = {"index_q": "wq_b.weight", "index_k": "wk.weight",
                      "index_norm": "k_norm.weight", "index_norm_bias": "k_norm.bias",
                      "index_weights": "weights_proj.weight"}


def _dense(w: torch.Tensor | Packed, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, Packed) else w


def _per_head(x: torch.Tensor, w: torch.Tensor | Packed) -> torch.Tensor:
    """x (B, H, T, K) times each head's block of rows of w (H * N, K), transposed: (B, H, T,
    N). Packed blocks in one call of the integer kernels (where integer activations are set);
    float ones as (W x^T)^T, which reads W twice as fast as x W^T here, or batch invariant
    each row alone (the BLAS sums a product of one row in another order than of several)."""
    B, H, T, K = x.shape
    xh = x.transpose(0, 1).reshape(H, B * T, K)
    if isinstance(w, Packed):
        y = grouped_linear(xh, w)
    elif kernels.batch_invariant():
        y = torch.cat([torch.matmul(w.view(H, -1, K), r.mT).mT for r in xh.split(1, dim=1)], dim=1)
    else:
        y = torch.matmul(w.view(H, -1, K), xh.mT).mT
    return y.reshape(H, B, T, -1).transpose(0, 1)
