"""Memory: host RAM copies, and pinned copies between host and a CUDA device."""

from __future__ import annotations

import torch

from tiergen.planner.calibrate.timing import cpu_seconds, cuda_seconds


COPY_BYTES = 128 * 2**20  # host memcpy and host<->device copies


def measure_host_memcpy() -> float:
    nbytes = COPY_BYTES
    src = torch.ones(nbytes, dtype=torch.uint8)  # written now, so no lazy zero pages
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return nbytes / cpu_seconds(lambda: dst.copy_(src))


def measure_transfers(dev: torch.device) -> tuple[float, float]:
    """(host->device, device->host) bytes/s between pinned host memory and ``dev``."""
    nbytes = COPY_BYTES
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    h2d = nbytes / cuda_seconds(lambda: device_buf.copy_(host, non_blocking=True), dev, inner=4)
    d2h = nbytes / cuda_seconds(lambda: host.copy_(device_buf, non_blocking=True), dev, inner=4)
    return h2d, d2h
