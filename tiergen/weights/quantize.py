"""Float checkpoints quantised at load into GGML blocks (``LLM(quantize="q4_k")``), so that
they run on the packed kernels like a GGUF's quantised matrices.

The quantisers follow llama.cpp's reference code (``ggml-quants.c``), vectorised in torch:
Q8_0 and Q4_0 give its bytes exactly (``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref``);
Q4_K searches each sub-block's scale and minimum as its ``make_qkx2_quants`` does (a
weighted least-squares fit at 21 trial scales), over all sub-blocks at once.

Which matrices: the linear layers that the model families multiply as :class:`Packed`
(see :func:`matrix_type`). The result is written once to the cache directory, one
safetensors file of uint8 blocks per checkpoint and type, and memory-mapped on later loads
(:class:`QuantizedSource`).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tiergen.errors import TiergenError
from tiergen.paths import cache_dir, written_atomically
from tiergen.weights.mapped import page_out_unused
from tiergen.weights.packed import Packed, narrow, packed_like
from tiergen.weights.quant import QK_K, GGMLType, ggml_type_sizes, tensor_nbytes

QUANTIZE_TYPES: dict[str, GGMLType] = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0,
                                       "q4_k": GGMLType.Q4_K}
# An untied LM head is quantised to Q8_0 whatever the type asked for, as llama.cpp keeps its
# output matrix at a higher precision than the layers: its errors reach the logits directly.
HEAD_TYPE = GGMLType.Q8_0
# Bump when the quantisers or the file change: older cached files are then not used.
FORMAT = 2
_MAGIC = "tiergen-quantized"

# The layer matrices the families take packed (through ``linear``, ``cat_rows`` and
# ``stack``), routed experts included. DeepSeek's q_a/kv_a are joined as plain tensors, so
# those stay float, as do routers, norms, biases and embeddings; its kv_b is quantised as the
# per-head k_b and v_b (:class:`tiergen.weights.per_head.PerHeadKvB`).
_LAYER_MATRIX = re.compile(r"model\.layers\.\d+\.(self_attn\.(q|k|v|o|q_b|k_b|v_b)_proj"
                           r"|mlp(\.shared_experts?|\.experts\.\d+)?\.(gate|up|down)_proj"
                           r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight")
_JOINED_AS_TENSORS = dict.fromkeys(["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                                    "DeepseekV32ForCausalLM", "Glm4MoeLiteForCausalLM",
                                    "GlmMoeDsaForCausalLM"],
                                   re.compile(r".*\.self_attn\.q_proj\.weight"))

# Rows quantised at once: bounds the memory of the quantisers' intermediates.
_CHUNK_VALUES = 1 << 20


def quantize_type(name: str) -> GGMLType:
    """The block type of a ``quantize`` argument, or a TiergenError naming the choices."""
    ggml_type = QUANTIZE_TYPES.get(name.lower()) if isinstance(name, str) else None
    if ggml_type is None:
        raise TiergenError(f"unknown quantize type {name!r}; choose one of "
                           f"{', '.join(QUANTIZE_TYPES)} (or None to keep the weights float)")
    return ggml_type


def matrix_type(name: str, shape: tuple[int, ...], ggml_type: int, architecture: str
                ) -> int | None:
    """The block type tensor ``name`` is quantised to, or None to keep it float.

    Layer matrices take ``ggml_type``; one whose rows (its input dimension) are not a whole
    number of its blocks falls back to Q8_0 (blocks of 32: a Q4_K layer 32 but not 256 wide),
    and stays float if they are not a multiple of 32 either. An untied ``lm_head`` takes
    Q8_0 (:data:`HEAD_TYPE`); embeddings, norms and biases stay float.
    """
    if len(shape) != 2:
        return None
    if name == "lm_head.weight":
        ggml_type = HEAD_TYPE
    else:
        joined = _JOINED_AS_TENSORS.get(architecture)
        if not _LAYER_MATRIX.fullmatch(name) or (joined and joined.fullmatch(name)):
            return None
    for t in (ggml_type, GGMLType.Q8_0):
        if shape[1] % ggml_type_sizes(t)[0] == 0:
            return t
    return None


# -- the quantisers: (blocks, values per block) float32 -> (blocks, bytes per block) uint8 ----

def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 (n, 1) -> its float16 bytes (n, 2), rounded to nearest even like ggml."""
    return x.half().view(torch.uint8)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly: floor(|x| + 0.5) rounds 0.49999997 up."""
    a = x.abs()
    f = a.floor()
    return torch.copysign(f + (2 * (a - f)).floor(), x)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(..., 2, n) values 0..15 -> (..., n) bytes: the first row low, the second high."""
    return q[..., 0, :] | (q[..., 1, :] << 4)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q8_0_ref: d = max|x| / 127, q = roundf(x / d)."""
    d = x.abs().amax(1, keepdim=True) / 127
    q = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_fp16_bytes(d), q], 1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q4_0_ref: d = (the value of largest magnitude) / -8,
    q = min(15, trunc(x / d + 8.5)); value j and j + 16 share a byte."""
    m = x.gather(1, x.abs().argmax(1, keepdim=True))
    d = m / -8
    q = (x * _inverse(d) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
    return torch.cat([_fp16_bytes(d), _pack_nibbles(q.view(-1, 2, 16))], 1)


def _fit_scale_min(x: torch.Tensor, w: torch.Tensor, nmax: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's make_qkx2_quants(rmin=-1, rdelta=0.1, nstep=20) for every row of x (n, 32)
    with weights w: codes L = round((x - min) / scale) in 0..nmax, starting from
    scale = (max - min) / nmax, then at each of 21 trial scales a weighted least-squares fit
    of scale and min to the codes it gives, kept when it lowers the weighted squared error
    (the trials after it then start from its min, as in llama.cpp: each fit depends
    on the last, so the 21 trials run in turn, each over all rows at once). Returns (scale, -min,
    L); min <= 0, and a flat row has scale 0."""
    lo = x.amin(1, keepdim=True).clamp(max=0)
    hi = x.amax(1, keepdim=True)
    flat = hi == lo
    hi = torch.where(flat, lo + 1, hi)  # (flat rows: any scale, replaced by 0 at the end)
    sum_w, sum_x = w.sum(1, keepdim=True), (w * x).sum(1, keepdim=True)
    sum_x2 = (w * x * x).sum(1, keepdim=True)

    def error(scale: torch.Tensor, low: torch.Tensor, sum_l: torch.Tensor, sum_l2: torch.Tensor,
              sum_xl: torch.Tensor) -> torch.Tensor:
        """sum w (scale L + low - x)^2, from the sums (no pass over the values)."""
        return (scale * (scale * sum_l2 + 2 * low * sum_l - 2 * sum_xl)
                + low * (low * sum_w - 2 * sum_x) + sum_x2)

    def sums(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wl = w * codes
        return wl.sum(1, keepdim=True), (wl * codes).sum(1, keepdim=True), \
            (wl * x).sum(1, keepdim=True)

    iscale = nmax / (hi - lo)
    scale = 1 / iscale
    codes = torch.round(iscale * (x - lo)).clamp_(0, nmax)
    best = error(scale, lo, *sums(codes))
    for step in range(21):
        iscale = (-1 + 0.1 * step + nmax) / (hi - lo)
        trial = torch.round(iscale * (x - lo)).clamp_(0, nmax)
        sum_l, sum_l2, sum_xl = sums(trial)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(det > 0, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        err = error(this_scale, this_min, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (err < best) & ~flat
        best = torch.where(better, err, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
        codes = torch.where(better, trial, codes)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    codes = torch.where(flat, torch.zeros_like(codes), codes)
    return scale.squeeze(1), -lo.squeeze(1), codes


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q4_K_ref: super-blocks of 256 values in 8 sub-blocks of 32,
    each with a 6-bit scale and minimum (relative to the float16 d and dmin of the
    super-block) and 4-bit codes, fitted by :func:`_fit_scale_min` with the weights
    sqrt(mean x^2) + |x| llama.cpp uses."""
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    w = (sub * sub).mean(1, keepdim=True).sqrt() + sub.abs()
    scales, mins, codes = _fit_scale_min(sub, w, 15)
    scales, mins, codes = scales.view(n, 8), mins.view(n, 8), codes.view(n, 8, 32)
    max_scale = scales.amax(1, keepdim=True)
    max_min = mins.amax(1, keepdim=True)
    ls = torch.round(scales * torch.where(max_scale > 0, 63 / max_scale, 0)).clamp(max=63)
    lm = torch.round(mins * torch.where(max_min > 0, 63 / max_min, 0)).clamp(max=63)
    d, dmin = (max_scale / 63).half(), (max_min / 63).half()
    # the codes again, against the scales as stored (a zero scale keeps the fitted codes)
    dl = (d.float() * ls).unsqueeze(-1)
    ml = (dmin.float() * lm).unsqueeze(-1)
    refit = torch.round((sub.view(n, 8, 32) + ml) / torch.where(dl == 0, 1, dl)).clamp(0, 15)
    codes = torch.where(dl == 0, codes, refit).to(torch.uint8)
    ls, lm = ls.to(torch.uint8), lm.to(torch.uint8)
    packed_scales = torch.cat([ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
                               lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                               (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)], 1)
    qs = _pack_nibbles(codes.view(n, 4, 2, 32)).reshape(n, QK_K // 2)
    return torch.cat([d.view(torch.uint8), dmin.view(torch.uint8), packed_scales, qs], 1)


QUANTIZERS = {GGMLType.Q8_0: quantize_q8_0, GGMLType.Q4_0: quantize_q4_0,
              GGMLType.Q4_K: quantize_q4_k}


def quantize_matrix(w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A (rows, cols) matrix as the flat uint8 bytes of ``ggml_type`` blocks, row by row."""
    block, nbytes = ggml_type_sizes(ggml_type)
    rows, cols = w.shape
    out = torch.empty(rows, cols // block * nbytes, dtype=torch.uint8)
    step = max(1, _CHUNK_VALUES // cols)
    for r in range(0, rows, step):
        chunk = w[r:r + step].to(torch.float32).reshape(-1, block)
        out[r:r + step] = QUANTIZERS[ggml_type](chunk).view(-1, out.shape[1])
    return out.view(-1)


# -- the cached file ---------------------------------------------------------------------

def cache_path(fingerprint: str, kind: str) -> Path:
    """Where a checkpoint's quantised matrices are kept (``fingerprint``: its files' identity)."""
    return cache_dir() / "quantized" / f"{fingerprint[:32]}-{kind}-v{FORMAT}.safetensors"


def _write(path: Path, source, plan: dict[str, tuple[int, tuple[int, int]]], kind: str) -> None:
    """Quantise the planned tensors of ``source`` into a safetensors file at ``path``: each a
    flat uint8 tensor, its type and shape in the metadata. Streamed tensor by tensor into a
    temporary file that is renamed into place at the end, so an interrupted run leaves no
    file to be mistaken for a finished one."""
    header: dict[str, object] = {}
    offset = 0
    for name, (ggml_type, shape) in plan.items():
        nbytes = tensor_nbytes(ggml_type, shape[0] * shape[1])
        header[name] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": _MAGIC, "version": str(FORMAT), "types": json.dumps(
        {name: [int(t), *shape] for name, (t, shape) in plan.items()})}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with written_atomically(path, "the quantised model") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name, (ggml_type, _) in tqdm(plan.items(), desc=f"quantising to {kind}",
                                         unit="tensor", leave=False):
            out.write(quantize_matrix(source.get(name), ggml_type).numpy().data)


class QuantizedSource:
    """A float checkpoint's tensors with its chosen matrices read, packed, from a quantised
    file written by :func:`quantized_source` (memory-mapped: a view of the file, as a GGUF's
    blocks are); all other tensors come from the checkpoint itself."""

    def __init__(self, source, path: Path) -> None:
        self.source, self.path = source, path
        try:
            with open(path, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
                meta = header.pop("__metadata__")
                if meta.get("format") != _MAGIC or meta.get("version") != str(FORMAT):
                    raise ValueError("not a tiergen quantised model of this version")
                types = json.loads(meta["types"])
                self._data = np.memmap(f, dtype=np.uint8, mode="c")
        except (OSError, ValueError, KeyError, struct.error) as e:
            raise TiergenError(f"cannot read the quantised model {path} ({e}); delete it to "
                               "quantise the checkpoint again") from None
        start = 8 + size
        self._entries: dict[str, tuple[int, tuple[int, int], int, int]] = {}
        for name, (ggml_type, rows, cols) in types.items():
            a, b = header[name]["data_offsets"]
            if b - a != tensor_nbytes(ggml_type, rows * cols) or start + b > len(self._data):
                raise TiergenError(f"the quantised model {path} is corrupt (tensor {name!r}); "
                                   "delete it to quantise the checkpoint again")
            self._entries[name] = (ggml_type, (rows, cols), start + a, b - a)

    @property
    def types(self) -> dict[str, int]:
        """The block type of each quantised tensor."""
        return {name: e[0] for name, e in self._entries.items()}

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str) -> torch.Tensor | Packed:
        entry = self._entries.get(name)
        if entry is None:
            return self.source.get(name)
        ggml_type, shape, offset, nbytes = entry
        data = torch.from_numpy(self._data[offset:offset + nbytes].view(np.ndarray))
        return Packed(data, shape, ((ggml_type, shape[0]),))

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor | Packed:
        if name not in self._entries:
            return self.source.get_slice(name, dim, rows)
        return narrow(self.get(name), dim, rows)

    def page_out_unused(self, live: Iterable[object]) -> int:
        """Hand back this file's pages, and the checkpoint's, that no tensor of ``live``
        reads (:func:`tiergen.weights.mapped.page_out_unused`)."""
        live = list(live)
        inner = getattr(self.source, "page_out_unused", None)
        return page_out_unused(self._data, live) + (inner(live) if inner else 0)

    def meta(self, name: str) -> Packed | None:
        entry = self._entries.get(name)
        return None if entry is None else packed_like(entry[1], entry[0])

    def locate(self, name: str) -> tuple[Path, int, torch.dtype | int, tuple[int, ...]] | None:
        entry = self._entries.get(name)
        if entry is None:
            return self.source.locate(name)
        ggml_type, shape, offset, _ = entry
        return self.path, offset, ggml_type, shape


def quantized_source(source, shapes: dict[str, tuple[int, ...]], fingerprint: str, kind: str,
                     architecture: str) -> QuantizedSource:
    """``source`` with its layer matrices in ``kind`` blocks (see :func:`matrix_type`),
    quantised on the first call for this checkpoint and type and read from the cache
    directory after that."""
    ggml_type = quantize_type(kind)
    path = cache_path(fingerprint, kind.lower())
    if not path.is_file():
        plan = {name: (t, tuple(shape)) for name, shape in shapes.items()
                if (t := matrix_type(name, tuple(shape), ggml_type, architecture)) is not None}
        _write(path, source, plan, kind.lower())
    return QuantizedSource(source, path)
