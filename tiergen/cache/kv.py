"""The view of one layer's dense KV cache that a layer receives; the executor owns the storage."""

from __future__ import annotations

import torch

from tiergen import kernels
from tiergen.cache.attention import attention, chosen_attention, index_choice, rows_alone
from tiergen.cache.step import StepMeta


class KVView:
    """One layer's cache buffer ``kv`` (2, B, KVH, capacity, D): K and V, which the layer
    appends to and reads.

    Attention runs where the buffers are: a view over host RAM (``cpu_attention``) takes
    q, k, v there and hands the output back, so the cache never crosses the link.
    """

    def __init__(self, kv: torch.Tensor, sparsity: float = 1.0) -> None:
        self.kv = kv
        self.k, self.v = kv[0], kv[-1]
        self.sparsity = sparsity  # of decode attention (see cache.attention)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
               meta: StepMeta, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Append this step's k, v (B, KVH, T, D) and attend q (B, H, T, D) over the cache
        (``sinks``: per-head logits in the softmax's denominator, see ``attention``)."""
        where, there = q.device, self.k.device
        if there != where:
            q, k, meta = q.to(there), k.to(there), meta.to(there)
            v = None if v is None else v.to(there)
            sinks = None if sinks is None else sinks.to(there)
        return self._attend(q, k, v, meta, sinks).to(where)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMeta,
                sinks: torch.Tensor | None) -> torch.Tensor:
        k_all, v_all = self.update(k, v, meta)
        if sinks is not None and kernels.batch_invariant():  # see rows_alone
            return rows_alone(q, k_all, v_all, meta.mask, sinks,
                              meta.valid[:, meta.start:meta.end],
                              torch.arange(k_all.shape[2], device=q.device))
        return attention(q, k_all, v_all, meta.mask, self.sparsity, meta.valid[:, :meta.end],
                         sinks)

    def decode_slots(self, meta: StepMeta) -> tuple[int, torch.Tensor] | None:
        """For a step of one new token per row that attends to the buffers as they are once
        it is written (what a fused decode layer does itself), or a speculative step's T
        checks: the slot its first token is written to and the mask (B, 1, T, S) of the
        slots each sees. None for any other step."""
        if (meta.start == 0 or (meta.positions.shape[1] != 1 and not meta.checks)
                or self.sparsity < 1):
            return None
        return self._decode_slot(meta)

    def _decode_slot(self, meta: StepMeta) -> tuple[int, torch.Tensor]:
        return meta.start, meta.mask

    def update(self, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's k, v (B, KVH, T, D) and return what the step attends to: its own
        k, v when it starts the sequence, the whole buffer when it decodes one token, else the
        slots up to its end (see StepMeta)."""
        self.k[:, :, meta.start:meta.end] = k
        self.v[:, :, meta.start:meta.end] = v
        if meta.start == 0:
            return k, v
        if k.shape[2] == 1:
            return self.k, self.v
        return self.k[:, :, :meta.end], self.v[:, :, :meta.end]


class RollingKVView(KVView):
    """A sliding-window layer's ring of W slots (B, KVH, W, D): timeline slot s lives at
    index s % W, so memory stays O(W) however long the sequence grows.

    A decode step's keys need no reordering: the mask, built from each ring entry's timeline
    slot, lets a query at slot q see exactly the valid slots in (q - W, q]. A chunk of T > 1
    tokens attends to the ring as it was, oldest first, plus its own T keys, then leaves its
    last W in the ring.
    """

    def __init__(self, kv: torch.Tensor, window: int, sparsity: float = 1.0) -> None:
        super().__init__(kv, sparsity)
        self.window = window

    def _slots(self, upto: int, device: torch.device) -> torch.Tensor:
        """Timeline slot held at each ring index once slots [0, upto) are written (-1: none)."""
        i = torch.arange(self.window, device=device)
        return upto - 1 - (upto - 1 - i) % self.window

    def _mask(self, key_slots: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        q_slots = torch.arange(meta.start, meta.end, device=key_slots.device)[:, None]
        ok = (key_slots >= 0) & (key_slots <= q_slots) & (key_slots > q_slots - self.window)
        seen = meta.valid[:, key_slots.clamp(min=0)]  # (B, S)
        mask = ok[None] & seen[:, None, :]
        mask |= key_slots == q_slots  # a padding query sees itself, so its row stays finite
        return mask[:, None]

    def _decode_mask(self, meta: StepMeta) -> torch.Tensor:
        """The mask of a decode step over the ring once its token is written (the same for
        every layer with this window: made once per step)."""
        key = ("ring", self.window)
        if key not in meta.derived:
            meta.derived[key] = self._mask(self._slots(meta.end, self.k.device), meta)
        return meta.derived[key]

    def _decode_slot(self, meta: StepMeta) -> tuple[int, torch.Tensor]:
        return (meta.end - 1) % self.window, self._decode_mask(meta)

    def decode_slots(self, meta: StepMeta) -> tuple[int, torch.Tensor] | None:
        if self._oldest_first(meta) is not None:
            return None  # the fused layer would take the ring in its own order
        return super().decode_slots(meta)

    def _oldest_first(self, meta: StepMeta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Batch invariant, the ring's indices oldest slot first once a decode step's ring
        has turned, and the decode mask in that order (None before it has, or by default;
        made once per step, as the mask is): its keys then come in the order a row alone
        takes them, whatever turn the padding before the row gave the ring. (The decode
        attention sums a row's slots in the order it is given them.)"""
        if not kernels.batch_invariant() or meta.end <= self.window:
            return None
        key = ("ring oldest first", self.window)
        if key not in meta.derived:
            order = (torch.arange(self.window, device=self.k.device) + meta.end) % self.window
            meta.derived[key] = order, self._decode_mask(meta)[..., order]
        return meta.derived[key]

    def _write(self, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> None:
        keep = min(k.shape[2], self.window)
        idx = torch.arange(meta.end - keep, meta.end, device=k.device) % self.window
        self.k[:, :, idx] = k[:, :, -keep:].to(self.k.dtype)  # (a float16 cache, see kv_dtype)
        self.v[:, :, idx] = v[:, :, -keep:].to(self.v.dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMeta,
                sinks: torch.Tensor | None) -> torch.Tensor:
        alone = sinks is not None and kernels.batch_invariant()  # see rows_alone
        queries = meta.valid[:, meta.start:meta.end]
        if k.shape[2] == 1:  # decode: write first, then the ring is exactly the window
            self._write(k, v, meta)
            if alone:
                return rows_alone(q, self.k, self.v, self._decode_mask(meta), sinks, queries,
                                  self._slots(meta.end, q.device))
            keys, values, mask = self.k, self.v, self._decode_mask(meta)
            if (oldest := self._oldest_first(meta)) is not None:
                order, mask = oldest
                keys, values = keys[:, :, order], values[:, :, order]
            return attention(q, keys, values, mask, self.sparsity, sinks=sinks)
        # a prompt step: the ring's keys that its queries may see, oldest first, then its own
        seen = min(meta.start, self.window)
        slots = torch.arange(meta.start - seen, meta.end, device=q.device)
        keys = (k, v)
        if seen:
            ring = slots[:seen] % self.window
            keys = (torch.cat([self.k[:, :, ring], k], dim=2),
                    torch.cat([self.v[:, :, ring], v], dim=2))
        valid = meta.valid[:, meta.start - seen:meta.end]
        mask = None if not alone and bool(valid.all()) else self._mask(slots, meta)
        out = (rows_alone(q, *keys, mask, sinks, queries, slots) if alone
               else attention(q, *keys, mask, key_valid=valid, sinks=sinks, window=self.window))
        self._write(k, v, meta)
        return out


class LatentKVView(KVView):
    """A multi-head latent attention layer's cache (1, B, 1, capacity, rank + rope): one row
    [c_kv | k_pe] per token, the normalised KV latent and the rotated shared RoPE key.

    With W_UK absorbed into the query (q = [q_nope W_UK | q_pe], one "head" per query head)
    the score against a row is q_nope W_UK . c_kv + q_pe . k_pe, the sum of the two products,
    and the value is c_kv itself: MQA over the rows, whose output (B, H, T, rank) the layer
    turns into values with W_UV. No per-head key or value is ever built.
    """

    def __init__(self, kv: torch.Tensor, rank: int, sparsity: float = 1.0) -> None:
        super().__init__(kv, sparsity)
        self.rank = rank

    def update(self, k: torch.Tensor, v: torch.Tensor | None, meta: StepMeta
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's latent rows k (B, 1, T, rank + rope); return the rows attended."""
        self.k[:, :, meta.start:meta.end] = k
        rows = k if meta.start == 0 else self.k if k.shape[2] == 1 else self.k[:, :, :meta.end]
        return rows, rows

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                meta: StepMeta, sinks: torch.Tensor | None) -> torch.Tensor:
        rows, _ = self.update(k, None, meta)
        return self._dense(q, rows, meta)

    def _dense(self, q: torch.Tensor, rows: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        # values are the first `rank` numbers of each row: attend with the whole row as value
        # (contiguous, no copy where the row holds no indexer key) and drop the RoPE part of
        # the output
        rows = rows[..., :q.shape[-1]]
        return attention(q, rows, rows, meta.mask, self.sparsity,
                         meta.valid[:, :meta.end])[..., :self.rank]

    def attend_indexed(self, q: torch.Tensor, k: torch.Tensor, meta: StepMeta, topk: int,
                       index: tuple[torch.Tensor, torch.Tensor] | None = None,
                       chosen: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse attention (DeepSeek-V3.2): store this step's rows k (B, 1, T, rank + rope +
        the indexer's key) and attend each query of q (B, H, T, rank + rope) to the ``topk``
        cached rows that ``index`` (the indexer's queries (B, T, IH, ID) and head weights
        (B, T, IH)) scores best, or to those ``chosen`` by an earlier layer, or to all while
        the context is no longer than ``topk`` (then dense attention, as the choice would be
        every row). Returns the output (B, H, T, rank) and the choice (B, T, topk), None
        where it was every row. Where the cache is in host RAM, only the indexer's keys and
        the chosen rows are read."""
        where, there = q.device, self.k.device
        moved = [t if t is None else t.to(there) for t in (q, k, chosen, *(index or ()))]
        q, k, chosen, index = moved[0], moved[1], moved[2], moved[3:] or None
        meta = meta.to(there) if there != where else meta
        rows, _ = self.update(k, None, meta)
        S, W = meta.end, q.shape[-1]
        if S <= topk and not kernels.batch_invariant():  # (batch invariant: as any context)
            return self._dense(q, rows, meta).to(where), None
        rows = rows[:, 0, :S]  # (B, S, width)
        if meta.mask is not None:
            allowed = meta.mask[:, 0, :, :S]
        else:  # no padding: causal
            slots = torch.arange(S, device=there)
            allowed = (slots[None] <= slots[meta.start:meta.end, None])[None].expand(
                len(rows), -1, -1)
        if chosen is None:  # (a shared layer's choice is None where every row was chosen)
            chosen = index_choice(*index, rows[..., W:], allowed, topk)
        return chosen_attention(q, rows[..., :W], chosen, allowed, self.rank).to(where), chosen


class StateView:
    """A linear-attention layer's state (1, B, 1, 1, numel), float32: per row, its
    convolution's last inputs and its delta rule's matrices, after the last token written
    (see ``LinearAttentionConfig``). The layer reads it and writes it back whole each step;
    the executor places and moves it as a one-slot cache."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.k = self.v = kv[0]

    @property
    def rows(self) -> torch.Tensor:
        """The state (B, numel), in place."""
        return self.kv[0, :, 0, 0]
