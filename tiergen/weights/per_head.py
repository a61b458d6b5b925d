"""DeepSeek's kv_b_proj (heads * (nope + v), rank) served as llama.cpp's GGUF files split it:
k_b_proj (each head's nope rows transposed: heads * rank, nope) and v_b_proj (heads * v,
rank), the absorbed attention's own matrices, so that it multiplies them packed: quantised
at load (``quantize=``), or in FP8 blocks (DeepSeek's FP8 checkpoints, where
:func:`tiergen.weights.fp8.splits_by_head` holds)."""

from __future__ import annotations

from pathlib import Path

import torch

from tiergen.weights.packed import Packed, narrow, packed_like


class PerHeadKvB:
    """``source`` with every layer's kv_b_proj also served as k_b_proj and v_b_proj."""

    def __init__(self, source, heads: int, nope: int) -> None:
        self.source, self.heads, self.nope = source, heads, nope
        self._shapes = source.shapes()
        self._split: dict[str, tuple[str, int]] = {}  # k_b/v_b name -> (its kv_b, 0 or 1)
        for name in [n for n in self._shapes if n.endswith("self_attn.kv_b_proj.weight")]:
            rows, rank = self._shapes[name]
            for part, kind, shape in ((0, "k_b", (heads * rank, nope)),
                                      (1, "v_b", (rows - heads * nope, rank))):
                self._split[name.replace("kv_b", kind)] = (name, part)
                self._shapes[name.replace("kv_b", kind)] = shape

    def has(self, name: str) -> bool:
        return name in self._split or self.source.has(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def quantized_types(self) -> list[str]:
        return getattr(self.source, "quantized_types", list)()

    def get(self, name: str) -> torch.Tensor | Packed:
        if name not in self._split:
            return self.source.get(name)
        kv_b, part = self._split[name]
        w = self.source.get(kv_b)
        if isinstance(w, Packed):
            from tiergen.weights.fp8 import fp8_per_head

            return fp8_per_head(w, self.heads, self.nope)[part]
        w = w.view(self.heads, -1, w.shape[-1])
        if part == 0:
            return w[:, :self.nope].transpose(1, 2).reshape(-1, self.nope)
        return w[:, self.nope:].reshape(-1, w.shape[-1])

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor | Packed:
        if name not in self._split:
            return self.source.get_slice(name, dim, rows)
        return narrow(self.get(name), dim, rows)

    def meta(self, name: str) -> Packed | None:
        if name not in self._split:
            return self.source.meta(name)
        kv_b = self.source.meta(self._split[name][0])
        return None if kv_b is None else packed_like(self._shapes[name], kv_b.parts[0][0])

    def locate(self, name: str) -> tuple[Path, int, torch.dtype | int, tuple[int, ...]] | None:
        return None if name in self._split else self.source.locate(name)
