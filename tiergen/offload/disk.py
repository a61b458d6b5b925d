"""The disk tier: a converted copy of a model's packed layer weights, and spill files for KV
cache and activations.

Weights are converted once into ``<offload_dir>/<key>/``: one raw file per tensor (read in one
large sequential ``preadv`` straight into a reusable buffer, no parsing) and a manifest with
each file's dtype, shape, size and CRC32 (and, for stacked tensors such as routed experts,
a CRC32 per row, since those are read one row at a time). Conversion writes into a temporary sibling directory
and renames it into place only when complete, so an interrupted conversion never leaves a
directory that a later run trusts.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from tiergen.errors import TiergenError

FORMAT = 2
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
            read_exact(fd, buf, row * size, f"offload file {path}")
        finally:
            os.close(fd)
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
                    if t.dim() == 3:
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


class SpillFile:
    """A fixed-size scratch file for tensors that the policy puts on disk (KV cache,
    activations). Reads and writes go straight between tensors and the file."""

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
