"""gpt-oss's own MXFP4 checkpoints: each layer's routed experts as ``*_blocks`` (E, out,
in / 32, 16) of E2M1 pairs and ``*_scales`` (E, out, in / 32) of E8M0 exponents
(``quantization_config.quant_method`` "mxfp4"), the rest in bfloat16.

The experts stay MXFP4: each is repacked into GGML's MXFP4 blocks (its exponent, then 16
bytes whose low nibbles are the first 16 values and high nibbles the last 16; the checkpoint
pairs neighbours in a byte instead), the same bits. Their gate and up rows alternate in the
checkpoint; they are given expert by expert with gate and up apart, as llama.cpp's GGUF files
have them (``MoEConfig.gate_up_interleaved`` off), and so are their biases.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tiergen.weights.packed import Packed, narrow, packed_like
from tiergen.weights.quant import GGMLType

# the names of one expert's tensors this source gives (gate and up: the even and odd rows
# of the checkpoint's gate_up)
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\."
                     r"(gate|up|down)_proj\.(weight|bias)")


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The checkpoint's blocks (..., in / 32, 16) and scales (..., in / 32) as GGML MXFP4
    bytes (..., in / 32 * 17)."""
    values = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2)  # (..., 32) in order
    qs = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([scales[..., None], qs], dim=-1).flatten(-2)


class MXFP4Source:
    """A gpt-oss safetensors checkpoint with MXFP4 experts, its experts given one by one as
    :class:`Packed` MXFP4 matrices (gate and up apart) and their biases likewise."""

    def __init__(self, source) -> None:
        self.source = source
        self._shapes = self._expert_shapes(source.shapes())
        self._layer: tuple[str, dict[str, torch.Tensor]] | None = None  # the last one read

    def has(self, name: str) -> bool:
        return name in self._shapes

    def quantized_types(self) -> list[str]:
        return ["MXFP4"]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    @staticmethod
    def _expert_shapes(checkpoint: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The checkpoint's shapes with each layer's stacked experts as the names given."""
        out = {}
        for name, shape in checkpoint.items():
            m = re.fullmatch(r"(.*\.experts)\.(gate_up|down)_proj_(blocks|scales|bias)", name)
            if not m:
                out[name] = shape
            elif m.group(3) == "blocks":  # (E, rows, in / 32, 16)
                experts, rows, groups, _ = shape
                parts = ("gate", "up") if m.group(2) == "gate_up" else ("down",)
                n = rows // len(parts)
                for e in range(experts):
                    for part in parts:
                        out[f"{m.group(1)}.{e}.{part}_proj.weight"] = (n, groups * 32)
                        out[f"{m.group(1)}.{e}.{part}_proj.bias"] = (n,)
        return out

    def _stacks(self, prefix: str) -> dict[str, torch.Tensor]:
        """A layer's experts as GGML MXFP4 bytes (E, rows, bytes) and their biases (read once
        for all its experts)."""
        if self._layer is None or self._layer[0] != prefix:
            get = self.source.get
            stacks = {kind: mxfp4_blocks(get(f"{prefix}.{kind}_proj_blocks"),
                                         get(f"{prefix}.{kind}_proj_scales"))
                      for kind in ("gate_up", "down")}
            stacks |= {f"{kind}_bias": get(f"{prefix}.{kind}_proj_bias")
                       for kind in ("gate_up", "down")}
            self._layer = (prefix, stacks)
        return self._layer[1]

    def meta(self, name: str) -> Packed | None:
        m = _EXPERT.fullmatch(name)
        if not m or m.group(4) != "weight":
            return None
        return packed_like(self._shapes[name], GGMLType.MXFP4)

    def locate(self, name: str) -> tuple[Path, int, torch.dtype | int, tuple[int, ...]] | None:
        return None if _EXPERT.fullmatch(name) else self.source.locate(name)

    def get(self, name: str) -> torch.Tensor | Packed:
        m = _EXPERT.fullmatch(name)
        if not m:
            return self.source.get(name)
        prefix, e, part, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        stacks = self._stacks(prefix)
        rows = slice(None) if part == "down" else slice(part == "up", None, 2)
        if kind == "bias":
            return stacks[("down" if part == "down" else "gate_up") + "_bias"][e, rows]
        data = stacks["down" if part == "down" else "gate_up"][e, rows].contiguous()
        shape = (data.shape[0], data.shape[1] // 17 * 32)
        return Packed(data.view(-1), shape, ((GGMLType.MXFP4, shape[0]),))

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor | Packed:
        return narrow(self.get(name), dim, rows) if _EXPERT.fullmatch(name) else \
            self.source.get_slice(name, dim, rows)
