"""How calibration times a measurement: the best of a few timed repeats after a warm-up
(noise on a busy machine only ever makes a run slower)."""

from __future__ import annotations

import math
import time

import torch


REPEATS = 3
MIN_TIME = 0.3
MAX_TIME = 2.0
CUDA_INNER = 10  # calls between a pair of CUDA events (launch overhead hides behind the queue)


def cpu_seconds(fn, quick: bool = False) -> float:
    """Best wall time of ``fn()`` after a warm-up (``quick``: a third of the time)."""
    fn()
    best = math.inf
    n = 0
    least, most = (MIN_TIME / 3, MAX_TIME / 3) if quick else (MIN_TIME, MAX_TIME)
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
        spent = time.perf_counter() - start
        if (n >= REPEATS and spent >= least) or spent >= most:
            return max(best, 1e-9)


def cuda_seconds(fn, dev: torch.device, inner: int | None = None) -> float:
    """Best GPU time of one ``fn()``: ``inner`` calls between two CUDA events, after a warm-up."""
    inner = inner or CUDA_INNER
    with torch.cuda.device(dev):
        fn()
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        best = math.inf
        n = 0
        start = time.perf_counter()
        while True:
            begin.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) / 1e3 / inner)  # elapsed_time is in ms
            n += 1
            spent = time.perf_counter() - start
            if (n >= REPEATS and spent >= MIN_TIME) or spent >= MAX_TIME:
                return max(best, 1e-9)


def seconds(fn, dev: torch.device, quick: bool = False) -> float:
    return cuda_seconds(fn, dev) if dev.type == "cuda" else cpu_seconds(fn, quick)
