"""Packed weights: a matrix kept in a checkpoint's quantised blocks (GGML formats) on every
tier, moved as those bytes, and multiplied without inflating it (:mod:`tiergen.kernels`).

A :class:`Packed` is one flat uint8 tensor plus its layout: the matrix's (out, in) shape and
its row segments ("parts"), each a run of rows in one block type. A fused matrix such as
q/k/v may join rows of different types (a Q4_K_M file keeps V in Q6_K); a part never splits
a row, since blocks run along the rows.

Worked example: q (576, 576) in Q4_K and k, v (192, 576) in Q6_K fuse into
``Packed(data, (960, 576), ((Q4_K, 576), (Q6_K, 384)))``; Q4_K takes 144 bytes per 256
values, so the first part is 576 * 576 / 256 * 144 = 186,624 bytes, the second 384 * 576 /
256 * 210 = 181,440, and ``data`` holds 368,064 bytes.

Routed experts stack E matrices of one layout into a (E, out, in) Packed: ``parts`` describes
one expert's rows and ``data`` holds the E experts' bytes one after the other; ``packed[e]``
is expert e's matrix, a view of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from tiergen.errors import TiergenError
from tiergen.weights.quant import (GGMLType, dequantize, ggml_type_name, ggml_type_sizes,
                                   tensor_nbytes)

# Block types kept packed (and multiplied packed); others are dequantised at load.
PACKED_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
                          GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
                          GGMLType.MXFP4, GGMLType.FP8})
# ... of which the integer kernels take these (FP8 values are no small integers: float path)
INTEGER_TYPES = PACKED_TYPES - {GGMLType.FP8}

Parts = tuple[tuple[int, int], ...]  # (ggml type, rows) in row order


@dataclass
class Packed:
    """A (out, in) matrix, or a stack of them (E, out, in), stored as GGML blocks; see the
    module docstring."""

    data: torch.Tensor  # flat uint8
    shape: tuple[int, ...]
    parts: Parts  # of one matrix of a stack
    # Resident weights may keep the integer kernels' tiles for products of a few rows
    # (kernels.keep_tiles): tiles, once built, and whether they may be.
    tiles: torch.Tensor | None = field(default=None, repr=False, compare=False)
    may_keep_tiles: bool = field(default=False, repr=False, compare=False)
    # the C kernels' description of it without tiles (kernels.matrix_descriptor), kept once
    # made for a matrix the integer kernels take
    descriptor: object = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.shape = tuple(self.shape)
        if sum(rows for _, rows in self.parts) != self.shape[-2]:
            raise TiergenError(f"packed parts {self.parts} do not add up to {self.shape[-2]} rows")
        if self.data.numel() != packed_nbytes(self.shape, self.parts):
            raise TiergenError(f"packed matrix {self.shape} of {self.type_names} needs "
                               f"{packed_nbytes(self.shape, self.parts)} bytes, got "
                               f"{self.data.numel()}; the data is corrupt")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def type_names(self) -> str:
        return "+".join(ggml_type_name(t) for t, _ in self.parts)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Packed:
        return Packed(self.data.to(device, non_blocking=non_blocking), self.shape, self.parts)

    def pin_memory(self) -> Packed:
        return Packed(self.data.pin_memory(), self.shape, self.parts)

    def __getitem__(self, e: int) -> Packed:
        """Matrix e of a stack (a view of its bytes)."""
        if len(self.shape) != 3:
            raise TypeError("only a stack of packed matrices (E, out, in) can be indexed")
        return Packed(self.data.view(self.shape[0], -1)[e], self.shape[1:], self.parts)

    def with_data(self, data: torch.Tensor) -> Packed:
        """The same layout over other storage (a buffer this matrix was read into)."""
        return Packed(data, self.shape, self.parts)

    def segments(self) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(ggml type, first row, rows, that part's bytes) of each part."""
        for ggml_type, row, rows, start, stop in layout(self.shape, self.parts):
            yield ggml_type, row, rows, self.data[start:stop]

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """The matrix (or stack) as ``dtype`` values (into ``out`` if given)."""
        if out is None:
            out = torch.empty(self.shape, dtype=dtype, device=self.device)
        if len(self.shape) == 3:
            for e in range(self.shape[0]):
                self[e].dequantize(out=out[e])
            return out
        for ggml_type, row, rows, raw in self.segments():
            out[row:row + rows] = dequantize(raw, ggml_type, (rows, self.shape[1]), out.dtype)
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (any shape) dequantised: an embedding lookup, ids.shape + (in,)."""
        flat = ids.reshape(-1)
        if len(self.parts) == 1:  # (one block type: no search for each type's rows)
            (ggml_type, row, rows, raw), = self.segments()
            return dequantize(raw.view(rows, -1)[flat].reshape(-1), ggml_type,
                              (flat.numel(), self.shape[1]), dtype).view(*ids.shape, -1)
        out = torch.empty(flat.numel(), self.shape[1], dtype=dtype, device=self.device)
        for ggml_type, row, rows, raw in self.segments():
            hit = ((flat >= row) & (flat < row + rows)).nonzero().squeeze(1)
            if hit.numel():
                per_row = raw.view(rows, -1)[flat[hit] - row].reshape(-1)
                out[hit] = dequantize(per_row, ggml_type, (hit.numel(), self.shape[1]), dtype)
        return out.view(*ids.shape, self.shape[1])

    def narrow(self, dim: int, start: int, stop: int) -> Packed | None:
        """Rows (dim 0) or columns (dim 1) [start, stop) as a packed matrix: rows are a view
        of this one's bytes; columns a copy of whole blocks, or None where the bounds cut
        through a block (the caller then dequantises)."""
        if dim == 0:
            pieces, parts = [], []
            for ggml_type, row, rows, raw in self.segments():
                a, b = max(start, row), min(stop, row + rows)
                if a < b:
                    per_row = raw.numel() // rows
                    pieces.append(raw[(a - row) * per_row:(b - row) * per_row])
                    parts.append((ggml_type, b - a))
            data = pieces[0] if len(pieces) == 1 else _cat(pieces)
            return Packed(data, (stop - start, self.shape[1]), tuple(parts))
        pieces = []
        for ggml_type, _, rows, raw in self.segments():
            block, nbytes = ggml_type_sizes(ggml_type)
            if start % block or (stop % block and stop != self.shape[1]):
                return None
            blocks = raw.view(rows, self.shape[1] // block, nbytes)
            pieces.append(blocks[:, start // block:-(-stop // block)].reshape(-1))
        return Packed(_cat(pieces), (self.shape[0], stop - start), self.parts)


def narrow(t: torch.Tensor | Packed, dim: int, rows: range) -> torch.Tensor | Packed:
    """Rows (dim 0) or columns (dim 1) ``rows`` of a matrix; a packed one stays packed
    unless the bounds cut through its blocks, when it is decoded to float32."""
    if isinstance(t, Packed):
        return t.narrow(dim, rows.start, rows.stop) or \
            t.dequantize().narrow(dim, rows.start, len(rows))
    return t.narrow(dim, rows.start, len(rows)).contiguous()


@lru_cache(maxsize=4096)
def layout(shape: tuple[int, int], parts: Parts) -> tuple[tuple[int, int, int, int, int], ...]:
    """(ggml type, first row, rows, first byte, end byte) of each part (cached: the kernels
    ask for it at every product)."""
    out, row, byte = [], 0, 0
    for ggml_type, rows in parts:
        n = tensor_nbytes(ggml_type, rows * shape[1])
        out.append((ggml_type, row, rows, byte, byte + n))
        row, byte = row + rows, byte + n
    return tuple(out)


def packed_nbytes(shape: Sequence[int], parts: Parts) -> int:
    """Bytes of a packed matrix, or of a stack of them."""
    spans = layout(tuple(shape[-2:]), parts)
    return (spans[-1][4] if spans else 0) * math.prod(shape[:-2])


def stack(matrices: Sequence[torch.Tensor | Packed]) -> torch.Tensor | Packed:
    """Stack matrices of one shape into (E, out, in) (routed experts), packed if they all are
    and share one layout, else as floats."""
    if all(isinstance(m, torch.Tensor) for m in matrices):
        return torch.stack(list(matrices))
    if all(isinstance(m, Packed) for m in matrices) and len({m.parts for m in matrices}) == 1:
        first = matrices[0]
        return Packed(_cat([m.data for m in matrices]), (len(matrices), *first.shape),
                      first.parts)
    dtype = next((m.dtype for m in matrices if isinstance(m, torch.Tensor)), torch.float32)
    return torch.stack([m.dequantize(dtype) if isinstance(m, Packed) else m for m in matrices])


def cat_rows(matrices: Sequence[torch.Tensor | Packed]) -> torch.Tensor | Packed:
    """Stack matrices along their rows (fusing q/k/v or gate/up), packed or not. A mix of
    packed and float matrices is joined as floats."""
    if all(isinstance(m, torch.Tensor) for m in matrices):
        return _cat(list(matrices))
    if not all(isinstance(m, Packed) for m in matrices):
        dtype = next(m.dtype for m in matrices if isinstance(m, torch.Tensor))
        return torch.cat([m.dequantize(dtype) if isinstance(m, Packed) else m for m in matrices])
    if len({m.shape[1] for m in matrices}) != 1:
        raise TiergenError("cannot stack packed matrices with different row lengths")
    parts: list[tuple[int, int]] = []
    for m in matrices:
        for ggml_type, rows in m.parts:
            if parts and parts[-1][0] == ggml_type:
                parts[-1] = (ggml_type, parts[-1][1] + rows)
            else:
                parts.append((ggml_type, rows))
    data = _joined([m.data for m in matrices])
    rows = sum(m.shape[0] for m in matrices)
    return Packed(data, (rows, matrices[0].shape[1]), tuple(parts))


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of packed matrices one after the other: a view where they already lie back
    to back in one buffer (a GGUF's gate and up, usually), else a copy."""
    first = tensors[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    end = offset
    for t in tensors:
        if (t.dim() != 1 or not t.is_contiguous() or t.storage_offset() != end
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return _cat(tensors)
        end += t.numel()
    if len(tensors) == 1:
        return first
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, offset,
                                                                       (end - offset,))


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without running torch's meta kernels on meta tensors (planning layouts):
    their first use loads some 70 MB of Python."""
    first = tensors[0]
    if first.device.type != "meta":
        return torch.cat(tensors)
    return torch.empty(sum(t.shape[0] for t in tensors), *first.shape[1:], dtype=first.dtype,
                       device="meta")


def packed_like(shape: Sequence[int], ggml_type: int, device: torch.device | str = "meta"
                ) -> Packed:
    """An empty packed matrix (on the meta device by default: a layout with no storage)."""
    rows, cols = shape
    nbytes = tensor_nbytes(ggml_type, rows * cols)
    return Packed(torch.empty(nbytes, dtype=torch.uint8, device=device), (rows, cols),
                  ((ggml_type, rows),))
