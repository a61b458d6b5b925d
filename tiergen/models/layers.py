"""Shared building blocks. Every function takes its weights as arguments: layers never own
or move tensors, the executor hands them what they need."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tiergen import kernels
from tiergen._platform import cpu_has_fast_bfloat16
from tiergen.config import RopeConfig
from tiergen.weights.packed import Packed, cat_rows  # noqa: F401  (cat_rows: for the families)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in the weights' dtype (ready for their matmul).

    In half precision the residual stream stays float32 and only the matmuls run in the
    weights' dtype: a small model's near-tied logits otherwise flip with the batch shape.
    """
    out = kernels.rms_norm(x, weight, eps)  # float32 on a CPU: one call
    if out is not None:
        return out
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(weight.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, x * (1 + w): float32 throughout, returned in the weights' dtype."""
    out = kernels.rms_norm(x, weight, eps, shift=1.0)
    if out is not None:
        return out
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (normed * (1.0 + weight.float())).to(weight.dtype)


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight.float() * x.float()).sum(-1).to(weight.dtype)


_compiled_gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def use_compiled_gemv(enabled: bool) -> None:
    """Switch single-row CPU matmuls (batch-1 decode) to a compiled multiply-reduce.

    torch.compile turns it into one streaming loop that reads the weights about twice as fast
    as the library GEMV on a CPU; it costs a few seconds of compilation per weight shape on
    first use (cached on disk by torch afterwards). Off by default; the eager path is the same
    arithmetic.
    """
    global _compiled_gemv
    if enabled and _compiled_gemv is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_gemv = torch.compile(_gemv, dynamic=False)
    elif not enabled:
        _compiled_gemv = None


# A CPU without native bfloat16 multiplies bfloat16 matrices at about a GEMV per row. From
# UPCAST_ROWS rows on, widening the weights to float32 a slice at a time into one reused
# buffer (UPCAST_SCRATCH floats, 16 MiB) and multiplying in float32 is faster: on an AVX2 EPYC
# 2.5-2.9x at 32 rows, 6.4-7.1x at 512, even at 8 (benchmarks/bench_widen.py; a fresh float32
# copy of the whole matrix would cost more in page faults than the multiply). The result can
# differ from the bfloat16 kernel's in the last bit of an element.
UPCAST_ROWS = 8
UPCAST_SCRATCH = 1 << 22
_scratch = threading.local()


def _widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = torch.empty(UPCAST_SCRATCH)
    xf = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty(xf.shape[0], weight.shape[0])
    step = max(1, UPCAST_SCRATCH // weight.shape[1])
    for r in range(0, weight.shape[0], step):
        rows = weight[r:r + step]
        if rows.numel() > buf.numel():  # one row wider than the buffer
            buf = _scratch.buf = torch.empty(rows.numel())
        out[:, r:r + len(rows)] = F.linear(xf, buf[:rows.numel()].view(rows.shape).copy_(rows))
    if bias is not None:
        out += bias.float()
    return out.view(*x.shape[:-1], -1).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | Packed, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    if isinstance(weight, Packed):
        from tiergen.kernels import packed_linear

        return packed_linear(x, weight, bias)
    if _compiled_gemv is not None and x.device.type == "cpu" and x.shape[:-1].numel() == 1:
        y = _compiled_gemv(x.reshape(-1), weight).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    if (weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.shape[:-1].numel() >= UPCAST_ROWS and not cpu_has_fast_bfloat16()):
        return _widened_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def embedding(weight: torch.Tensor | Packed, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of an embedding matrix, as ``dtype``."""
    if isinstance(weight, Packed):
        return weight.rows(ids, dtype)
    return weight[ids].to(dtype)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """SwiGLU MLP with gate and up projections fused into one (2*I, H) matrix."""
    gate, up = linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down, down_bias)


def gelu_tanh_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """GeGLU MLP (Gemma): down(gelu_tanh(gate(x)) * up(x)), gate and up fused as in swiglu_mlp."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.gelu(gate, approximate="tanh") * up, down)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in float32 for the configured RoPE variant."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by factor, blend in between.
        old_ctx = rope.original_max_position or 8192
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / rope.factor,
                               torch.where(wavelen < high_wavelen, inv_freq, blended))
    elif rope.kind == "yarn":
        # YaRN: extrapolate high frequencies, interpolate (divide by factor) low ones, with a
        # linear ramp between the dimensions that turn beta_fast and beta_slow times over the
        # original context.
        def dim_of(rotations: float) -> float:
            ctx = rope.original_max_position
            return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        inv_freq = inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)
    return inv_freq


def yarn_mscale(factor: float, mscale: float | None = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * (mscale or 1.0) * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN multiplies cos/sin by (1 for other kinds)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, 1, T, head_dim) for positions (B, T), computed in float32."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, D) in the half-split layout Hugging Face uses."""
    out = kernels.rope(x, cos, sin)  # float32 on a CPU: one call
    if out is not None:
        return out
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, D) whose rotation pairs are adjacent elements (2i, 2i+1), as
    DeepSeek's checkpoints lay them out; cos/sin (B, 1, T, D/2). Computed in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.float(), sin.float()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sparsity: float = 1.0, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention of q (B, H, T, D) over k (B, KVH, S, D), v (B, KVH, S, Dv),
    scaled by D**-0.5 (a layer wanting another scale pre-scales q).

    ``mask`` (B, 1, T, S) is True where a query may attend; None means plain causal.
    Grouped-query attention shares each K/V head among H/KVH query heads without
    repeating K/V in memory. ``sparsity`` < 1 (decode only) keeps that fraction of each
    query's largest attention weights, renormalised, and reads only their V rows.
    ``key_valid`` (B, S), given when the keys are timeline slots [0, S) ending with the
    query's own T tokens (a prompt chunk after the first), says which slots hold tokens; it
    lets a chunk skip the masked path (see ``_chunk_attention``).
    """
    B, H, T, D = q.shape
    kvh = k.shape[1]
    if T == 1 and sparsity == 1 and (out := kernels.decode_attention(q, k, v, mask)) is not None:
        return out  # float32 on a CPU: one call
    if T == 1:
        # Decode: fold the query heads of a group into rows of one batched matmul
        # (B, KVH, G, D) @ (B, KVH, D, S); much faster on CPU than SDPA's kernels.
        scores = torch.matmul(q.view(B, kvh, H // kvh, D), k.transpose(-1, -2)) * D**-0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if sparsity < 1:
            return _sparse_output(probs, v, sparsity).view(B, H, 1, v.shape[-1])
        return torch.matmul(probs.to(q.dtype), v).view(B, H, 1, v.shape[-1])
    gqa = H != kvh
    if key_valid is not None and k.shape[2] > T and q.device.type == "cpu":
        return _chunk_attention(q, k, v, mask, key_valid)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     key_valid: torch.Tensor) -> torch.Tensor:
    """A prompt chunk's attention over the cache before it plus itself, without SDPA's masked
    path (on a CPU it computes every query against every key, and slowly).

    Two flash passes: the chunk against the earlier slots, unmasked (a key-only mask where
    rows are left-padded), with the query heads of a group folded into one head's rows; and
    the chunk against itself, causal. Their outputs are merged by their log-sum-exps:
    softmax over the union of keys = w1 * out1 + w2 * out2 with wi = exp(lse_i - lse).
    """
    B, H, T, D = q.shape
    kvh, S = k.shape[1], k.shape[2]
    group, start = H // kvh, S - T
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    earlier = key_valid[:, :start]
    pad = None
    if not bool(earlier.all()):  # left padding: an additive key mask, broadcast over queries
        pad = torch.zeros(B, 1, 1, start, dtype=q.dtype, device=q.device)
        pad.masked_fill_(~earlier[:, None, None], float("-inf"))
    out1, lse1 = flash(q.reshape(B, kvh, group * T, D), k[:, :, :start], v[:, :, :start],
                       attn_mask=pad)
    out1, lse1 = out1.reshape(B, H, T, -1), lse1.reshape(B, H, T)
    own_k, own_v = k[:, :, start:], v[:, :, start:]
    if group > 1:
        own_k, own_v = own_k.repeat_interleave(group, 1), own_v.repeat_interleave(group, 1)
    if bool(key_valid[:, start:].all()):
        out2, lse2 = flash(q, own_k, own_v, is_causal=True)
    else:  # padding inside the chunk: the step's own causal-and-valid mask
        own = torch.zeros(B, 1, T, T, dtype=q.dtype, device=q.device)
        own.masked_fill_(~mask[..., start:], float("-inf"))
        out2, lse2 = flash(q, own_k, own_v, attn_mask=own)
    lse1, lse2 = lse1.float(), lse2.reshape(B, H, T).float()
    if pad is not None:  # a row with no earlier key gets out1 = 0 and lse1 = 0: make it -inf
        lse1 = lse1.masked_fill(~earlier.any(-1)[:, None, None], float("-inf"))
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse)[..., None], torch.exp(lse2 - lse)[..., None]
    return (out1.float() * w1 + out2.float() * w2).to(q.dtype)


def _sparse_output(probs: torch.Tensor, v: torch.Tensor, sparsity: float) -> torch.Tensor:
    """probs (B, KVH, G, S) float32 over v (B, KVH, S, Dv): the top ceil(sparsity * S) weights
    of each row, renormalised, against only the V rows they pick."""
    valid = int((probs > 0).sum(-1).max())  # keys a query may see (the rest are masked)
    keep = max(1, math.ceil(sparsity * valid))
    weights, idx = probs.topk(keep, dim=-1)  # (B, KVH, G, keep)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    B, kvh, G, _ = idx.shape
    rows = v.gather(2, idx.reshape(B, kvh, G * keep, 1).expand(-1, -1, -1, v.shape[-1]))
    rows = rows.view(B, kvh, G, keep, -1)  # (B, KVH, G, keep, Dv)
    return (weights.to(v.dtype).unsqueeze(-2) @ rows).squeeze(-2)
