"""Measure the link between parallel ranks as their runs use it: point-to-point messages
(pipeline stages pass hidden states and tokens) and all-reduces (tensor-parallel shards sum
after every attention and MLP), each as a fixed cost per message plus bytes over a rate.

On one machine two ranks are started the way a parallel run starts them (gloo over
loopback, one thread each); under ``torchrun`` the ranks torchrun started are measured
(rank 0 with rank 1 for messages, all of them for the all-reduce).
"""

from __future__ import annotations

import os
import time

import torch

from tiergen.parallel.group import HIDDEN, Group, join_torchrun, launch, under_torchrun

SMALL, LARGE = 576, 1 << 20  # floats: a decode step's hidden row, and a 4 MB message
REPEATS = 60  # timed messages of each kind and size, after a few untimed


class _Busy:
    """A little compute before each message, as in a run: what a message costs a run then
    (other threads of both ranks compete for the cores, and waits end in wake-ups) is more
    than on an idle link."""

    def __init__(self) -> None:
        self.w, self.x = torch.randn(1536, 576), torch.randn(1, 576)
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            self()
            times.append(time.perf_counter() - t)
        self.seconds = sorted(times)[len(times) // 2]

    def __call__(self) -> None:
        for _ in range(3):
            torch.nn.functional.linear(self.x, self.w)


def _timed(step, busy: _Busy, repeats: int) -> float:
    """Mean seconds of ``step()`` after the compute (a run waits for every message, not
    the fastest)."""
    start = time.perf_counter()
    for _ in range(repeats):
        busy()
        step()
    return max((time.perf_counter() - start) / repeats - busy.seconds, 1e-7)


def _trip(group: Group, x: torch.Tensor) -> None:
    """A send from rank 0 to rank 1 and back (other ranks sit it out)."""
    if group.rank == 0:
        group.send([x], 1, HIDDEN)
        group.recv([(x.shape, x.dtype)], 1, HIDDEN)
    elif group.rank == 1:
        (y,) = group.recv([(x.shape, x.dtype)], 0, HIDDEN)
        group.send([y], 0, HIDDEN)
    group.flush()


def _measure(group: Group) -> dict[str, float]:
    """Run on every rank alike; rank 0's result is the measurement."""
    busy = _Busy()
    trip, reduce = {}, {}
    for n in (SMALL, LARGE):
        x = torch.zeros(n)
        _timed(lambda: _trip(group, x), busy, 3)  # warm-up: connections and buffers
        trip[n] = _timed(lambda: _trip(group, x), busy, REPEATS)
        _timed(lambda: group.all_reduce(x), busy, 3)
        reduce[n] = _timed(lambda: group.all_reduce(x), busy, REPEATS)
    latency, big = trip[SMALL] / 2, LARGE * 4
    return dict(latency=latency, bandwidth=big / max(trip[LARGE] / 2 - latency, 1e-9),
                reduce_latency=reduce[SMALL],
                reduce_bandwidth=big / max(reduce[LARGE] - reduce[SMALL], 1e-9))


def _worker(group: Group) -> None:
    """A rank other than 0: measure with rank 0, then wait for it to close the group."""
    _measure(group)
    group.next_command()


def measure_link(timeout: float = 60.0) -> dict[str, float] | None:
    """The link's ``latency`` (seconds per message), ``bandwidth`` (bytes/s),
    ``reduce_latency`` and ``reduce_bandwidth`` (of a float32 all-reduce), on rank 0;
    None on torchrun's other ranks, which only take part."""
    if under_torchrun():
        group = join_torchrun(timeout, int(os.environ["WORLD_SIZE"]))
    else:
        group = launch(2, 2, timeout, _worker, threads=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        if group.rank != 0:
            _worker(group)
            return None
        return _measure(group)
    finally:
        torch.set_num_threads(threads)
        group.close()
