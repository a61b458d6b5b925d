"""Dequantisation of GGML tensor data in vectorised torch.

Each supported type has a function that turns a ``(n_blocks, type_size)`` uint8 tensor of raw
blocks into ``(n_blocks, block_size)`` values. The bit layouts and the order of float
operations follow llama.cpp's ``ggml-quants.c`` (as mirrored by gguf-py's ``gguf/quants.py``),
so results match the reference bit for bit.
"""

import math
from collections.abc import Callable
from enum import IntEnum

import torch

from tiergen.errors import TiergenError


class GGMLType(IntEnum):
    """GGML tensor type ids (ggml.h ``enum ggml_type``, gguf-py's ``GGMLQuantizationType``)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    # tiergen's own, never in a GGUF file: FP8 (e4m3) checkpoints with block scales (DeepSeek,
    # Kimi), as blocks of 128 e4m3 values after their float32 scale
    FP8 = 1024


GGML_TYPE_NAMES: dict[int, str] = {t.value: t.name for t in GGMLType}
OWN_TYPES = frozenset({GGMLType.FP8})  # tiergen's block types, which no GGUF file holds

QK_K = 256  # elements per K-quant super-block
_K_SCALE_SIZE = 12  # bytes of packed 6-bit scales and mins in Q4_K / Q5_K

# (elements per block, bytes per block) of every type, so that files holding types tiergen
# cannot dequantise still open and can be size-checked.
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    GGMLType.F32: (1, 4),
    GGMLType.F16: (1, 2),
    GGMLType.Q4_0: (32, 2 + 16),
    GGMLType.Q4_1: (32, 2 + 2 + 16),
    GGMLType.Q5_0: (32, 2 + 4 + 16),
    GGMLType.Q5_1: (32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: (32, 2 + 32),
    GGMLType.Q8_1: (32, 4 + 4 + 32),
    GGMLType.Q2_K: (QK_K, 2 + 2 + QK_K // 16 + QK_K // 4),
    GGMLType.Q3_K: (QK_K, 2 + QK_K // 4 + QK_K // 8 + 12),
    GGMLType.Q4_K: (QK_K, 2 + 2 + QK_K // 2 + 12),
    GGMLType.Q5_K: (QK_K, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    GGMLType.Q6_K: (QK_K, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    GGMLType.Q8_K: (QK_K, 4 + QK_K + QK_K // 8),
    GGMLType.IQ2_XXS: (QK_K, 2 + QK_K // 4),
    GGMLType.IQ2_XS: (QK_K, 2 + QK_K // 4 + QK_K // 32),
    GGMLType.IQ3_XXS: (QK_K, 2 + QK_K // 4 + QK_K // 8),
    GGMLType.IQ1_S: (QK_K, 2 + QK_K // 8 + QK_K // 16),
    GGMLType.IQ4_NL: (32, 2 + 16),
    GGMLType.IQ3_S: (QK_K, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    GGMLType.IQ2_S: (QK_K, 2 + QK_K // 4 + QK_K // 16),
    GGMLType.IQ4_XS: (QK_K, 2 + 2 + QK_K // 2 + QK_K // 64),
    GGMLType.I8: (1, 1),
    GGMLType.I16: (1, 2),
    GGMLType.I32: (1, 4),
    GGMLType.I64: (1, 8),
    GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (QK_K, QK_K // 8 + QK_K // 16 + QK_K // 32),
    GGMLType.BF16: (1, 2),
    GGMLType.TQ1_0: (QK_K, 2 + 4 * 13),
    GGMLType.TQ2_0: (QK_K, 2 + 64),
    GGMLType.MXFP4: (32, 1 + 16),
    GGMLType.NVFP4: (64, 4 + 32),
    GGMLType.Q1_0: (128, 2 + 16),
    GGMLType.FP8: (128, 4 + 128),
}

# Quantised types are dequantised this many blocks at a time, which bounds the memory of
# the intermediates to a few tens of MB whatever the tensor size.
_CHUNK_BLOCKS = 1 << 16


def ggml_type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(ggml_type, f"unknown type {ggml_type}")


def ggml_type_sizes(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of any GGML type, dequantisable or not."""
    sizes = GGML_BLOCK_SIZES.get(ggml_type)
    if sizes is None:
        raise TiergenError(
            f"unknown GGML tensor type id {ggml_type}; the file is corrupt or needs a newer tiergen"
        )
    return sizes


def tensor_nbytes(ggml_type: int, n_elements: int) -> int:
    """Bytes taken by ``n_elements`` values of ``ggml_type``."""
    block_size, type_size = ggml_type_sizes(ggml_type)
    if n_elements % block_size:
        raise TiergenError(
            f"{n_elements} elements is not a multiple of the {ggml_type_name(ggml_type)} "
            f"block size {block_size}; the file is corrupt"
        )
    return n_elements // block_size * type_size


def _u8(values: list[int], *shape: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(*shape)


_NIBBLE_SHIFTS = _u8([0, 4], 2, 1)
_CRUMB_SHIFTS = _u8([0, 2, 4, 6], 4, 1)
_BIT_SHIFTS = _u8(list(range(8)), 8, 1)


def _scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as a float32 ``(n_blocks, 1)`` column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``(..., n)`` bytes -> ``(..., 2, n)``: the low nibbles, then the high nibbles."""
    return (qs.unsqueeze(-2) >> _NIBBLE_SHIFTS.to(qs.device)) & 0x0F


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """``(..., n)`` bytes -> ``(..., 4, n)``: 2-bit fields from the low bits up."""
    return (qs.unsqueeze(-2) >> _CRUMB_SHIFTS.to(qs.device)) & 0x03


def _bits(qs: torch.Tensor) -> torch.Tensor:
    """``(..., n)`` bytes -> ``(..., 8, n)``: single bits from the low bit up."""
    return (qs.unsqueeze(-2) >> _BIT_SHIFTS.to(qs.device)) & 0x01


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float32)


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.float16)


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.bfloat16)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).flatten(1)
    return _scale(blocks, 0) * (q.float() - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).flatten(1)
    return _scale(blocks, 0) * q.float() + _scale(blocks, 2)


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32 fifth bits of a Q5_0/Q5_1 block: bit i of the little-endian uint32 is value i."""
    return _bits(qh).transpose(1, 2).flatten(1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 6:]).flatten(1) | (_q5_high_bits(blocks[:, 2:6]) << 4)
    return _scale(blocks, 0) * (q.float() - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 8:]).flatten(1) | (_q5_high_bits(blocks[:, 4:8]) << 4)
    return _scale(blocks, 0) * q.float() + _scale(blocks, 2)


_MXFP4_VALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                             dtype=torch.float32)  # E2M1, doubled


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    # the E8M0 exponent e scales the doubled values by 2^(e - 128) (a subnormal for e < 2)
    e = blocks[:, :1].long()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(torch.int32)
    q = _nibbles(blocks[:, 1:]).flatten(1).long()
    return _MXFP4_VALUES.to(blocks.device)[q] * bits.view(torch.float32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float() * _scale(blocks, 0)


def _q8_k(blocks: torch.Tensor) -> torch.Tensor:
    # float32 d, int8 qs[256], then int16 bsums[16] that only matter for dot products.
    d = blocks[:, :4].contiguous().view(torch.float32)
    return d * blocks[:, 4 : 4 + QK_K].view(torch.int8).float()


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    dl = (_scale(blocks, 80) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_scale(blocks, 82) * (scales >> 4).float()).view(n, 16, 1)
    q = _crumbs(qs.reshape(n, 2, 32)).reshape(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    # 16 6-bit scales: low 4 bits in bytes 0-7 (low nibbles first), high 2 bits in bytes 8-11.
    low = _nibbles(scales[:, :8]).reshape(n, 16)
    high = _crumbs(scales[:, 8:]).reshape(n, 16)
    sc = (low | (high << 4)).float() - 32
    dl = (_scale(blocks, 108) * sc).view(n, 16, 1)
    ql = _crumbs(qs.reshape(n, 2, 32)).reshape(n, 16, 16)
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    qh = (_bits(hmask).reshape(n, 16, 16) ^ 1) << 2
    q = ql.float() - qh.float()
    return (dl * q).view(n, QK_K)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K field into 8 6-bit scales and 8 6-bit mins."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mins.float()


def _k_scaled(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply Q4_K/Q5_K per-sub-block scale and min to ``q`` of shape ``(n, 8, 32)``."""
    n = blocks.shape[0]
    sc, mins = _k_scales_mins(blocks[:, 4 : 4 + _K_SCALE_SIZE])
    d = (_scale(blocks, 0) * sc).view(n, 8, 1)
    dm = (_scale(blocks, 2) * mins).view(n, 8, 1)
    return (d * q.float() - dm).view(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qs = blocks[:, 4 + _K_SCALE_SIZE :]
    return _k_scaled(blocks, _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    qh = blocks[:, 16:48]
    qs = blocks[:, 48:]
    ql = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
    return _k_scaled(blocks, ql | (_bits(qh) << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql, qh, scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208]
    d = (_scale(blocks, 208) * scales.view(torch.int8).float()).view(n, 16, 1)
    low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)
    high = _crumbs(qh.reshape(n, 2, 32)).reshape(n, 8, 32)
    q = (low | (high << 4)).float() - 32
    return (d * q.view(n, 16, 16)).view(n, QK_K)


def _fp8(blocks: torch.Tensor) -> torch.Tensor:
    scale = blocks[:, :4].contiguous().view(torch.float32)
    return blocks[:, 4:].contiguous().view(torch.float8_e4m3fn).float() * scale


# The per-type rules: type -> (elements per block, bytes per block, blocks -> values).
_DEQUANT: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    t: (*GGML_BLOCK_SIZES[t], decode)
    for t, decode in {
        GGMLType.F32: _f32,
        GGMLType.F16: _f16,
        GGMLType.BF16: _bf16,
        GGMLType.Q4_0: _q4_0,
        GGMLType.Q4_1: _q4_1,
        GGMLType.Q5_0: _q5_0,
        GGMLType.Q5_1: _q5_1,
        GGMLType.Q8_0: _q8_0,
        GGMLType.Q2_K: _q2_k,
        GGMLType.Q3_K: _q3_k,
        GGMLType.Q4_K: _q4_k,
        GGMLType.Q5_K: _q5_k,
        GGMLType.Q6_K: _q6_k,
        GGMLType.Q8_K: _q8_k,
        GGMLType.MXFP4: _mxfp4,
        GGMLType.FP8: _fp8,
    }.items()
}
FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16})

SUPPORTED_TYPES: tuple[int, ...] = tuple(_DEQUANT)


def dequantize(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode the raw bytes of a GGML tensor into a ``shape`` tensor (torch order) of ``dtype``.

    F32/F16/BF16 data already in ``dtype`` is returned as a view of ``raw`` without a copy.
    """
    entry = _DEQUANT.get(ggml_type)
    if entry is None:
        supported = ", ".join(ggml_type_name(t) for t in SUPPORTED_TYPES)
        raise TiergenError(
            f"cannot dequantise GGML type {ggml_type_name(ggml_type)}; supported types: "
            f"{supported}. Use a model file quantised with one of these types."
        )
    block_size, type_size, decode = entry
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise TypeError(f"raw must be a 1-D uint8 tensor, not {raw.dtype} {tuple(raw.shape)}")
    if shape and shape[-1] % block_size:
        raise TiergenError(
            f"{ggml_type_name(ggml_type)} tensor of shape {tuple(shape)}: rows of {shape[-1]} "
            f"values are not a multiple of the block size {block_size}; the file is corrupt"
        )
    expected = tensor_nbytes(ggml_type, math.prod(shape))
    if raw.numel() != expected:
        raise TiergenError(
            f"{ggml_type_name(ggml_type)} tensor of shape {tuple(shape)} needs {expected} bytes, "
            f"got {raw.numel()}; the file is corrupt"
        )
    blocks = raw.view(-1, type_size)
    if ggml_type in FLOAT_TYPES:
        return decode(blocks).view(shape).to(dtype)
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype, device=raw.device)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = decode(blocks[start:stop])
    return out.view(shape)
