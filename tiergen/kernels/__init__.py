"""Matrix products on packed weights (:class:`tiergen.weights.packed.Packed`), and the small
operations of a decode step.

On a CPU, up to ``ROW_THRESHOLD`` rows go through ``packed.c``: the blocks are decoded to
float32 on the fly (in registers for a few rows, a cache-sized tile at a time for more) and
multiplied there, so the weights are read packed and never inflated in memory. Many rows
(prefill) are bound by arithmetic: the matrix is decoded into a reused float32 buffer and
multiplied by the BLAS in float32 (bfloat16 inputs too: without native bfloat16 its GEMM is
many times slower, and the decoder writes float32). The C library is compiled on first use
with the machine's C compiler for its own SIMD (-march=native) and cached; without a
compiler, or on a GPU, every product takes the decode-then-multiply path in plain torch.

``int8.c``, in the same library, multiplies packed blocks by activations quantised to 8 (or
16) bits with integer instructions (:func:`set_activations`, :func:`integer_linear`): the
default for an LLM on a CPU, judged by its KL divergence from the float path.

``decode.c``, in the same library, does a float32 RMSNorm, a rotary embedding and one new
token's attention over the cache in one call each (:func:`rms_norm`, :func:`rope`,
:func:`decode_attention`): at batch 1, torch's dispatch of the several operations they
otherwise take is most of a step outside the products. ``layer.c`` chains them with the
products into a whole decode layer in one call (:mod:`tiergen.kernels.layer`).

``tiergen.h`` declares the library's interface once; :func:`bind` gives ctypes the types it
declares (:mod:`tiergen.kernels.header`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tiergen._platform import amx_usable
from tiergen.kernels.header import HEADER, prototypes
from tiergen.weights.packed import INTEGER_TYPES, Packed, layout
from tiergen.weights.quant import ggml_type_sizes

log = logging.getLogger("tiergen")

SOURCES = [Path(__file__).with_name(n) for n in ("packed.c", "amx.c", "decode.c", "int8.c",
                                                    "layer.c")]
# tiergen.h (the interface), blocks.h, amx.h, int8/ (each instruction set's integer kernels)
HEADERS = sorted(Path(__file__).parent.glob("**/*.h"))
ROW_THRESHOLD = 32  # more rows than this: decode the matrix, then the BLAS (crossover 32-64
# rows for a layer's matrices with 1 or 2 threads, ~128 for a large LM head, on an AVX2 EPYC:
# docs/BENCHMARKS-HISTORY.md)
_lib: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable
_lock = threading.Lock()
_scratch: dict[tuple, torch.Tensor] = {}  # reused decode buffers, by (dtype, device, inference mode)
_arith = threading.local()  # .kind, .invariant: activations (set_activations); .amx: rows_on_amx
# The integer formats: (values per scale, 16 bits). 8-bit activations take a scale per 8
# values: about 2x closer to the float path than scale groups of 16, where a scale per 4 is 2x
# closer again but costs the tiles a multiply-add per integer product, 1.1x the time of a
# batch-32 generation (KL divergence: benchmarks/bench_kld.py --int8-group; speed:
# benchmarks/bench_int8.py; docs/BENCHMARKS.md). 16-bit ones, two int8 halves dotted apart,
# land below 5e-6.
ACTIVATION_FORMATS = {"int8": (8, False), "int16": (16, True)}
# Integer-path prompts of this many tokens or more multiply on AMX tiles where they work: each
# matrix decoded to bfloat16 once per product, straight into the tiles' layout (amx.c), and
# multiplied there; the decoding is paid once for the chunk's rows. Decided per row by the
# length of its whole prompt (amx_prompt), not by a step's rows or tokens, so that a row rounds
# alike alone and beside any others, in whatever chunks its prompt goes in; shorter prompts
# and every decode step take the integer kernels. At 32 a prompt alone is as fast either way
# (a product of 32 rows takes as long on the tiles as in the integer kernels), from there
# on faster on the tiles, and a batch of 32 prompts of 32-96 tokens 2.2-2.7x faster (2-core
# AMX Xeon; docs/BENCHMARKS.md, "Intel AMX").
AMX_PROMPT = 32
ACTIVATIONS = ("float32", *ACTIVATION_FORMATS)
# A bfloat16 matrix as stored (a bfloat16 checkpoint's) multiplies up to this many rows on AMX
# tiles by amx.c (dense_bfloat16_linear), more by torch (oneDNN, which reorders the matrix for
# each product): amx.c was 1.17-1.76x faster at 1-64 rows for SmolLM2's matrices and LM head,
# even at 96, mostly slower from 128 (benchmarks/bench_amx.py --dense, 2-core AMX Xeon).
AMX_DENSE_ROWS = 64
TILE_ROWS = 3  # integer products of this many rows or more may read tiles (reads_tiles says)


# -ffast-math is avoided: in a shared library it would switch the whole process to flushing
# denormals. The kernels are written with explicit vectors, so nothing needs reassociation.
FLAGS = ["-O3", "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native",
         "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast", "-std=gnu11"]


def _compile(target: Path, flags: list[str] = FLAGS, sources: list[Path] | None = None,
             timeout: float = 120) -> None:
    """Build the C sources (``sources``, else this tree's) into ``target`` (written beside it,
    then renamed into place), refused after ``timeout`` seconds."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) found")
    # The OpenMP runtime torch ships, so that both share one thread pool.
    torch_lib = Path(torch.__file__).parent / "lib"
    gomp = next(iter(sorted(torch_lib.glob("libgomp*.so*"))), None)
    libs = [f"-L{torch_lib}", f"-l:{gomp.name}", f"-Wl,-rpath,{torch_lib}"] if gomp else []
    libs.append("-lm")
    sources = sources or SOURCES
    includes = [f"-I{d}" for d in dict.fromkeys(Path(s).parent for s in sources)]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, *includes, *map(str, sources), "-o", tmp, *libs], check=True,
                       capture_output=True, text=True, timeout=timeout)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise OSError(f"{cc} failed: {e.stderr.strip()[:500]}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def build_path(flags: list[str], name: str = "packed") -> Path:
    """Where a build of this source with ``flags`` is cached on this CPU (its flags decide what
    -march=native emits)."""
    from tiergen._platform import cpu_flags
    from tiergen.weights import cache_dir

    ident = (b"".join(s.read_bytes() for s in SOURCES + HEADERS) + platform.machine().encode()
             + " ".join(flags).encode() + " ".join(sorted(cpu_flags())).encode())
    return cache_dir() / "kernels" / f"{name}-{hashlib.sha256(ident).hexdigest()[:16]}.so"


def _library_path() -> Path:
    """The cached library of this source for this CPU."""
    return build_path(FLAGS)


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them once; None (with one warning) if they cannot be
    built here, or when TIERGEN_KERNELS=torch asks for the plain-torch path."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib or None


def _load() -> ctypes.CDLL | bool:
    if os.environ.get("TIERGEN_KERNELS") == "torch":
        return False
    try:
        path = _library_path()
        if not path.exists():
            _compile(path)
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("tiergen: C kernels unavailable (%s); packed matrices are decoded and "
                    "multiplied by torch instead, and decode steps run in torch alone, which "
                    "is slower", e)
        return False
    return bind(lib)


def bind(lib: ctypes.CDLL, header: Path = HEADER) -> ctypes.CDLL:
    """Give the library's functions the argument and return types that ``header`` declares
    (tiergen.h: the interface is written there once, see :mod:`tiergen.kernels.header`)."""
    for proto in prototypes(header.read_text()).values():
        fn = getattr(lib, proto.name)
        fn.argtypes, fn.restype = proto.argtypes(), proto.restype()
    return lib


def _scratch_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                    ) -> torch.Tensor:
    numel = shape[0] * shape[1]
    # a buffer made under inference_mode cannot be written outside it, nor the reverse
    key = (dtype, device, torch.is_inference_mode_enabled())
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def dequantize_into(w: Packed, out: torch.Tensor) -> torch.Tensor:
    """Decode ``w`` into ``out`` (float32 CPU through the C library when there is one)."""
    lib = library() if w.device.type == "cpu" and out.dtype == torch.float32 else None
    if lib is None:
        return w.dequantize(out.dtype, out)
    for ggml_type, row, rows, raw in w.segments():
        part = out[row:row + rows]
        if lib.tg_dequant(ggml_type, raw.data_ptr(), raw.numel() // ggml_type_sizes(ggml_type)[1],
                          part.data_ptr()):
            w.dequantize(out.dtype, out)  # not a type the library knows
            break
    return out


@dataclass
class Int8Rows:
    """Activation rows quantised for ``int8.c``: integers in scale groups of ``group`` values
    (4, 8 or 16) with a scale each, the scale of every four values, and the sum of scale *
    value over every 16 values. 8-bit: ``q`` in [-127, 127], scale max |x| / 127. 16-bit
    (``low`` given): 255 * q + low, both in [-127, 127], scale max |x| / 32512."""

    q: torch.Tensor  # (m, k) int8
    low: torch.Tensor | None  # (m, k) int8
    scales: torch.Tensor  # (m, k // 4) float32
    sums: torch.Tensor  # (m, k // 16) float32
    group: int  # values per scale


def quantize_activations(x: torch.Tensor, group: int, wide: bool = False) -> Int8Rows:
    """``x`` (m, k), float32 CPU, k a multiple of 32, as :class:`Int8Rows` (C library)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the C kernels are unavailable")
    m, k = x.shape
    x = x.float().contiguous()
    if group not in (4, 8, 16):
        raise ValueError(f"activation scale groups of 4, 8 or 16 values, not {group}")
    if wide and group != 16:
        raise ValueError("16-bit activations come in groups of 16 values")
    rows = Int8Rows(torch.empty(m, k, dtype=torch.int8),
                    torch.empty(m, k, dtype=torch.int8) if wide else None,
                    torch.empty(m, k // 4), torch.empty(m, k // 16), group)
    lib.tg_quantize_act(x.data_ptr(), m, k, group, rows.q.data_ptr(),
                        None if rows.low is None else rows.low.data_ptr(),
                        rows.scales.data_ptr(), rows.sums.data_ptr())
    return rows


def set_activations(kind: str, batch_invariant: bool = False) -> None:
    """How packed products on this thread treat their activations (an LLM sets it for its
    compute): "float32" (the default: decoded weights times float32 activations), "int8" or
    "int16" (:data:`ACTIVATION_FORMATS`, on a CPU: activations quantised per row and
    multiplied by the integer kernels, whatever the number of rows: from three rows on, the
    tiles of ``int8.c``, about as fast as the float32 BLAS on the decoded matrix at 512 rows
    and faster below, without decoding it). A row gets the same numbers whatever the batch around
    it, within float rounding (exactly, from three rows on); ``batch_invariant``: exactly
    for any number of rows (every integer product in the tiles' arithmetic, small float
    matrices row by row: layers.linear), slower for a decode step of one or two sequences."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {kind!r}")
    _arith.kind = kind
    if batch_invariant != getattr(_arith, "invariant", False):
        lib = library()
        if lib is not None:
            lib.tg_set_batch_invariant(int(batch_invariant))
        _arith.invariant = batch_invariant


def activations() -> str:
    return getattr(_arith, "kind", "float32")


def batch_invariant() -> bool:
    """Whether this thread's products are batch invariant (:func:`set_activations`)."""
    return getattr(_arith, "invariant", False)


@contextmanager
def activations_set(kind: str, batch_invariant: bool = False) -> Iterator[None]:
    """:func:`set_activations` for the ``with`` block, then what was set before."""
    before = activations(), getattr(_arith, "invariant", False)
    set_activations(kind, batch_invariant)
    try:
        yield
    finally:
        set_activations(*before)


def amx_prompt(tokens: int, activations: str) -> bool:
    """Whether a prompt of ``tokens`` tokens runs its products (and attention) on AMX tiles
    under ``activations``: int8 ones, AMX_PROMPT tokens or more, where AMX works."""
    return activations == "int8" and tokens >= AMX_PROMPT and amx_usable()


def amx_rows(prompt_tokens: torch.Tensor) -> torch.Tensor | None:
    """Which rows of a prompt step on this thread, whose whole prompts have ``prompt_tokens``
    tokens, run on AMX tiles (:func:`amx_prompt`); None where none does."""
    kind = activations()
    rows = torch.tensor([amx_prompt(n, kind) for n in prompt_tokens.tolist()])
    return rows if bool(rows.any()) else None


@contextmanager
def rows_on_amx(rows: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the products (B, T, K) and attention of this thread's step run rows
    ``rows`` (B,) bool (:func:`amx_rows`; None: none) on AMX tiles, the others as before."""
    before = getattr(_arith, "amx", None)
    _arith.amx = rows
    try:
        yield
    finally:
        _arith.amx = before


def on_amx(rows: int) -> torch.Tensor | None:
    """The rows of a step's ``rows`` that run on AMX tiles (:func:`rows_on_amx`), or None."""
    amx = getattr(_arith, "amx", None)
    return amx if amx is not None and len(amx) == rows else None


def split_rows(rows: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``step`` over a step's rows on AMX tiles (``rows``, of every row) and over the others,
    each as a step of its own (:func:`rows_on_amx`), its results put back in the rows' order."""
    with rows_on_amx(rows[rows]):
        on = step(rows)
    with rows_on_amx(None):
        off = step(~rows)
    y = on.new_empty(len(rows), *on.shape[1:])
    y[rows], y[~rows] = on, off
    return y


def tokens_on_amx(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
                  ) -> torch.Tensor:
    """``step`` over tokens x (N, H) of rows on AMX tiles (gathered from them, as a
    mixture-of-experts layer gathers an expert's tokens), each token as a row of its own, so
    that their products take the tiles as their rows' do."""
    with rows_on_amx(torch.ones(len(x), dtype=torch.bool)):
        return step(x[:, None])[:, 0]


def matrix_descriptor(w: Packed) -> ctypes.Array:
    """``w`` as the C kernels take a packed matrix of several parts: {rows, columns, parts,
    then (GGML type, rows, address, its kept tiles' address or 0) for each part}."""
    if w.descriptor is not None and w.tiles is None:
        return w.descriptor
    lib = library() if w.tiles is not None else None
    cells, tile = [w.shape[0], w.shape[1], len(w.parts)], 0
    for ggml_type, _, rows, start, _ in layout(w.shape, w.parts):
        cells += [ggml_type, rows, w.data.data_ptr() + start,
                  w.tiles.data_ptr() + tile if lib else 0]
        tile += lib.tg_tile_bytes(rows, w.shape[1]) if lib else 0
    d = (ctypes.c_int64 * len(cells))(*cells)
    if w.tiles is None and integer_kernels_take(w):  # (kept for those only: Packed.descriptor)
        w.descriptor = d
    return d


def integer_kernels_take(w: object) -> bool:
    """Whether ``int8.c`` multiplies ``w``: packed blocks of its types, in host memory, rows
    of whole 32-value blocks."""
    return (isinstance(w, Packed) and w.device.type == "cpu" and w.shape[-1] % 32 == 0
            and all(t in INTEGER_TYPES for t, _ in w.parts))


def reads_tiles(w: Packed, rows: int, group: int = 8, wide: bool = False) -> bool:
    """Whether an integer product of ``rows`` activation rows (scales per ``group`` values;
    ``wide``: 16 bits) by ``w`` reads tiles in memory for any of its parts: more than a few
    rows (with AVX-512 VNNI and 8 bits, up to four rows decode their blocks into registers
    instead, in the row kernels or in the tiles' order). Only then are kept tiles of use."""
    lib = library()
    return rows >= TILE_ROWS and lib is not None and any(
        lib.tg_reads_tiles(t, w.shape[-1], rows, group, wide) for t, _ in w.parts)


def tile_bytes(w: Packed) -> int:
    """What :func:`keep_tiles` would keep for ``w`` (0 without the C kernels)."""
    lib = library()
    return sum(lib.tg_tile_bytes(rows, w.shape[1]) for _, rows in w.parts) if lib else 0


def keep_tiles(w: Packed) -> bool:
    """Give ``w`` its integer kernels' tiles, built once (``int8.c``'s ``tg_build_tiles``:
    every block decoded and interleaved as a product that reads tiles (reads_tiles) does, 3/2
    bytes a value), if its owner allows it (``w.may_keep_tiles``: weights that stay where
    they are, within a memory allowance). A product of a few rows otherwise spends about a
    third of its time building them again. Whether ``w`` has them now."""
    if w.tiles is not None or not w.may_keep_tiles:
        return w.tiles is not None
    lib = library()
    if lib is None or not integer_kernels_take(w):
        return False
    tiles = torch.empty(tile_bytes(w), dtype=torch.uint8)  # (64-byte aligned, as the C needs)
    if lib.tg_build_tiles(matrix_descriptor(w), tiles.data_ptr()):
        return False
    w.tiles = tiles
    return True


def keep_tiles_for(w: Packed, rows: int, group: int = 8, wide: bool = False) -> None:
    """:func:`keep_tiles` where a product of ``rows`` rows by ``w`` reads tiles; nothing to ask
    the library once ``w`` has them or may not keep them (a decode step's every product)."""
    if w.tiles is None and w.may_keep_tiles and reads_tiles(w, rows, group, wide):
        keep_tiles(w)


def integer_linear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None,
                   group: int = 4, wide: bool = False, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``x @ w.T + bias`` by the integer kernels, ``x`` quantised as
    :func:`quantize_activations` does (CPU, ``w.shape[1]`` a multiple of 32); into ``out``
    (contiguous float32, ``x``'s rows by ``w``'s) if given."""
    lib = library()
    if lib is None:
        raise RuntimeError("the C kernels are unavailable")
    rows = x.shape[:-1].numel()
    if x.dim() == 2 or x.shape[-2] == 1:  # a token of each sequence
        keep_tiles_for(w, rows, group, wide)
    a = quantize_activations(x.reshape(rows, x.shape[-1]), group, wide)
    y = torch.empty(rows, w.shape[0], dtype=torch.float32) if out is None else out
    err = lib.tg_qmatmul(matrix_descriptor(w), a.q.data_ptr(),
                         None if a.low is None else a.low.data_ptr(), a.scales.data_ptr(),
                         a.sums.data_ptr(), a.group, rows, y.data_ptr())
    if err == -2:
        raise MemoryError(f"integer product of {rows} rows: out of memory for its panels")
    if err:
        raise ValueError(f"no integer kernel for a GGML type of {[t for t, _ in w.parts]}")
    if bias is not None:
        y += bias
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def grouped_linear(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """``x`` (G, M, K) times each of the G row blocks of ``w`` (G * N, K): (G, M, N), block g
    transposed times ``x[g]``. With integer activations set, by the integer kernels in one
    call (DeepSeek's absorbed attention: a query row per head); else (float activations, or
    a type of the float kernels only, as FP8), as packed_linear: few rows by the float
    kernels a block at a time, more by the decoded matrix."""
    G, M, K = x.shape
    N, stride = w.shape[0] // G, w.data.numel() // G
    fmt = ACTIVATION_FORMATS.get(getattr(_arith, "kind", "float32"))
    lib = library() if x.device.type == "cpu" and len(w.parts) == 1 else None
    integer = fmt is not None and lib is not None and integer_kernels_take(w)
    if lib is not None and not integer and M <= ROW_THRESHOLD:  # decoded in the float kernels
        xf, y = x.float().contiguous(), torch.empty(G, M, N)
        for g in range(G):
            if lib.tg_matmul(w.parts[0][0], w.data.data_ptr() + g * stride, N, K,
                             xf[g].data_ptr(), M, y[g].data_ptr(), N):
                break  # (a type without a packed kernel: decoded below)
        else:
            return y.to(x.dtype)
    if not integer:
        dtype = torch.float32 if x.device.type == "cpu" else x.dtype  # (as packed_linear)
        dense = dequantize_into(w, _scratch_buffer(w.shape, dtype, x.device))
        return torch.matmul(x.to(dtype), dense.view(G, -1, K).mT).to(x.dtype)
    a = quantize_activations(x.reshape(G * M, K), *fmt)
    y = torch.empty(G, M, N)
    ggml_type = w.parts[0][0]
    if lib.tg_qmatmul_grouped(ggml_type, w.data.data_ptr(), G, N, K, stride,
                              a.q.data_ptr(), None if a.low is None else a.low.data_ptr(),
                              a.scales.data_ptr(), a.sums.data_ptr(), a.group, M, y.data_ptr()):
        raise MemoryError(f"grouped integer product of {G} x {M} rows: out of memory")
    return y.to(x.dtype)


def packed_linear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w.dequantize(), bias)`` without inflating ``w`` when few rows multiply it;
    with integer activations set (:func:`set_activations`), the integer kernels' product
    (written into ``out`` if given; other paths may leave it alone, see layers.linear)."""
    rows = x.shape[:-1].numel()
    fmt = ACTIVATION_FORMATS.get(getattr(_arith, "kind", "float32"))
    if fmt is not None and x.device.type == "cpu" and integer_kernels_take(w) and library():
        if x.dim() > 2 and not fmt[1] and (amx := on_amx(x.shape[0])) is not None:
            if bool(amx.all()):
                return _bfloat16_linear(x, w, bias)
            return split_rows(amx, lambda r: packed_linear(x[r], w, bias))
        return integer_linear(x, w, bias, *fmt, out=out)
    lib = library() if x.device.type == "cpu" and rows <= ROW_THRESHOLD else None
    if lib is None:
        if x.device.type == "cpu":  # the C decoder writes float32; the BLAS multiplies it best
            dense = dequantize_into(w, _scratch_buffer(w.shape, torch.float32, x.device))
            return F.linear(x.float(), dense, bias if bias is None else bias.float()).to(x.dtype)
        dense = dequantize_into(w, _scratch_buffer(w.shape, x.dtype, x.device))
        return F.linear(x, dense, bias)
    xf = x.reshape(rows, x.shape[-1])
    if xf.dtype != torch.float32 or not xf.is_contiguous():
        xf = xf.float().contiguous()
    y = torch.empty(rows, w.shape[0], dtype=torch.float32)
    base, xp, yp = w.data.data_ptr(), xf.data_ptr(), y.data_ptr()
    for ggml_type, row, n, start, _ in layout(w.shape, w.parts):
        if lib.tg_matmul(ggml_type, base + start, n, w.shape[1], xp, rows, yp + 4 * row,
                         w.shape[0]):
            raise ValueError(f"no packed kernel for GGML type {ggml_type}")
    if bias is not None:
        y += bias
    return y.to(x.dtype).view(*x.shape[:-1], w.shape[0])


def amx_linear(x: torch.Tensor, w: Packed) -> torch.Tensor | None:
    """``x @ w.T`` (float32, x's shape but the last) with ``w`` decoded and ``x`` rounded to
    bfloat16, summed in float32 on AMX tiles by ``amx.c`` (each weight block decoded once, into
    the tiles' layout); None where AMX does not work here, this build has no AMX, or a part's
    type is not taken."""
    if w.device.type != "cpu" or w.shape[1] % 32 or not amx_engine():
        return None
    lib = library()
    N, K = w.shape
    rows = x.shape[:-1].numel()
    xb = _tile_rows(x)
    padded = xb.shape[0]
    y = torch.empty(padded, N)
    base = w.data.data_ptr()
    for ggml_type, row, n, start, _ in layout(w.shape, w.parts):
        if lib.tg_amx_linear(ggml_type, base + start, n, K, xb.data_ptr(), padded,
                             y.data_ptr() + 4 * row, N):
            return None
    return y[:rows].view(*x.shape[:-1], N)


def _tile_rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows in bfloat16 and zero rows after them up to a multiple of 32 (amx.c takes rows
    in 32s): x itself where it is so already (rounded by a producer, see rounded_linear)."""
    rows, K = x.shape[:-1].numel(), x.shape[-1]
    padded = -(-rows // 32) * 32
    if x.dtype == torch.bfloat16 and padded == rows and x.is_contiguous():
        return x.view(rows, K)
    xb = torch.empty(padded, K, dtype=torch.bfloat16)
    to_bfloat16(x.reshape(rows, K), xb[:rows])
    xb[rows:].zero_()
    return xb


def amx_glu(x: torch.Tensor, gate_up: Packed, gelu: bool) -> torch.Tensor | None:
    """:func:`glu` of :func:`rounded_linear`'s product by ``gate_up`` = [gate | up], rounded to
    bfloat16, in one pass on AMX tiles (amx.c): bit for bit the two calls' result, without
    their float32 product (2 I values a row) going out to memory and back. None where it does
    not apply: no AMX here, a long row (past one decoded panel), or gate and up not each one
    part of a type the tiles take."""
    N, K = gate_up.shape
    I = N // 2
    if (x.dtype != torch.float32 or gate_up.device.type != "cpu" or K % 32 or I % 32
            or not amx_engine()):
        return None
    gate, up = gate_up.narrow(0, 0, I), gate_up.narrow(0, I, N)  # (views of its bytes)
    if len(gate.parts) != 1 or len(up.parts) != 1:
        return None
    rows = x.shape[:-1].numel()
    xb = _tile_rows(x)
    padded = xb.shape[0]
    h = torch.empty(padded, I, dtype=torch.bfloat16)
    if library().tg_amx_glu(gate.parts[0][0], gate.data.data_ptr(), up.parts[0][0],
                            up.data.data_ptr(), I, K, xb.data_ptr(), padded, int(gelu),
                            h.data_ptr()):
        return None
    return h[:rows].view(*x.shape[:-1], I)


def amx_engine() -> bool:
    """Whether amx.c multiplies here: built for AMX, and the tiles work in this process."""
    lib = library()
    return lib is not None and bool(lib.tg_amx_bf16()) and amx_usable()


def dense_bfloat16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                          ) -> torch.Tensor | None:
    """``x @ w.T + bias`` (bfloat16, x's shape but the last) for a bfloat16 matrix as it is
    stored (a bfloat16 checkpoint's), on AMX tiles by ``amx.c``: the matrix read in place,
    float32 sums rounded once, each row's numbers its own whatever the batch; None where AMX
    does not work here, this build has no AMX, or the tensors are not such."""
    if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.dim() != 2
            or x.device.type != "cpu" or w.device.type != "cpu" or not w.is_contiguous()
            or w.shape[1] % 32 or x.shape[-1] != w.shape[1] or not x.shape[:-1].numel()
            or not amx_engine()):
        return None
    lib = library()
    N, K = w.shape
    rows = x.shape[:-1].numel()
    xc = x.reshape(rows, K).contiguous()
    b = None if bias is None else bias.float().contiguous()  # added before the one rounding
    y = torch.empty(rows, N, dtype=torch.bfloat16)
    err = lib.tg_amx_dense(w.data_ptr(), N, K, xc.data_ptr(), rows,
                           None if b is None else b.data_ptr(), y.data_ptr(), N, 1)
    if err == -2:
        raise MemoryError(f"bfloat16 product of {rows} rows: out of memory for its buffers")
    return None if err else y.view(*x.shape[:-1], N)


def amx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  window: int = 0) -> torch.Tensor | None:
    """Causal attention of a prompt step's queries q (B, H, T, D) over the keys k and values
    v (B, KVH, S, D) whose last T are the queries' own (query t, at place p = S-T+t, sees keys
    0..p, or p-window+1..p for a sliding window), scaled by D**-0.5, on AMX tiles by
    ``amx.c``: bfloat16 inputs, float32 sums, the probabilities rounded to bfloat16. float32
    (B, H, T, D), laid out (B, T, H, D) for the output projection; None where AMX does not
    work here or the shapes are not such."""
    B, H, T, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    kv = kv_format(k, v)
    if (q.device.type != "cpu" or D % 32 or D > 256 or v.shape[-1] != D or H % KVH or T > S
            or q.dtype not in KV_FORMATS or kv is None or not amx_engine()):
        return None
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1 or k.stride(-2) != D or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(B, T, H, D).transpose(1, 2)
    err = library().tg_amx_attention(
        q.data_ptr(), KV_FORMATS[q.dtype], q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), v.data_ptr(), kv, k.stride(0), k.stride(1),
        B, H, KVH, T, S, D, window, D**-0.5, out.data_ptr(), *out.stride()[:3])
    if err == -2:
        raise MemoryError(f"attention of {B} x {T} queries over {S} keys: out of memory for "
                          "its buffers")
    return None if err else out


def to_bfloat16(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t.bfloat16()`` into ``out`` (contiguous, t's shape; None: a new tensor), to the bit.
    Threaded in C, several times faster than torch's conversion, for a float32 or float16
    CPU tensor whose last two dimensions are contiguous and whose others collapse into one
    stride (a slice of the cache's slots does); other tensors take torch's."""
    lib = library()
    out = torch.empty(t.shape, dtype=torch.bfloat16) if out is None else out
    if (lib is None or t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float16)
            or t.dim() < 2 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]
            or any(t.stride(d) != t.stride(d + 1) * t.shape[d + 1] for d in range(t.dim() - 3))):
        return out.copy_(t)
    rows, stride = t.shape[:-2].numel(), t.stride(-3) if t.dim() > 2 else 0
    lib.tg_bf16(t.data_ptr(), t.dtype == torch.float16, rows, t.shape[-2] * t.shape[-1],
                stride, out.data_ptr())
    return out


def _bfloat16_linear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T + bias`` with ``w`` decoded and ``x`` rounded to bfloat16, summed in float32
    on AMX tiles (tiergen's own, else torch's through oneDNN), as ``x``'s dtype."""
    return rounded_linear(x, w, bias).to(x.dtype)


def takes_rounded(w: torch.Tensor | Packed) -> bool:
    """Whether :func:`rounded_linear` multiplies by ``w``: where a prompt's rows are on AMX
    tiles (:func:`rows_on_amx`), a producer of a product's input (layers' MLP) may then round
    it to bfloat16 as it writes it, instead of the product reading it in float32 to round it."""
    return integer_kernels_take(w) and library() is not None


def rounded_linear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """float32 ``x @ w.T + bias`` of a prompt's rows on AMX tiles: ``x`` (float32, or already
    rounded to bfloat16) rounded to bfloat16, ``w`` decoded, sums in float32."""
    y = amx_linear(x, w)
    if y is None:
        dense = dequantize_into(w, _scratch_buffer(w.shape, torch.float32, x.device))
        half = _scratch_buffer(w.shape, torch.bfloat16, x.device).copy_(dense)
        y = F.linear(x.to(torch.bfloat16), half).float()
    if bias is not None:
        y += bias
    return y


def _cpu_float32(*ts: torch.Tensor) -> bool:
    for t in ts:  # a plain loop: this runs several times a layer at batch 1
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return True


# decode.c's KV_F32..., and tiergen.h's element types (tg_amx_attention's)
KV_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kv_format(k: torch.Tensor, v: torch.Tensor) -> int | None:
    """A CPU cache's K/V number format as the C kernels name it (:data:`KV_FORMATS`); None
    where they cannot take it (another dtype, K and V apart, not on the CPU)."""
    if k.device.type != "cpu" or v.dtype != k.dtype:
        return None
    return KV_FORMATS.get(k.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, shift: float = 0.0
             ) -> torch.Tensor | None:
    """``F.rms_norm(x, eps=eps) * (weight + shift)`` in one call for contiguous float32 CPU
    tensors (``weight`` None: no weight); None where the library cannot take them. A strided
    ``x`` (a slice of a batch's positions; Gemma's per-head q and k) is copied first: one pass
    where torch's rms_norm takes several, and a row's numbers stay those it has alone."""
    if not x.is_contiguous() and _cpu_float32(x):
        x = x.contiguous()
    if not (_cpu_float32(x) and x.is_contiguous()) or (
            weight is not None and not (_cpu_float32(weight) and weight.is_contiguous())):
        return None
    lib = library()
    if lib is None:
        return None
    n = x.shape[-1]
    out = torch.empty_like(x)
    lib.tg_rms_norm(x.data_ptr(), None if weight is None else weight.data_ptr(), shift,
                    x.numel() // n, n, eps, out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` for (rows, n): in one vectorised call for a float32 CPU tensor (torch's
    takes about 5x as long over a large vocabulary's logits)."""
    lib = library() if _cpu_float32(x) and x.dim() == 2 and x.is_contiguous() and x.shape[1] else None
    if lib is None:
        return x.argmax(-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.tg_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def glu(gate_up: torch.Tensor, gelu: bool, out: torch.Tensor | None = None,
        bfloat16: bool = False) -> torch.Tensor | None:
    """``act(gate) * up`` for ``gate_up`` (..., 2 I) = [gate | up]: act SiLU, or GELU's tanh
    form with ``gelu``, in one call for a contiguous float32 CPU tensor; None where the library
    cannot take it. With ``bfloat16`` the float32 values come out rounded to bfloat16, as
    :func:`to_bfloat16` would round them (the input of :func:`rounded_linear`)."""
    if not (_cpu_float32(gate_up) and gate_up.is_contiguous()):
        return None
    lib = library()
    if lib is None:
        return None
    I = gate_up.shape[-1] // 2
    if out is None:
        out = torch.empty(*gate_up.shape[:-1], I,
                          dtype=torch.bfloat16 if bfloat16 else torch.float32)
    lib.tg_glu(gate_up.data_ptr(), gate_up.numel() // (2 * I), I, int(gelu), out.data_ptr(),
               int(bfloat16))
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False
         ) -> torch.Tensor | None:
    """Rotary embedding of x (B, H, T, D) in the half-split layout (``pairs``: each rotated
    pair adjacent), cos and sin (B, 1, T, R), the first R numbers of each head rotated and the
    rest passed through, in one call for float32 CPU tensors; None where the library cannot
    take them."""
    B, H, T, D = x.shape
    R = cos.shape[-1]
    if (not _cpu_float32(x, cos, sin) or x.stride(-1) != 1 or R % 2 or R > D
            or cos.shape != (B, 1, T, R) or sin.shape != cos.shape):
        return None
    lib = library()
    if lib is None:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(B, H, T, D)
    strides = (ctypes.c_int64 * 3)(*x.stride()[:3])
    lib.tg_rope(x.data_ptr(), strides, B, H, T, D, R, cos.data_ptr(), sin.data_ptr(),
                int(pairs), out.data_ptr())
    return out


def delta_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """One token of the gated delta rule over states S (B, H, dk, dv), in place, in one call
    for float32 CPU tensors (q, k (B, H, dk), v (B, H, dv), log decay g (B, H, 1) or (B, H,
    dk), beta (B, H)): S <- S exp(g) + k ((v - (S exp(g))^T k) beta)^T; returns S^T q (B, H,
    dv), or None where the library cannot take them (S then unchanged)."""
    B, H, dk, dv = S.shape
    if not _cpu_float32(S, q, k, v, g, beta) or S.stride(-1) != 1 or g.shape[-1] not in (1, dk):
        return None
    lib = library()
    if lib is None:
        return None
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty(B, H, dv)
    strides = (ctypes.c_int64 * 3)(*S.stride()[:3])
    lib.tg_delta_step(S.data_ptr(), strides, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                      g.data_ptr(), g.shape[-1], beta.data_ptr(), B, H, dk, dv, out.data_ptr())
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor | None:
    """Attention of one query token per row, q (B, H, 1, D), over k (B, KVH, S, D) and
    v (B, KVH, S, Dv) where ``mask`` (B, 1, 1, S) allows, scaled by D**-0.5, in one call
    for CPU tensors: q float32 over a float32 or float16 cache, or q and the cache both
    bfloat16 (a bfloat16 model's; its scores and sums then float32, the output rounded to
    bfloat16 once); None where the library cannot take them."""
    B, H, T, D = q.shape
    kvh, S = k.shape[1], k.shape[2]
    kv = kv_format(k, v)
    if (q.device.type != "cpu" or q.dtype != (torch.bfloat16 if kv == 2 else torch.float32)
            or kv is None or T != 1 or k.shape[0] != B
            or v.shape[:3] != k.shape[:3]
            or k.stride(-1) != 1 or v.stride(-1) != 1 or H % kvh
            or (mask is not None and mask.shape != (B, 1, 1, S))):
        return None
    lib = library()
    if lib is None:
        return None
    qf = q.float().contiguous()
    if mask is not None:
        mask = mask.contiguous()
    out = torch.empty(B, H, 1, v.shape[-1])
    strides = (ctypes.c_int64 * 6)(*k.stride()[:3], *v.stride()[:3])
    if lib.tg_decode_attention(qf.data_ptr(), k.data_ptr(), v.data_ptr(),
                               None if mask is None else mask.data_ptr(), B, H, kvh, S, D,
                               v.shape[-1], strides, ctypes.byref(strides, 24), D**-0.5,
                               kv, 1, out.data_ptr()):
        raise MemoryError("decode attention: out of memory for its score buffer")
    return out.to(q.dtype)
