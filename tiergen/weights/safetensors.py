"""Tensors of a Hugging Face checkpoint: one or many memory-mapped safetensors shards."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from tiergen.errors import TiergenError


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64}


# Checkpoints whose tensors tiergen reads under other names, by config.json's architecture:
# (pattern, replacement) in turn. Qwen3.5 as released holds its text model under
# model.language_model. (its vision tower, model.visual., is never read); Kimi-Linear's
# dense MLPs are block_sparse_moe. where transformers writes them, mlp. in the releases.
RENAMES: dict[str | None, list[tuple[str, str]]] = {
    "Qwen3_5ForConditionalGeneration": [(r"^model\.language_model\.", "model.")],
    "Qwen3_5MoeForConditionalGeneration": [(r"^model\.language_model\.", "model.")],
    "KimiLinearForCausalLM": [(r"\.block_sparse_moe\.(?=(gate|up|down)_proj\.)", ".mlp.")],
}

_READ_CHUNK = 16 << 20  # bytes per read when cutting columns out of a matrix


def _pread(fd: int, out: torch.Tensor, offset: int, path: Path) -> None:
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")
    if os.preadv(fd, [view], offset) != len(view):
        raise TiergenError(f"{path} is shorter than its header says; the checkpoint is "
                           "truncated: re-download it")


class SafetensorsSource:
    """Reads tensors by name, lazily, from the shards of a checkpoint directory."""

    def __init__(self, directory: Path, architecture: str | None = None) -> None:
        """``architecture``: config.json's, whose tensors :data:`RENAMES` may rename."""
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise TiergenError(f"{index} is not a valid safetensors index ({e}); "
                                   "re-download the checkpoint") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) for v in weight_map.values()):
                raise TiergenError(f"{index} is not a valid safetensors index (its weight_map "
                                   "should map tensor names to shard files); re-download the "
                                   "checkpoint")
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in directory.glob("*.safetensors"))
            if not shards:
                raise TiergenError(f"{directory} holds no *.safetensors files; tiergen reads "
                                   "Hugging Face checkpoints in safetensors format or GGUF files")
            weight_map = {}
        self._files = {}
        for shard in shards:
            path = directory / shard
            if not path.exists():
                raise TiergenError(f"shard {path} named in the index is missing; "
                                   "re-download the checkpoint")
            try:
                self._files[shard] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise TiergenError(f"{path} is not a readable safetensors file ({e}); "
                                   "the file may be truncated or corrupt: re-download it") from None
            if not weight_map:
                weight_map.update({k: shard for k in self._files[shard].keys()})
        self._stored = {name: name for name in weight_map}  # name -> name in the checkpoint
        for pattern, name in RENAMES.get(architecture, ()):
            self._stored = {re.sub(pattern, name, k): v for k, v in self._stored.items()}
        self._where = {name: weight_map[stored] for name, stored in self._stored.items()}
        self._paths = {shard: directory / shard for shard in shards}
        self._headers: dict[str, tuple[int, dict]] = {}

    def locate(self, name: str) -> tuple[Path, int, torch.dtype, tuple[int, ...]] | None:
        """Where a tensor's bytes lie: (file, offset, dtype, shape), or None when it is not
        stored there as plain row-major data of a torch dtype."""
        shard = self._where.get(name)
        if shard is None:
            return None
        if shard not in self._headers:
            with open(self._paths[shard], "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                self._headers[shard] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[shard]
        entry = header.get(self._stored[name])
        dtype = _DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if dtype is None:
            return None
        return self._paths[shard], start + entry["data_offsets"][0], dtype, tuple(entry["shape"])

    def has(self, name: str) -> bool:
        return name in self._where

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the shards' headers (nothing is read)."""
        return {name: tuple(self._files[shard].get_slice(self._stored[name]).get_shape())
                for name, shard in self._where.items()}

    def meta(self, name: str) -> None:
        """Nothing is kept packed: every tensor is plain data."""
        return None

    def get(self, name: str) -> torch.Tensor:
        return self._read(name, lambda f: f.get_tensor(self._stored[name]))

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``rows`` of a tensor. Read with plain reads, not
        through the mapping, so that the rest of the tensor (which columns of a row-major
        matrix pass through) never counts in this process's memory."""
        where = self.locate(name)
        if where is None:  # not plain row-major data of a torch dtype
            index = (slice(rows.start, rows.stop),) if dim == 0 else \
                (slice(None), slice(rows.start, rows.stop))
            return self._read(name, lambda f: f.get_slice(self._stored[name])[index].contiguous())
        path, offset, dtype, shape = where
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        fd = os.open(path, os.O_RDONLY)
        try:
            if dim == 0:
                out = torch.empty(len(rows), *shape[1:], dtype=dtype)
                _pread(fd, out, offset + rows.start * row_bytes, path)
                return out
            out = torch.empty(shape[0], len(rows), *shape[2:], dtype=dtype)
            step = max(1, _READ_CHUNK // row_bytes)  # whole rows at a time, columns kept
            buf = torch.empty(min(step, shape[0]), *shape[1:], dtype=dtype)
            for r in range(0, shape[0], step):
                n = min(step, shape[0] - r)
                _pread(fd, buf[:n], offset + r * row_bytes, path)
                out[r:r + n] = buf[:n, rows.start:rows.stop]
            return out
        finally:
            os.close(fd)

    def _read(self, name: str, read) -> torch.Tensor:
        if name not in self._where:
            raise TiergenError(f"the checkpoint has no tensor {name!r}; "
                               "is it complete and for the architecture in config.json?")
        try:
            return read(self._files[self._where[name]])
        except Exception as e:
            raise TiergenError(f"could not read tensor {name!r} from {self._where[name]} ({e}); "
                               "the file may be corrupt: re-download it") from None
