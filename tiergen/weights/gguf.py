"""A fast GGUF (v2/v3) reader.

gguf-py's GGUFReader builds a numpy object for every element of every metadata array, which
takes seconds for a tokenizer's vocabulary. Here the header is walked once with ``struct``:
numeric arrays become one ``np.frombuffer`` each and string arrays a ``list[str]``. Tensor data
stays in a memory map and is only read (and dequantised) on request.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from tiergen.errors import TiergenError
from tiergen.weights.quant import (OWN_TYPES, dequantize, ggml_type_name, ggml_type_sizes,
                                   tensor_nbytes)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4

# GGUF metadata value types (gguf.GGUFValueType)
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, struct.Struct] = {
    0: struct.Struct("<B"),  # uint8
    1: struct.Struct("<b"),  # int8
    2: struct.Struct("<H"),  # uint16
    3: struct.Struct("<h"),  # int16
    4: struct.Struct("<I"),  # uint32
    5: struct.Struct("<i"),  # int32
    6: struct.Struct("<f"),  # float32
    7: struct.Struct("<?"),  # bool
    10: struct.Struct("<Q"),  # uint64
    11: struct.Struct("<q"),  # int64
    12: struct.Struct("<d"),  # float64
}
_ARRAY_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def torch_shape(gguf_dims: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-varying first (ne[0] = row length); torch is the reverse."""
    return tuple(reversed(gguf_dims))


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    offset: int  # absolute position of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)


class _FormatError(Exception):
    """The header is malformed; the message says how (without the path, added by GGUFFile)."""


class _Truncated(_FormatError):
    pass


class _HeaderParser:
    """Walks the GGUF header in a buffer, keeping the current position."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def _advance(self, n: int) -> int:
        start = self.pos
        if start + n > self.size:
            raise _Truncated(f"needs {n} bytes at offset {start}")
        self.pos = start + n
        return start

    def u32(self) -> int:
        return _U32.unpack_from(self.buf, self._advance(4))[0]

    def u64(self) -> int:
        return _U64.unpack_from(self.buf, self._advance(8))[0]

    def string(self) -> str:
        n = self.u64()
        start = self._advance(n)
        return str(self.buf[start : start + n], "utf-8", "replace")

    def value(self, vtype: int) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return scalar.unpack_from(self.buf, self._advance(scalar.size))[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise _FormatError(f"unknown metadata value type {vtype}")

    def array(self) -> Any:
        vtype = self.u32()
        count = self.u64()
        dtype = _ARRAY_DTYPES.get(vtype)
        if dtype is not None:
            start = self._advance(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).copy()
        if vtype == _STRING:
            return self.string_array(count)
        if vtype == _ARRAY:
            return [self.array() for _ in range(count)]
        raise _FormatError(f"unknown metadata array element type {vtype}")

    def string_array(self, count: int) -> list[str]:
        # The hot loop for tokenizer vocabularies and merges: locals only, no method calls.
        buf, pos, size = self.buf, self.pos, self.size
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated(f"string array runs past offset {pos}")
            n = unpack(buf, pos)[0]
            pos += 8
            end = pos + n
            if end > size:
                raise _Truncated(f"string of {n} bytes at offset {pos}")
            append(str(buf[pos:end], "utf-8", "replace"))
            pos = end
        self.pos = pos
        return out


class GGUFFile:
    """A GGUF model file: its metadata, its tensor list, and dequantised reads of its tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            raise TiergenError(f"GGUF file {self.path} not found; check the path") from None
        except OSError as e:
            raise TiergenError(
                f"cannot open GGUF file {self.path}: {e.strerror}; pass a readable .gguf file"
            ) from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise self._error(f"it is only {size} bytes long, too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self.metadata, self.tensors = self._parse(buf)
            # Copy-on-write rather than read-only, so tensors that alias the map can be modified
            # in place by their users (changing the process's copy, never the file).
            self._data: np.memmap | None = np.memmap(f, dtype=np.uint8, mode="c")
            self._whole: torch.Tensor | None = None  # the map as one tensor, made on first use
        self._check_tensor_ranges(size)

    @property
    def data(self) -> np.memmap | None:
        """The map over the whole file (None once closed)."""
        return self._data

    def drop_vocabulary(self) -> None:
        """Forget the tokenizer's arrays once a Tokenizer holds them: as Python strings they
        take about 10 MB of resident memory for a 49k-token vocabulary."""
        for key in [k for k, v in self.metadata.items()
                    if k.startswith("tokenizer.ggml.") and isinstance(v, (list, np.ndarray))]:
            del self.metadata[key]

    def _error(self, what: str) -> TiergenError:
        return TiergenError(f"cannot read GGUF file {self.path}: {what}")

    def _parse(self, buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        if buf[:4] != GGUF_MAGIC:
            raise self._error(
                f"it does not start with the GGUF magic (found {buf[:4]!r}); "
                "pass a .gguf model file"
            )
        p = _HeaderParser(buf)
        p.pos = 4
        where = "the header"
        try:
            version = p.u32()
            if version & 0xFFFF == 0 and version >> 24 in SUPPORTED_VERSIONS:
                raise self._error(
                    "it is a big-endian GGUF file; tiergen reads only little-endian ones "
                    "(convert the model again on or for a little-endian machine)"
                )
            if version not in SUPPORTED_VERSIONS:
                raise self._error(
                    f"unsupported GGUF version {version} (tiergen reads versions "
                    f"{', '.join(map(str, SUPPORTED_VERSIONS))}); "
                    "re-convert the model with a current llama.cpp"
                )
            n_tensors = p.u64()
            n_kv = p.u64()
            metadata: dict[str, Any] = {}
            for i in range(n_kv):
                where = f"metadata entry {i}"
                key = p.string()
                where = f"metadata key {key!r}"
                if key in metadata:
                    raise _FormatError("the key appears twice")
                metadata[key] = p.value(p.u32())
            raw_tensors = []
            for i in range(n_tensors):
                where = f"tensor info {i}"
                name = p.string()
                where = f"tensor info {name!r}"
                n_dims = p.u32()
                if n_dims > GGML_MAX_DIMS:
                    raise _FormatError(f"{n_dims} dimensions (at most {GGML_MAX_DIMS} allowed)")
                dims = [p.u64() for _ in range(n_dims)]
                raw_tensors.append((name, dims, p.u32(), p.u64()))
        except _Truncated as e:
            raise self._error(
                f"the file is truncated: reading {where} ran past its end ({e}); "
                "download or convert it again"
            ) from None
        except _FormatError as e:
            raise self._error(f"malformed {where}: {e}; the file is corrupt") from None

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise self._error(
                f"general.alignment is {alignment!r}, not a power of two; the file is corrupt"
            )
        data_offset = -(-p.pos // alignment) * alignment
        tensors = {}
        for name, dims, ggml_type, offset in raw_tensors:
            tensors[name] = self._tensor_info(name, dims, ggml_type, offset, alignment, data_offset)
        if len(tensors) != len(raw_tensors):
            raise self._error("a tensor name appears twice; the file is corrupt")
        return metadata, tensors

    def _tensor_info(
        self,
        name: str,
        dims: list[int],
        ggml_type: int,
        offset: int,
        alignment: int,
        data_offset: int,
    ) -> GGUFTensorInfo:
        try:
            if ggml_type in OWN_TYPES:  # tiergen's own: not a type of any GGUF file
                raise TiergenError(f"unknown GGML tensor type id {ggml_type}; the file is "
                                   "corrupt")
            block_size = ggml_type_sizes(ggml_type)[0]
        except TiergenError as e:
            raise self._error(f"tensor {name!r}: {e}") from None
        if dims and dims[0] % block_size:
            raise self._error(
                f"tensor {name!r} has rows of {dims[0]} values, not a multiple of the "
                f"{ggml_type_name(ggml_type)} block size {block_size}; the file is corrupt"
            )
        if offset % alignment:
            raise self._error(
                f"tensor {name!r} data offset {offset} is not aligned to {alignment} bytes; "
                "the file is corrupt"
            )
        nbytes = tensor_nbytes(ggml_type, math.prod(dims))
        return GGUFTensorInfo(name, torch_shape(dims), ggml_type, data_offset + offset, nbytes)

    def _check_tensor_ranges(self, size: int) -> None:
        for t in self.tensors.values():
            if t.offset + t.nbytes > size:
                raise self._error(
                    f"the file is truncated: tensor {t.name!r} needs bytes {t.offset}.."
                    f"{t.offset + t.nbytes} but the file has {size}; download or convert it again"
                )

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    def _lookup(self, name: str) -> tuple[GGUFTensorInfo, np.ndarray]:
        if self._data is None:
            raise TiergenError(f"GGUF file {self.path} is closed; open it again to read {name!r}")
        info = self.tensors.get(name)
        if info is None:
            raise TiergenError(f"GGUF file {self.path} has no tensor {name!r}")
        return info, self._data[info.offset : info.offset + info.nbytes].view(np.ndarray)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the file (no copy)."""
        view = self._lookup(name)[1]
        view.flags.writeable = False
        return view

    def packed_bytes(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor backed by the map (copy-on-write: changing
        it never changes the file). Every tensor is a slice of one tensor over the whole map,
        so tensors that lie back to back join without a copy (``packed.cat_rows``)."""
        info, _ = self._lookup(name)
        if self._whole is None:
            self._whole = torch.from_numpy(self._data.view(np.ndarray))
        return self._whole[info.offset:info.offset + info.nbytes]

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantised to ``dtype``, in torch order.

        F32/F16/BF16 data already in ``dtype`` is returned without a copy, backed by the map.
        """
        info, data = self._lookup(name)
        try:
            return dequantize(torch.from_numpy(data), info.ggml_type, info.shape, dtype)
        except TiergenError as e:
            raise TiergenError(
                f"cannot read tensor {name!r} of GGUF file {self.path}: {e}"
            ) from None

    def close(self) -> None:
        """Drop the map; tensors already read stay valid (they keep their pages alive)."""
        self._data = self._whole = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
