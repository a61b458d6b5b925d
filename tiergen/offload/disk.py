"""The disk tier: a model's fused layer weights read straight from the checkpoint where they
lie there as they are used, else from a converted copy; and spill files for KV cache and
hidden states.

Read in place (``CheckpointWeights``): a fused tensor that is a concatenation of row ranges of
checkpoint tensors stored as it is used (a Llama layer's fused q/k/v is q, k and v one after
the other; in the compute dtype, or in a GGUF file's quantised blocks kept packed) is read
range by range from the checkpoint's files into the buffer, so there is nothing to convert
and no second copy on disk. Only the other tensors (llama.cpp's permuted Q/K rows, stacked
experts, ...) are converted.

Weights are converted once into ``<offload_dir>/<key>/``: one raw file per tensor (read in one
large sequential ``preadv`` straight into a reusable buffer, no parsing) and a manifest with
each file's dtype, shape, size and CRC32 (and, for stacked tensors such as routed experts,
a CRC32 per row, since those are read one row at a time). Conversion writes into a temporary sibling directory
and renames it into place only when complete, so an interrupted conversion never leaves a
directory that a later run trusts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
import uuid
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from tqdm import tqdm

from tiergen.errors import TiergenError
from tiergen.models.base import ModelFamily
from tiergen.weights import WeightSource
from tiergen.weights.quant import tensor_nbytes

FORMAT = 3
MANIFEST = "manifest.json"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def write_file(path: Path, t: torch.Tensor) -> int:
    """Write a tensor's raw bytes; return their CRC32."""
    data = _as_bytes(t.detach().contiguous().cpu())
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return zlib.crc32(data)


def row_crcs(t: torch.Tensor) -> list[int]:
    """CRC32 of each row (along the first dimension) of a contiguous CPU tensor."""
    data = _as_bytes(t.detach().contiguous().cpu())
    step = len(data) // max(len(t), 1)
    return [zlib.crc32(data[i * step:(i + 1) * step]) for i in range(len(t))]


def read_exact(fd: int, out: memoryview, offset: int, what: str) -> None:
    got = os.preadv(fd, [out], offset)
    if got != len(out):
        raise TiergenError(f"{what} is shorter than expected ({got} of {len(out)} bytes); "
                           "the offload directory is damaged: delete it and run again")


class OffloadedWeights:
    """Packed layer tensors on disk, read by name into caller-owned buffers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        manifest = json.loads((directory / MANIFEST).read_text())
        self.entries: dict[str, dict] = manifest["tensors"]
        self._verified: set = set()  # keys (and (key, row) pairs) whose checksum passed
        self.rows_read = 0
        self._lock = threading.Lock()
        for e in self.entries.values():
            path = directory / e["file"]
            size = path.stat().st_size if path.exists() else -1
            if size != e["nbytes"]:
                raise TiergenError(f"offload file {path} has {size} bytes, the manifest says "
                                   f"{e['nbytes']}; the offload directory {directory} is damaged: "
                                   "delete it and run again to convert afresh")

    @staticmethod
    def key(layer: int, name: str) -> str:
        return f"{layer}/{name}"

    def shape(self, layer: int, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        e = self.entries[self.key(layer, name)]
        return tuple(e["shape"]), _dtype(e["dtype"])

    def read_into(self, layer: int, name: str, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (contiguous CPU tensor of the right size) with the tensor's bytes.

        The first read of each file in a process checks its CRC32, so a corrupted file is an
        error rather than wrong output.
        """
        key = self.key(layer, name)
        e = self.entries[key]
        path = self.directory / e["file"]
        buf = _as_bytes(out)
        if len(buf) != e["nbytes"]:
            raise ValueError(f"buffer of {len(buf)} bytes for {key} of {e['nbytes']}")
        fd = os.open(path, os.O_RDONLY)
        try:
            read_exact(fd, buf, 0, f"offload file {path}")
        finally:
            os.close(fd)
        if key not in self._verified:
            self._verify(zlib.crc32(buf) == e["crc32"], path)
            self._verified.add(key)
        return out

    def read_row(self, layer: int, name: str, row: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` with row ``row`` (along the first dimension) of a stacked tensor, e.g.
        one routed expert, reading only that row's bytes."""
        key = self.key(layer, name)
        e = self.entries[key]
        path = self.directory / e["file"]
        buf = _as_bytes(out)
        size = e["nbytes"] // e["shape"][0]
        if len(buf) != size:
            raise ValueError(f"buffer of {len(buf)} bytes for a row of {key} of {size}")
        fd = os.open(path, os.O_RDONLY)
        try:
            # the next row is another expert, rarely the next one wanted: no read-ahead (with
            # the kernel's default window it read up to 1.7x the routed experts' bytes)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            read_exact(fd, buf, row * size, f"offload file {path}")
        finally:
            os.close(fd)
        with self._lock:  # (experts are read on several threads at once)
            self.rows_read += 1
        if (key, row) not in self._verified:
            self._verify(zlib.crc32(buf) == e["rows"][row], path)
            self._verified.add((key, row))
        return out

    def _verify(self, ok: bool, path: Path) -> None:
        if not ok:
            raise TiergenError(f"offload file {path} is corrupt (checksum mismatch); delete "
                               f"{self.directory} and run again to convert afresh")

    @classmethod
    def open_or_convert(cls, root: Path, key: str, num_layers: int,
                        produce: Callable[[int], dict[str, torch.Tensor]],
                        progress: bool = True) -> OffloadedWeights:
        """Reuse ``root/key`` if a complete conversion is there, else convert layer by layer."""
        final = root / key
        if (final / MANIFEST).exists():
            return cls(final)
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".{key}.partial-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
        except OSError as e:
            raise TiergenError(f"cannot write the offload directory {root}: {e.strerror}; "
                               "pass a writable offload_dir") from None
        try:
            entries = {}
            for layer in tqdm(range(num_layers), desc="converting weights for offload",
                              unit="layer", disable=not progress):
                for name, t in produce(layer).items():
                    file = f"{layer}.{name}.bin"
                    crc = write_file(tmp / file, t)
                    entries[cls.key(layer, name)] = {
                        "file": file, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape), "nbytes": t.nbytes, "crc32": crc}
                    if name.startswith("experts."):  # stacked experts, read one by one
                        entries[cls.key(layer, name)]["rows"] = row_crcs(t)
            manifest = {"format": FORMAT, "key": key, "tensors": entries}
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            try:
                os.rename(tmp, final)
            except OSError:  # another process finished the same conversion first
                if not (final / MANIFEST).exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise TiergenError(f"converting weights into {root} failed: {e.strerror or e}; "
                               "check free space and permissions") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls(final)


Segments = list[tuple[str, int, int]]  # (checkpoint tensor, first row, rows)
_CODE = 2.0**36  # probe values: tensor index * _CODE + row * _ROW + _MARK
_ROW = 256
_MARK = 0.5  # scaling or shifting a code moves it off the mark


def layer_segments(fuse: Callable[[dict], Mapping[str, torch.Tensor]],
                   specs: Mapping[str, tuple[int, ...]]) -> dict[str, Segments]:
    """For each tensor ``fuse`` makes of a layer's checkpoint tensors (``specs``: their names
    and shapes), the row ranges of checkpoint tensors that, one after the other, are its rows;
    a tensor that is anything else (scaled, transposed, stacked, cast) is left out.

    Found by fusing probe tensors (see :func:`_fused_probe`)."""
    return all_segments(fuse, specs)[0]


def all_segments(fuse: Callable[[dict], Mapping[str, torch.Tensor]],
                 specs: Mapping[str, tuple[int, ...]]
                 ) -> tuple[dict[str, Segments], dict[str, list[Segments]]]:
    """:func:`layer_segments`, and from the same fusing, for the stacked tensors ``fuse``
    makes (E, rows, ...), the runs of each of their E matrices (routed experts) or vectors
    (their biases), where every one is found."""
    plain, stacked = {}, {}
    for name, t in _fused_probe(fuse, specs).items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float64:
            continue
        # a matrix probes as (rows, 1), a vector as (rows,); a stack of matrices as
        # (E, rows, 1), of vectors as (E, rows)
        if t.dim() == 1 or (t.dim() == 2 and t.shape[1] == 1):
            if (runs := _runs(t, list(specs), specs)) is not None:
                plain[name] = runs
        elif t.dim() == 2 or (t.dim() == 3 and t.shape[2] == 1):
            runs = [_runs(m, list(specs), specs) for m in t]
            if runs and all(r is not None for r in runs):
                stacked[name] = runs
    return plain, stacked


def _fused_probe(fuse: Callable[[dict], Mapping[str, torch.Tensor]],
                 specs: Mapping[str, tuple[int, ...]]) -> Mapping[str, object]:
    """``fuse`` applied to probe tensors of one column whose rows hold codes naming (tensor,
    row): exact in float64, and spaced so that any arithmetic on them shows ({} where the
    fusing fails)."""
    probe = {}
    for i, (name, shape) in enumerate(specs.items()):
        rows = torch.arange(shape[0], dtype=torch.float64) * _ROW + i * _CODE + _MARK
        probe[name] = rows.reshape(-1, *[1] * (len(shape) - 1))
    try:
        return fuse(probe)
    except Exception:  # a family whose fusing needs real shapes: convert instead
        return {}


def _runs(t: torch.Tensor, names: list[str], specs: Mapping[str, tuple[int, ...]]
          ) -> Segments | None:
    """Decode a fused probe's row codes into runs (tensor, first row, rows); None when a code
    is off its mark (the rows were changed) or names no row of a tensor of t's rank."""
    codes = t.reshape(-1)
    index = torch.floor(codes / _CODE)  # exact: powers of two, codes well under 2**53
    rest = codes - index * _CODE
    row = torch.floor(rest / _ROW)
    if codes.numel() == 0 or not bool(((rest - row * _ROW) == _MARK).all()):
        return None
    if not bool(((index >= 0) & (index < len(names))).all()):
        return None
    index, row = index.long(), row.long()
    limits = torch.tensor([specs[n][0] if len(specs[n]) == t.dim() else 0 for n in names])
    if not bool((row < limits[index]).all()):
        return None
    starts = torch.ones_like(row, dtype=torch.bool)
    starts[1:] = (index[1:] != index[:-1]) | (row[1:] != row[:-1] + 1)
    first = starts.nonzero().flatten().tolist() + [len(row)]
    return [(names[int(index[a])], int(row[a]), b - a) for a, b in zip(first, first[1:])]


Entry = tuple[tuple[int, ...], torch.dtype, list[tuple[Path, int, int]]]  # shape, dtype, ranges


def in_place_entries(source: WeightSource, layer_specs: list[dict[str, tuple[int, ...]]],
                     segments: list[dict[str, Segments]], dtype: torch.dtype,
                     blocks: list[dict[str, tuple[tuple[int, int], ...]]]) -> dict[str, Entry]:
    """The fused layer tensors (``segments``: each layer's, from :func:`layer_segments`)
    that are row ranges of checkpoint tensors stored as fusing leaves them: in ``dtype``, or
    (those in ``blocks``, kept in GGML blocks) in the blocks' types. Keyed as
    ``OffloadedWeights.key``; a tensor that is anything else is left out."""
    entries: dict[str, Entry] = {}
    for j, (specs, layer) in enumerate(zip(layer_specs, segments)):
        for name, runs in layer.items():
            entry = _entry(source, specs, runs, dtype, blocks[j].get(name))
            if entry is not None:
                entries[OffloadedWeights.key(j, name)] = entry
    return entries


def in_place_rows(source: WeightSource, layer_specs: list[dict[str, tuple[int, ...]]],
                  segments: list[dict[str, list[Segments]]], dtype: torch.dtype,
                  blocks: list[dict[str, tuple[tuple[int, int], ...]]]) -> dict[str, list[Entry]]:
    """As :func:`in_place_entries`, for stacked tensors (``segments``: each layer's, from
    :func:`all_segments`): an entry per matrix of the stack (a routed expert, read one at
    a time), where every one lies in the checkpoint as it is used."""
    out: dict[str, list[Entry]] = {}
    for j, (specs, layer) in enumerate(zip(layer_specs, segments)):
        for name, per_row in layer.items():
            entries = [_entry(source, specs, runs, dtype, blocks[j].get(name)) for runs in per_row]
            if all(e is not None for e in entries):
                out[OffloadedWeights.key(j, name)] = entries
    return out


def _entry(source: WeightSource, specs: dict[str, tuple[int, ...]], runs: Segments, dtype: torch.dtype,
           parts_wanted: tuple[tuple[int, int], ...] | None) -> Entry | None:
    ranges, rows, width, parts = [], 0, None, []
    for raw, first, count in runs:
        where = source.locate(raw)
        if where is None or where[3] != specs[raw]:
            return None
        path, offset, stored, shape = where
        if parts_wanted is None:  # plain rows in the compute dtype
            if stored != dtype:
                return None
            row_bytes = dtype.itemsize * math.prod(shape[1:])
        else:  # GGML blocks (stored is their type)
            if isinstance(stored, torch.dtype) or len(shape) != 2:
                return None
            row_bytes = tensor_nbytes(stored, shape[1])
            if parts and parts[-1][0] == stored:
                parts[-1] = (stored, parts[-1][1] + count)
            else:
                parts.append((stored, count))
        if width not in (None, shape[1:]):
            return None
        width, rows = shape[1:], rows + count
        ranges.append((path, offset + first * row_bytes, count * row_bytes))
    if parts_wanted is None:
        return (rows, *width), dtype, ranges
    if tuple(parts) != tuple(parts_wanted):
        return None
    return (sum(n for _, _, n in ranges),), torch.uint8, ranges


class CheckpointWeights:
    """Packed layer tensors read range by range from the checkpoint's own files (see the
    module docstring): the same reads as ``OffloadedWeights`` without a converted copy.
    Tensors that are not in the checkpoint as they are used come from ``converted``."""

    def __init__(self, entries: dict[str, Entry], converted: OffloadedWeights | None = None,
                 rows: dict[str, list[Entry]] | None = None) -> None:
        self.entries = entries  # key -> (shape, dtype, [(file, offset, bytes)])
        self.rows = rows or {}  # key of a stacked tensor -> an entry per row
        self.converted = converted
        self.rows_read = 0
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}
        # routed experts are read without read-ahead: the next bytes are another expert,
        # rarely the next one wanted (a descriptor of their own: the advice is per descriptor)
        self._row_fds: dict[Path, int] = {}
        ends: dict[Path, int] = {}
        for _, _, parts in [*entries.values(), *(e for es in self.rows.values() for e in es)]:
            for path, offset, nbytes in parts:
                ends[path] = max(ends.get(path, 0), offset + nbytes)
        for path, end in ends.items():
            self._fds[path] = os.open(path, os.O_RDONLY)
            if os.fstat(self._fds[path]).st_size < end:
                self.close()
                raise TiergenError(f"{path} is shorter than its header says; the "
                                   "checkpoint is truncated: re-download it")

    def shape(self, layer: int, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        key = OffloadedWeights.key(layer, name)
        if key in self.rows:
            shape, dtype, _ = self.rows[key][0]
            return (len(self.rows[key]), *shape), dtype
        if key not in self.entries:
            return self.converted.shape(layer, name)
        shape, dtype, _ = self.entries[key]
        return shape, dtype

    def read_into(self, layer: int, name: str, out: torch.Tensor) -> torch.Tensor:
        key = OffloadedWeights.key(layer, name)
        if key in self.rows:
            for row in range(len(self.rows[key])):
                self._read(self._fds, self.rows[key][row], out[row], key)
            return out
        if key not in self.entries:
            return self.converted.read_into(layer, name, out)
        return self._read(self._fds, self.entries[key], out, key)

    def read_row(self, layer: int, name: str, row: int, out: torch.Tensor) -> torch.Tensor:
        key = OffloadedWeights.key(layer, name)
        if key not in self.rows:
            return self.converted.read_row(layer, name, row, out)
        with self._lock:  # (experts are read on several threads at once)
            for path, _, _ in self.rows[key][row][2]:
                if path not in self._row_fds:
                    self._row_fds[path] = os.open(path, os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(self._row_fds[path], 0, 0, os.POSIX_FADV_RANDOM)
            self.rows_read += 1
        return self._read(self._row_fds, self.rows[key][row], out, key)

    @staticmethod
    def _read(fds: dict[Path, int], entry: Entry, out: torch.Tensor, key: str) -> torch.Tensor:
        buf, pos = _as_bytes(out), 0
        for path, offset, nbytes in entry[2]:
            read_exact(fds[path], buf[pos:pos + nbytes], offset, f"checkpoint file {path}")
            pos += nbytes
        if pos != len(buf):
            raise ValueError(f"buffer of {len(buf)} bytes for {key} of {pos}")
        return out

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._row_fds.values()]:
            os.close(fd)
        self._fds.clear()
        self._row_fds.clear()

    def __del__(self) -> None:
        self.close()


def open_store(root: Path, model_id: str, source: WeightSource, model: ModelFamily,
               dtype: torch.dtype, shapes: list[dict[str, tuple[int, ...]]],
               blocks: list[dict], compress: tuple[int, int] | None,
               is_expert: Callable[[str], bool],
               convert: Callable[[int, list[str], dict[str, Segments]], dict[str, torch.Tensor]]
               ) -> OffloadedWeights | CheckpointWeights:
    """The disk tier of a model's fused layer tensors (``shapes``, per layer): read in place
    from the checkpoint's files where they lie there as they are used (routed experts expert
    by expert), the rest converted once into ``root``. ``convert(j, names, segments)`` gives
    layer j's tensors ``names`` in stored form (``segments``: see :func:`layer_segments`)."""
    n = model.cfg.num_layers
    key = hashlib.sha256(f"{model_id}|{dtype}|{compress}|{blocks}|{FORMAT}"
                         .encode()).hexdigest()[:16]
    specs = [model.layer_specs(j) for j in range(n)]
    both = [all_segments(lambda raw, j=j: model.fuse_layer(j, raw), specs[j]) for j in range(n)]
    segments = [plain for plain, _ in both]
    found = {} if compress else in_place_entries(
        source, specs, [{t: r for t, r in layer.items() if not is_expert(t)} for layer in segments],
        dtype, blocks)
    rows = {}  # routed experts, read expert by expert where each lies in the checkpoint as used
    if not compress and any(is_expert(t) for layer in shapes for t in layer):
        rows = in_place_rows(source, specs, [stacked for _, stacked in both], dtype, blocks)
    rest = [[t for t in shapes[j] if OffloadedWeights.key(j, t) not in found | rows]
            for j in range(n)]
    converted = None
    if any(rest):  # what the checkpoint does not hold as it is used is converted
        if found or rows:
            key += "-" + hashlib.sha256(repr(rest).encode()).hexdigest()[:8]
        converted = OffloadedWeights.open_or_convert(
            root, key, n, lambda j: convert(j, rest[j], segments[j]))
    return CheckpointWeights(found, converted, rows) if found or rows else converted


class SpillFile:
    """A fixed-size scratch file for tensors that the policy puts on disk (KV cache,
    hidden states). Reads and writes go straight between tensors and the file."""

    def __init__(self, directory: Path, nbytes: int) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.path = directory / f"spill-{uuid.uuid4().hex}.bin"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self.fd, nbytes)
        except OSError as e:
            raise TiergenError(f"cannot create a spill file in {directory}: {e.strerror}; "
                               "pass a writable offload_dir with free space") from None
        self.nbytes = nbytes

    def write(self, t: torch.Tensor, offset: int = 0) -> None:
        data = _as_bytes(t.contiguous().cpu())
        if os.pwritev(self.fd, [data], offset) != len(data):
            raise TiergenError(f"short write to {self.path}; is the disk full?")

    def read_into(self, out: torch.Tensor, offset: int = 0) -> torch.Tensor:
        read_exact(self.fd, _as_bytes(out), offset, f"spill file {self.path}")
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)

    def __del__(self) -> None:
        self.close()
