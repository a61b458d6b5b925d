"""Group-wise asymmetric quantisation of weights and KV cache (FlexGen-style compression).

Format. The grouped dimension ``dim`` (the last one by default: a weight (out, in) is
grouped along ``in``, a KV cache tensor (..., head_dim) along ``head_dim``) is cut into
groups of ``group_size`` consecutive elements. Each group keeps its minimum ``m`` and
``scale = (max - m) / (2**bits - 1)`` and each element the code
``c = clamp(round((x - m) / scale), 0, 2**bits - 1)``; it comes back as ``c * scale + m``.
A constant group has scale 0 and codes 0, so it comes back exactly.

Layout. Groups are numbered in row-major order of ``x.movedim(dim, -1)``. ``data`` is uint8
of shape (groups, group_size * bits // 8): one code per byte at 8 bits; at 4 bits two codes
per byte, the even-numbered element of a pair in the high nibble, the odd one in the low.
``scale`` and ``minimum`` have shape (groups, 1).

Scale and minimum are float32 (8 bytes per group, 1/8 byte per element at group size 64):
in float16 the minimum alone is off by up to |m| * 2**-11, which exceeds the code step of
a group whose range is small next to its offset, and float16 overflows past 65504.

Error bound: |x - decompress(compress(x))| <= scale / 2 per group, plus float32 rounding
and the final rounding to the original dtype (half a unit in its last place).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

import torch

from tiergen.errors import TiergenError

PARAM_DTYPE = torch.float32  # dtype of scale and minimum


@dataclass
class Compressed:
    """A compressed tensor: its codes, and a scale and minimum per group; ``dim`` is the grouped
    dimension (non-negative)."""

    data: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    group_size: int
    dim: int = -1

    def __post_init__(self) -> None:
        self.dim %= len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.minimum))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Compressed:
        return replace(self, **{k: t.to(device, non_blocking=non_blocking)
                                for k, t in self.tensors().items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The three stored parts, e.g. to write each to its own file."""
        return {"data": self.data, "scale": self.scale, "minimum": self.minimum}

    def to_bytes(self) -> torch.Tensor:
        """The three parts as one flat uint8 tensor (codes, then scales, then minima), to be
        stored and read as a single piece."""
        return torch.cat([t.contiguous().view(torch.uint8).flatten() for t in self.tensors().values()])

    @classmethod
    def from_bytes(cls, flat: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, bits: int,
                   group_size: int) -> Compressed:
        """The inverse of :meth:`to_bytes` (views into ``flat``, no copy)."""
        groups = prod(shape) // group_size
        codes = groups * group_size * bits // 8
        data, scale, minimum = flat.split([codes, 4 * groups, 4 * groups])
        return cls.from_tensors({"data": data.view(groups, -1),
                                 "scale": scale.view(PARAM_DTYPE).view(groups, 1),
                                 "minimum": minimum.view(PARAM_DTYPE).view(groups, 1)},
                                shape, dtype, bits, group_size)

    @classmethod
    def from_tensors(cls, parts: dict[str, torch.Tensor], shape: tuple[int, ...],
                     dtype: torch.dtype, bits: int, group_size: int, dim: int = -1) -> Compressed:
        """The inverse of :meth:`tensors`, given the metadata compress() was called with."""
        dim = _check(tuple(shape), bits, group_size, dim)
        groups = prod(shape) // group_size
        if tuple(parts["data"].shape) != (groups, group_size * bits // 8):
            raise TiergenError(f"quantised data of shape {tuple(parts['data'].shape)} does not "
                               f"hold a {tuple(shape)} tensor at {bits} bits, group size "
                               f"{group_size}; the files do not match the metadata")
        return cls(parts["data"], parts["scale"], parts["minimum"], tuple(shape), dtype,
                   bits, group_size, dim)


def _check(shape: tuple[int, ...], bits: int, group_size: int, dim: int) -> int:
    """Validate the arguments; return ``dim`` made non-negative."""
    if bits not in (4, 8):
        raise TiergenError(f"quantisation supports 4 or 8 bits, not {bits}; use bits=4 or bits=8")
    if group_size < 1 or (bits == 4 and group_size % 2):
        raise TiergenError(f"group size {group_size} is not valid at {bits} bits; use a positive"
                           " even group size such as 64")
    if not -len(shape) <= dim < len(shape):
        raise TiergenError(f"cannot group dimension {dim} of a tensor of shape {shape}; "
                           "pass a dim that exists")
    dim %= len(shape)
    if shape[dim] % group_size:
        raise TiergenError(f"dimension {dim} of shape {shape} has {shape[dim]} elements, not a "
                           f"multiple of the group size {group_size}; choose a group size that "
                           f"divides {shape[dim]} or group another dim")
    return dim


def compressed_nbytes(shape: tuple[int, ...], bits: int, group_size: int, dim: int = -1) -> int:
    """Exact bytes compress() gives for a tensor of this shape, without compressing it."""
    _check(tuple(shape), bits, group_size, dim)
    n = prod(shape)
    return n * bits // 8 + (n // group_size) * 2 * PARAM_DTYPE.itemsize


def compress(x: torch.Tensor, bits: int = 4, group_size: int = 64, dim: int = -1) -> Compressed:
    """Compress floating-point ``x`` group-wise along ``dim`` (see the module docstring)."""
    if not x.is_floating_point():
        raise TiergenError(f"only floating-point tensors can be compressed, not {x.dtype}")
    dim = _check(tuple(x.shape), bits, group_size, dim)
    groups = x.movedim(dim, -1).reshape(-1, group_size).to(torch.float32)
    qmax = 2**bits - 1
    minimum = groups.amin(dim=1, keepdim=True)
    scale = (groups.amax(dim=1, keepdim=True) - minimum) / qmax
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((groups - minimum) / divisor).round_().clamp_(0, qmax).to(torch.uint8)
    if bits == 4:
        pairs = codes.view(codes.shape[0], group_size // 2, 2)
        codes = (pairs[..., 0] << 4) | pairs[..., 1]
    return Compressed(codes.contiguous(), scale, minimum, tuple(x.shape), x.dtype, bits,
                      group_size, dim)


def decompress(q: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the tensor (q.shape, q.dtype, on q.data's device), into ``out`` if given."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.data.device)
    elif tuple(out.shape) != q.shape or out.dtype != q.dtype:
        raise TiergenError(f"out buffer is {tuple(out.shape)} {out.dtype}, but the quantised "
                           f"tensor is {q.shape} {q.dtype}; pass a buffer of that shape and dtype")
    data = q.data
    values = torch.empty(data.shape[0], q.group_size, dtype=torch.float32, device=data.device)
    if q.bits == 4:  # unpack straight into the float32 buffer: no uint8 intermediate
        pairs = values.view(data.shape[0], q.group_size // 2, 2)
        pairs[..., 0].copy_(data >> 4)
        pairs[..., 1].copy_(data & 15)
    else:
        values.copy_(data)
    values.mul_(q.scale).add_(q.minimum)  # faster than a broadcasting addcmul on CPU
    moved = q.shape[:q.dim] + q.shape[q.dim + 1:] + (q.shape[q.dim],)
    out.copy_(values.view(moved).movedim(-1, q.dim))
    return out


def compressed_width(width: int, bits: int, group_size: int) -> int:
    """Bytes per row of ``width`` numbers in the :func:`compress_rows` form."""
    return compressed_nbytes((width,), bits, group_size)


def compress_rows(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Compress x (..., width) row by row into one uint8 tensor (..., compressed_width): each
    row's codes, then its scales, then its minima. Rows stay independent, so a KV cache can
    be written and read a slot range at a time like an ordinary tensor."""
    q = compress(x, bits, group_size)
    lead = x.shape[:-1]
    parts = [q.data.view(*lead, -1), q.scale.view(*lead, -1).view(torch.uint8),
             q.minimum.view(*lead, -1).view(torch.uint8)]
    return torch.cat(parts, dim=-1)


def decompress_rows(rows: torch.Tensor, width: int, bits: int, group_size: int,
                    dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of :func:`compress_rows`: (..., compressed_width) uint8 -> (..., width)
    ``dtype``."""
    lead = rows.shape[:-1]
    codes, groups = width * bits // 8, width // group_size
    data, scale, minimum = rows.split([codes, 4 * groups, 4 * groups], dim=-1)
    n = rows[..., 0].numel()
    q = Compressed(data.reshape(n * groups, -1), scale.contiguous().view(PARAM_DTYPE).reshape(-1, 1),
                   minimum.contiguous().view(PARAM_DTYPE).reshape(-1, 1), (*lead, width), dtype,
                   bits, group_size)
    return decompress(q, out)
