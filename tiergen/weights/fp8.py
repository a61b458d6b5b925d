"""FP8 checkpoints with block scales, as DeepSeek-V3/R1 and Kimi K2 ship them: each linear
weight in float8 e4m3 with a float32 ``weight_scale_inv`` per block of (rows, 128 columns)
(``quantization_config.weight_block_size``; the value is e4m3 x scale).

They stay packed: each matrix becomes tiergen's FP8 blocks (:data:`GGMLType.FP8`: 128 e4m3
values after their block's scale, the scale repeated on each row of its block, 8.25 bits a
weight), multiplied by the float kernels, which decode e4m3 as they go. A matrix whose rows
are not whole blocks of 128 columns cannot take that form; it is decoded to float at load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tiergen.config import FP8_BLOCK as BLOCK
from tiergen.weights.packed import Packed, narrow, packed_like
from tiergen.weights.quant import GGMLType

def _pack(w: torch.Tensor, scales: torch.Tensor) -> Packed:
    """e4m3 values (R, C), as bytes or float8, with a scale per row and 128 columns
    (R, C / 128) as FP8 blocks."""
    rows, cols = w.shape
    out = torch.empty(rows, cols // BLOCK, 4 + BLOCK, dtype=torch.uint8)
    out[..., :4] = scales.float().contiguous().view(torch.uint8).view(rows, cols // BLOCK, 4)
    out[..., 4:] = w.view(torch.uint8).contiguous().view(rows, cols // BLOCK, BLOCK)
    return Packed(out.view(-1), (rows, cols), ((GGMLType.FP8, rows),))


def fp8_packed(w: torch.Tensor, scale_inv: torch.Tensor, block_rows: int) -> Packed:
    """An e4m3 matrix (R, C) and its block scales (ceil(R / block_rows), C / 128) as FP8
    blocks (C a multiple of 128)."""
    return _pack(w, scale_inv.float().repeat_interleave(block_rows, dim=0)[:w.shape[0]])


def splits_by_head(block_rows: int, heads: int, nope: int, v: int, rank: int) -> bool:
    """Whether DeepSeek's kv_b (heads * (nope + v), rank) in blocks of ``block_rows`` rows
    gives llama.cpp's k_b exactly (:func:`fp8_per_head`): each 128 rows of a head's nope part
    within one row block, so that transposed they are 128 columns of one scale."""
    if nope % BLOCK or rank % BLOCK:
        return False
    starts = torch.arange(heads)[:, None] * (nope + v) + torch.arange(0, nope, BLOCK)
    return bool((starts // block_rows == (starts + BLOCK - 1) // block_rows).all())


def fp8_per_head(kv_b: Packed, heads: int, nope: int) -> tuple[Packed, Packed]:
    """DeepSeek's kv_b in FP8 blocks as the absorbed attention's matrices in FP8 blocks,
    llama.cpp's k_b (each head's nope rows transposed: heads * rank, nope) and v_b (each
    head's v rows: heads * v, rank), the same values where :func:`splits_by_head` holds (each
    128 nope rows share their scales, which the transposed block takes)."""
    rows, rank = kv_b.shape
    blocks = kv_b.data.view(rows, rank // BLOCK, 4 + BLOCK)
    scales = blocks[..., :4].contiguous().view(torch.float32).view(heads, -1, rank // BLOCK)
    q = blocks[..., 4:].reshape(heads, -1, rank)
    k = q[:, :nope].transpose(1, 2).reshape(-1, nope)
    # row r of a head's k_b, columns of block c: the scale of its nope rows c, value block r
    k_scales = scales[:, :nope:BLOCK].transpose(1, 2).repeat_interleave(BLOCK, dim=1)
    return (_pack(k, k_scales.reshape(-1, nope // BLOCK)),
            _pack(q[:, nope:].reshape(-1, rank), scales[:, nope:].reshape(-1, rank // BLOCK)))


def fp8_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block_rows: int) -> torch.Tensor:
    """The values of an e4m3 matrix with its block scales, as float32 (any shape)."""
    rows, cols = w.shape
    scales = scale_inv.float().repeat_interleave(block_rows, 0)[:rows]
    return w.float() * scales.repeat_interleave(BLOCK, 1)[:, :cols]


class FP8Source:
    """A safetensors checkpoint whose e4m3 matrices (those with a ``weight_scale_inv``) come
    back as FP8 :class:`Packed` blocks; every other tensor as the checkpoint has it."""

    def __init__(self, source, block_rows: int) -> None:
        self.source, self.block_rows = source, block_rows
        self._shapes = source.shapes()
        self._fp8 = {n for n in self._shapes
                     if n.endswith(".weight") and n + "_scale_inv" in self._shapes}
        odd = sorted(n for n in self._fp8 if self._shapes[n][1] % BLOCK)
        if odd:
            logging.getLogger("tiergen").warning(
                "tiergen: %d FP8 matrices (%s, ...) have rows that are not whole blocks of %d; "
                "they are decoded to float at load", len(odd), odd[0], BLOCK)

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: s for n, s in self._shapes.items() if not n.endswith("_scale_inv")}

    def quantized_types(self) -> list[str]:
        return ["FP8"] if self._fp8 else []

    def _packs(self, name: str) -> bool:
        return name in self._fp8 and self._shapes[name][1] % BLOCK == 0

    def meta(self, name: str) -> Packed | None:
        return packed_like(self._shapes[name], GGMLType.FP8) if self._packs(name) else None

    def locate(self, name: str) -> tuple[Path, int, torch.dtype | int, tuple[int, ...]] | None:
        return None if name in self._fp8 else self.source.locate(name)

    def get(self, name: str) -> torch.Tensor | Packed:
        if name not in self._fp8:
            return self.source.get(name)
        w, scale = self.source.get(name), self.source.get(name + "_scale_inv")
        if self._packs(name):
            return fp8_packed(w, scale, self.block_rows)
        return fp8_dequantize(w, scale, self.block_rows)

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor | Packed:
        if name not in self._fp8:
            return self.source.get_slice(name, dim, rows)
        return narrow(self.get(name), dim, rows)
