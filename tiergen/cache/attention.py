"""Scaled dot-product attention as the layers run it, over the cache's K/V views (below
both the cache, which attends on a layer's behalf, and the model families)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tiergen import kernels


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sparsity: float = 1.0, key_valid: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Scaled dot-product attention of q (B, H, T, D) over k (B, KVH, S, D), v (B, KVH, S, Dv),
    scaled by D**-0.5 (a layer wanting another scale pre-scales q).

    ``mask`` (B, 1, T, S) is True where a query may attend; None means plain causal.
    Grouped-query attention shares each K/V head among H/KVH query heads without
    repeating K/V in memory. ``sparsity`` < 1 (decode only) keeps that fraction of each
    query's largest attention weights, renormalised, and reads only their V rows.
    ``key_valid`` (B, S), given when the keys are timeline slots [0, S) ending with the
    query's own T tokens, says which slots hold tokens; it lets a chunk after the first skip
    the masked path (see ``_chunk_attention``), and the first attend row by row, each row
    over its own tokens as alone (see ``_each_row``). ``sinks`` (H,): gpt-oss's
    attention sinks, one logit per head that joins the softmax but adds no value.
    ``window`` > 0: the keys are consecutive timeline slots ending with the queries' own, of
    which a query sees the last ``window`` up to its own: ``mask`` is that band (and the keys'
    validity), or None where every key is valid.
    """
    B, H, T, D = q.shape
    amx = kernels.on_amx(B) if sinks is None and q.dtype == torch.float32 else None
    out = _on_tiles(q, k, v, mask, key_valid, window, amx) if sinks is None and T > 1 else None
    if out is not None:
        return out
    if amx is not None:
        # a prompt step on the integer path: its long prompts' rows in bfloat16 on AMX tiles,
        # 2.4x faster than in float32 (512 queries over 4,096 keys, SmolLM2's heads, 2-core
        # Xeon); the cache converted once, from its own dtype
        if not bool(amx.all()):
            return kernels.split_rows(amx, lambda r: attention(
                q[r], k[r], v[r], None if mask is None else mask[r], sparsity,
                None if key_valid is None else key_valid[r], window=window))
        half = [kernels.to_bfloat16(t) for t in (q, k, v)]
        return attention(*half, mask, sparsity, key_valid, window=window).float()
    S = k.shape[2]
    if window and mask is None and S > min(T, window):  # the band, for the paths below
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        mask = mask.triu(S - T - window + 1)[None, None]
    kvh = k.shape[1]
    if (sinks is None and T == 1 and sparsity == 1
            and (out := kernels.decode_attention(q, k, v, mask)) is not None):
        return out  # on a CPU: one call
    if k.dtype != q.dtype:  # a float16 cache under float32 queries (see Executor.kv_dtype)
        k, v = k.to(q.dtype), v.to(q.dtype)
    if sinks is not None:
        return _sink_attention(q, k, v, mask, sinks)
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
    if T <= FEW_QUERIES and S > T and q.device.type == "cpu":
        return _few_queries(q, k, v, mask)
    if key_valid is not None and k.shape[2] > T and not window and q.device.type == "cpu":
        return _chunk_attention(q, k, v, mask, key_valid)
    if key_valid is not None and mask is not None and k.shape[2] == T and q.device.type == "cpu":
        return _each_row(q, k, v, mask, key_valid, window)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


# Queries of a step (a speculative step's checks, a prompt's last short chunk) up to which a
# CPU attends as a decode step does: SDPA's flash kernel spent 1.3 ms per call on 5 queries
# over 105 keys (SmolLM2's heads), 4x a whole decode step's attention.
FEW_QUERIES = 16


def _few_queries(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                 ) -> torch.Tensor:
    """Attention of a few queries (the last T of S timeline slots) as the decode path's:
    each group's query heads folded into the rows of one batched product."""
    B, H, T, D = q.shape
    kvh, S = k.shape[1], k.shape[2]
    scores = torch.matmul(q.reshape(B, kvh, H // kvh * T, D), k.transpose(-1, -2)) * D**-0.5
    scores = scores.view(B, kvh, H // kvh, T, S)
    if mask is None:  # causal: the queries are the last T slots
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs.view(B, kvh, H // kvh * T, S), v).view(B, H, T, v.shape[-1])


def _on_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              key_valid: torch.Tensor | None, window: int, amx: torch.Tensor | None
              ) -> torch.Tensor | None:
    """A prompt step's plain causal attention (in a sliding window or not) on AMX tiles
    (``kernels.amx_attention``), for bfloat16 queries and for rows on the tiles (the integer
    path's long prompts, whose float32 q, k, v it rounds itself); None where it does not
    apply. 1.8x torch's flash attention in bfloat16 at SmolLM2's heads of 64, about even at
    Gemma 3's of 256 (benchmarks/bench_amx.py --attention), and a window's band without the
    masked path. ``amx``: the step's rows on the tiles (``kernels.on_amx``)."""
    if q.dtype == torch.float32:
        if amx is None or not bool(amx.all()):
            return None
    elif q.dtype != torch.bfloat16:
        return None
    T, S = q.shape[2], k.shape[2]
    if window:  # the mask: the window's band where every key is valid
        plain = key_valid is None or bool(key_valid.all())
    elif key_valid is None:  # keys: the step's own
        plain = mask is None and S == T
    else:  # keys: timeline slots [0, S) ending with the step's own, all valid: causal
        plain = bool(key_valid.all()) and (S > T or mask is None or _causal(mask[:1]))
    out = kernels.amx_attention(q, k, v, window) if plain else None
    return None if out is None else out.to(q.dtype)


def _each_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              valid: torch.Tensor, window: int = 0) -> torch.Tensor:
    """A prompt's first chunk where rows are left-padded (keys: the chunk's own T slots,
    ``valid`` (B, T) the slots that hold tokens): each row's queries over its own tokens only,
    exactly as the row runs alone, unpadded (plain causal where its mask is). The masked path
    over the padded rows would round otherwise, by where each row's tokens fall in its blocks,
    so a row's numbers would depend on the other prompts of its batch. Rows of one length go
    together: as they come where they are in order of length (offline blocks are), else
    once put in that order; a padding slot's output is 0."""
    B, H, T, _ = q.shape
    lengths = valid.sum(1)
    if not bool((valid == (torch.arange(T, device=valid.device) >= T - lengths[:, None])).all()):
        return attention(q, k, v, mask)  # not left-padded: the masked path
    sizes, counts = torch.unique_consecutive(lengths, return_counts=True)
    order = None
    if len(sizes) > len(lengths.unique()):  # a length in more than one run
        order = torch.argsort(lengths, descending=True, stable=True)
        q, k, v, mask = (t.index_select(0, order) for t in (q, k, v, mask))
        sizes, counts = torch.unique_consecutive(lengths[order], return_counts=True)
    out = q.new_empty(B, H, T, v.shape[-1])
    r0 = 0
    for n, rows in zip(sizes.tolist(), counts.tolist()):
        pad, r = T - n, slice(r0, r0 + rows)
        r0 += rows
        out[r, :, :pad] = 0
        if n:
            own = mask[r, :, pad:, pad:]
            out[r, :, pad:] = attention(q[r, :, pad:], k[r, :, pad:], v[r, :, pad:],
                                        None if _causal(own[:1]) else own, window=window)
    return out if order is None else torch.empty_like(out).index_copy_(0, order, out)


def _causal(mask: torch.Tensor) -> bool:
    """Whether a mask (B, 1, T, T) is plain causal, as an unpadded prompt's is (a row's
    is for every row of one length)."""
    T = mask.shape[-1]
    return bool((mask == torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()).all())


_SINK_QUERIES = 256  # queries per pass of _sink_attention: bounds its scores' memory


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax also holds one logit per head (its sink) that takes weight
    but gives no value, as gpt-oss computes it: the scores spelled out, a few hundred
    queries at a time. A query whose keys are all masked gets all its weight on the sink."""
    B, H, T, D = q.shape
    kvh, S = k.shape[1], k.shape[2]
    if mask is None:  # plain causal: the T queries are the last T of the S keys
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
    sink = sinks.to(torch.float32).view(1, H, 1, 1)
    out = []
    for t in range(0, T, _SINK_QUERIES):
        qt = q[:, :, t:t + _SINK_QUERIES]
        n = qt.shape[2]
        scores = torch.matmul(qt.reshape(B, kvh, H // kvh * n, D), k.transpose(-1, -2))
        scores = (scores.view(B, H, n, S) * D**-0.5).float()
        scores = scores.masked_fill(~mask[:, :, t:t + n], float("-inf"))
        probs = torch.softmax(torch.cat([scores, sink.expand(B, H, n, 1)], dim=-1), dim=-1)
        probs = probs[..., :-1].to(v.dtype).reshape(B, kvh, H // kvh * n, S)
        out.append(torch.matmul(probs, v).view(B, H, n, v.shape[-1]))
    return torch.cat(out, dim=2)


def rows_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               sinks: torch.Tensor, query_valid: torch.Tensor, key_slots: torch.Tensor
               ) -> torch.Tensor:
    """Sink attention, batch invariant: each row's own queries (``query_valid`` (B, T)) over
    the keys they see, in timeline order (``key_slots`` (S,): each key's timeline slot), as
    the row runs alone. Over the padded slots, or a ring's keys in the order of its turn, the
    softmax's sums and the products would fall in other lanes, so a row's numbers would
    depend on the rows beside it. A padding query's output is 0."""
    B, H, T, _ = q.shape
    if mask is None:  # plain causal: the T queries are the last T of the S keys
        S = k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None, None]
    out = q.new_zeros(B, H, T, v.shape[-1])
    for b in range(B):
        queries = query_valid[b].nonzero()[:, 0]
        own = mask[b if len(mask) > 1 else 0, 0, queries]  # (T', S)
        keys = own.any(0).nonzero()[:, 0]
        keys = keys[key_slots[keys].argsort()]
        out[b, :, queries] = _sink_attention(q[b:b + 1, :, queries], k[b:b + 1, :, keys],
                                             v[b:b + 1, :, keys], own[None, None][..., keys],
                                             sinks)[0]
    return out


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


# A sparse-attention step takes its queries a few at a time, so that their index scores
# (heads x keys each) and their gathered rows stay within this many bytes.
SPARSE_PIECE_BYTES = 32 << 20


def index_choice(index_q: torch.Tensor, weights: torch.Tensor, index_k: torch.Tensor,
                 allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """DeepSeek Sparse Attention's lightning indexer: queries (B, T, IH, ID) with head
    weights (B, T, IH) score keys (B, S, ID) as sum_h w_h relu(q_h . k / sqrt(ID)), in
    float32; returns each query's ``topk`` best slots (B, T, topk) among those ``allowed``
    (B, T, S), -1 after them where fewer are allowed. Scores tie where every head's product
    is negative (all 0); a tie across the last place goes to the earlier slots, so that a
    row chooses the same keys whatever padding comes before it. Batch invariant, the sums
    run in a fixed order whatever the shapes and the slots come in their order."""
    B, T, IH, ID = index_q.shape
    S = index_k.shape[1]
    exact = kernels.batch_invariant()
    keys = index_k.float()[:, None, None] if exact else index_k.float().transpose(1, 2)
    piece = max(1, SPARSE_PIECE_BYTES // (4 * B * IH * S * (ID if exact else 1)))
    chosen = []
    for a in range(0, T, piece):
        q = index_q[:, a:a + piece].float()
        if exact:  # (B, t, IH, 1, ID) x (B, 1, 1, S, ID), summed over ID then over heads
            scores = torch.relu((q[..., None, :] * keys).sum(-1) * ID**-0.5)
            scores = (weights[:, a:a + piece, :, None].float() * scores).sum(-2)
        else:  # (B, t IH, ID) x (B, ID, S): the heads of the queries as rows
            t = q.shape[1]
            scores = torch.relu(torch.matmul(q.reshape(B, t * IH, ID), keys) * ID**-0.5)
            scores = torch.matmul(weights[:, a:a + piece, None].float(),
                                  scores.view(B, t, IH, -1))[:, :, 0]
        scores = scores.masked_fill(~allowed[:, a:a + piece], float("-inf"))
        best = _best(scores, min(topk, S))
        chosen.append(best.masked_fill(scores.gather(-1, best) == float("-inf"), -1))
    chosen = torch.cat(chosen, dim=1)
    if chosen.shape[-1] < topk:
        chosen = F.pad(chosen, (0, topk - chosen.shape[-1]), value=-1)
    if exact:  # the slots in their order, none (-1) last
        chosen = chosen.where(chosen >= 0, S).sort(dim=-1).values
        chosen = chosen.masked_fill(chosen == S, -1)
    return chosen


def _best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The slots of the k largest scores (..., S) of each row, a tie across the k-th place
    going to the earlier slots (topk's own order among equals is not defined)."""
    top = scores.topk(min(k + 1, scores.shape[-1]), dim=-1)
    best = top.indices[..., :k]
    if top.values.shape[-1] > k:
        tied = (top.values[..., k - 1] == top.values[..., k]) & (top.values[..., k] > -math.inf)
        if bool(tied.any()):
            best[tied] = scores[tied].sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return best


def chosen_attention(q: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor,
                     allowed: torch.Tensor, values: int) -> torch.Tensor:
    """q (B, H, T, W) over the rows (B, S, W) each query chose, ``chosen`` (B, T, K) slots
    (-1: none) of which count those ``allowed`` (B, T, S), scaled by W**-0.5, the rows'
    first ``values`` numbers as the values: (B, H, T, values). The chosen rows are gathered
    (a few queries at a time, see SPARSE_PIECE_BYTES), so a step reads them and no others.
    Batch invariant, the sums run in a fixed order whatever the shapes."""
    B, H, T, W = q.shape
    K = chosen.shape[-1]
    exact = kernels.batch_invariant()
    piece = max(1, SPARSE_PIECE_BYTES // (4 * B * K * (W + H) * (H if exact else 1)))
    batch = torch.arange(B, device=q.device)[:, None, None]
    out = torch.empty(B, H, T, values, dtype=q.dtype, device=q.device)
    for a in range(0, T, piece):
        slots = chosen[:, a:a + piece]
        picked = rows[batch, slots.clamp(min=0)].to(q.dtype)  # (B, t, K, W)
        ok = allowed[:, a:a + piece].gather(2, slots.clamp(min=0)) & (slots >= 0)
        qs = q[:, :, a:a + piece].transpose(1, 2)  # (B, t, H, W): the heads of a query
        if exact:  # (B, t, H, 1, W) x (B, t, 1, K, W), summed over W
            scores = (qs[..., None, :] * picked[:, :, None]).sum(-1)
        else:
            scores = torch.matmul(qs, picked.mT)  # (B, t, H, K)
        scores = scores.masked_fill(~ok[:, :, None], float("-inf")) * W**-0.5
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        v = picked[..., :values]  # (B, t, K, values)
        o = (probs[..., None] * v[:, :, None]).sum(-2) if exact else torch.matmul(probs, v)
        out[:, :, a:a + piece] = o.transpose(1, 2)
    return out
