"""Tensors of a Hugging Face checkpoint: one or many memory-mapped safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tiergen.errors import TiergenError


class SafetensorsSource:
    """Reads tensors by name, lazily, from the shards of a checkpoint directory."""

    def __init__(self, directory: Path) -> None:
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
        self._where = weight_map

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise TiergenError(f"the checkpoint has no tensor {name!r}; "
                               "is it complete and for the architecture in config.json?")
        try:
            return self._files[self._where[name]].get_tensor(name)
        except Exception as e:
            raise TiergenError(f"could not read tensor {name!r} from {self._where[name]} ({e}); "
                               "the file may be corrupt: re-download it") from None
