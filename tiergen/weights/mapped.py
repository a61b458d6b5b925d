"""Checkpoint files mapped into memory (a GGUF, a quantised cache): handing back the pages
that loading read but no weight uses.

A model's load reads some tensors only to make new ones from them: Q/K/V or gate/up joined
into one matrix where they do not lie back to back in the file, norms shifted, blocks decoded.
The copies are what compute reads; the file pages they were read from stay resident (10 MB of
SmolLM2's 98 MB file, 45 MB of Gemma 3 270M's) until the kernel needs the memory.
``MADV_PAGEOUT`` reclaims them at once, and loses nothing: a page changed through the
copy-on-write map stays as it is (there is no swap to write it to, or it goes to swap), and a
clean one is read from the file again if anything touches it later.
"""

from __future__ import annotations

import mmap
import platform
from collections.abc import Iterable

import numpy as np
import torch

from tiergen.weights.packed import Packed

MADV_PAGEOUT = 21  # Linux 5.4 and later (Python's mmap module does not name it)
PAGE = mmap.PAGESIZE  # madvise takes whole pages (4 KiB on x86, up to 64 KiB on ARM)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The first and one-past-last address of the bytes ``t`` reads."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def page_out_unused(data: np.memmap, live: Iterable[torch.Tensor | Packed | object]) -> int:
    """Hand back the pages of the map ``data`` that none of the tensors ``live`` (tensors and
    packed matrices; anything else is passed over) reads. Returns the bytes handed back (0
    where the system cannot)."""
    if platform.system() != "Linux" or getattr(data, "_mmap", None) is None:
        return 0
    base, size = data.ctypes.data, data.size
    spans = []
    for t in live:
        t = t.data if isinstance(t, Packed) else t
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            start, end = _extent(t)
            if start < base + size and end > base:
                spans.append((max(start, base) - base, min(end, base + size) - base))
    released, at = 0, 0
    for start, end in sorted(spans) + [(size, size)]:
        lo, hi = -(-at // PAGE) * PAGE, start // PAGE * PAGE  # whole pages between uses
        if hi > lo:
            try:
                data._mmap.madvise(MADV_PAGEOUT, lo, hi - lo)
            except OSError:  # a kernel before 5.4
                return released
            released += hi - lo
        at = max(at, end)
    return released
