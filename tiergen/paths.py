"""Where tiergen keeps what it writes for later runs: converted weights, built kernels,
calibrations."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TIERGEN_CACHE, else $XDG_CACHE_HOME/tiergen, else ~/.cache/tiergen."""
    if os.environ.get("TIERGEN_CACHE"):
        return Path(os.environ["TIERGEN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "tiergen"
