"""Where tiergen keeps what it writes for later runs: converted weights, built kernels,
calibrations."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from tiergen.errors import TiergenError


def cache_dir() -> Path:
    """$TIERGEN_CACHE, else $XDG_CACHE_HOME/tiergen, else ~/.cache/tiergen."""
    if os.environ.get("TIERGEN_CACHE"):
        return Path(os.environ["TIERGEN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "tiergen"


@contextmanager
def written_atomically(path: Path, what: str) -> Iterator[BinaryIO]:
    """A file to write ``path``'s bytes into: a temporary file beside it, synced and renamed
    into place when the block ends, removed if it raises, so no half-written file is ever
    taken for a finished one. ``what`` names it in the error an OSError becomes."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    except OSError as e:
        raise TiergenError(f"cannot write {what} to {path.parent} ({e}); set TIERGEN_CACHE to "
                           "a writable directory") from None
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        raise TiergenError(f"cannot write {what} to {path} ({e})") from None
    finally:
        tmp.unlink(missing_ok=True)
