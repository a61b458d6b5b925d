"""Storage: sequential disk reads with the page cache dropped, as the disk tier reads."""

from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import time
import uuid
from pathlib import Path

from tiergen.errors import TiergenError
from tiergen.paths import cache_dir
from tiergen.planner.calibrate import timing


DISK_CHUNK = 2**20  # read size: the disk tier reads one file per tensor, about a MiB or more
DISK_MIN = 2**20
DISK_RESERVE = 64 * 2**20  # free space left over after the disk test file


def disk_directory(directory: Path | str | None) -> Path:
    if directory is None:
        d = cache_dir()
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TiergenError(f"cannot create {d} for the disk test: {e.strerror or e}; "
                               "pass --dir with a writable directory") from None
        return d
    d = Path(directory).expanduser()
    if not d.exists():
        raise TiergenError(f"--dir {d} does not exist; create it or pass an existing "
                           "directory on the disk to measure")
    if not d.is_dir():
        raise TiergenError(f"--dir {d} is not a directory; pass a directory on the disk "
                           "to measure")
    return d


def _free_bytes(directory: Path) -> int:
    return shutil.disk_usage(directory).free


def _write_all(fd: int, data: memoryview, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        done += os.write(fd, data[: min(len(data), nbytes - done)])


def _read_all(fd: int, buf: memoryview, nbytes: int) -> None:
    """Read ``nbytes`` from offset 0 in ``len(buf)`` sequential chunks into the one buffer."""
    offset = 0
    while offset < nbytes:
        got = os.preadv(fd, [buf[: min(len(buf), nbytes - offset)]], offset)
        if got <= 0:
            raise TiergenError("the disk test file ended early; was it removed or truncated "
                               "by another program? Run calibrate again")
        offset += got


def _read_scattered(fd: int, buf: memoryview, nbytes: int) -> None:
    """Read ``nbytes`` in ``len(buf)`` chunks in a shuffled order: like the disk tier, which
    reads one file per tensor, each read starts where the kernel's readahead has not been."""
    chunks = list(range(0, nbytes, len(buf)))
    random.Random(0).shuffle(chunks)
    for offset in chunks:
        view = buf[:min(len(buf), nbytes - offset)]
        if os.preadv(fd, [view], offset) != len(view):
            raise OSError(5, "short read")


def _drop_cache(fd: int) -> None:
    """Evict the (clean, fsynced) file from the page cache, so reads come from the disk."""
    if hasattr(os, "posix_fadvise"):  # not on macOS or Windows: reads may then hit the cache
        with contextlib.suppress(OSError):  # a file system that ignores the advice
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def measure_disk(directory: Path, size: int) -> float:
    """Read bandwidth (bytes/s) of a ``size``-byte file in ``directory``, page cache dropped,
    in MiB reads at shuffled offsets (as the disk tier reads many files of a few MiB)."""
    free = _free_bytes(directory)
    if free < size + DISK_RESERVE:
        raise TiergenError(
            f"the disk test needs {size / 2**20:.0f} MiB free in {directory} (plus "
            f"{DISK_RESERVE // 2**20} MiB to spare) but only {free / 2**20:.0f} MiB is free; "
            "free some space, pass --dir on another disk, or a smaller --size")
    path = directory / f".tiergen-calibrate-{uuid.uuid4().hex}.tmp"
    fd = -1
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            chunk = min(DISK_CHUNK, size)
            _write_all(fd, memoryview(os.urandom(chunk)), size)  # random: no compression help
            os.fsync(fd)
        except OSError as e:
            raise TiergenError(f"cannot write the disk test file in {directory}: "
                               f"{e.strerror or e}; pass --dir with a writable directory that "
                               "has free space, or a smaller --size") from None
        buf = memoryview(bytearray(chunk))
        try:
            _drop_cache(fd)
            _read_all(fd, buf, chunk)  # warm-up: first chunk only
            best = math.inf
            n = 0
            start = time.perf_counter()
            while True:
                _drop_cache(fd)
                t0 = time.perf_counter()
                _read_scattered(fd, buf, size)
                best = min(best, time.perf_counter() - t0)
                n += 1
                spent = time.perf_counter() - start
                if n >= timing.REPEATS or spent >= timing.MAX_TIME:
                    return size / max(best, 1e-9)
        except OSError as e:
            raise TiergenError(f"reading the disk test file in {directory} failed: "
                               f"{e.strerror or e}; check the disk, or pass --dir on another "
                               "one") from None
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
