"""Measure the speeds an offloading cost model needs, one module per kind: storage (disk
reads), memory (host RAM and host<->device copies), compute (matmuls at large and few-row
shapes, 4-bit unpacking, a layer call's overhead), attention (CPU decode attention, a
prompt's attention) and the link between parallel ranks (:mod:`tiergen.parallel.link`), each
timed as :mod:`.timing` says.

``calibrate()`` runs the measurements (a few seconds on a CPU); ``get()`` returns the cached
result for this machine (:mod:`tiergen.calibration`), measuring and saving it first when
there is none or the hardware changed.

On a CPU-only machine host and device are the same memory: ``host_to_device`` and
``device_to_host`` are then the host memory copy bandwidth."""

from __future__ import annotations

import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch

from tiergen.calibration import (ONE_THREAD, Calibration, calibrated_device, fingerprint, load,
                                 save)
from tiergen.devices import resolve_activations
from tiergen.errors import TiergenError
from tiergen.kernels import AMX_PROMPT, amx_prompt
from tiergen.offload.policy import parse_size
from tiergen.parallel import link as rank_link
from tiergen.planner.calibrate.attention import (PROMPT_ATTENTION, measure_cpu_attention,
                                                measure_prompt_attention)
from tiergen.planner.calibrate.compute import (GEMM, GEMV, LINEAR_ROWS, dtype_name, matmul_dtypes,
                                              measure_dequant, measure_gemv,
                                              measure_layer_overhead, measure_matmul, products)
from tiergen.planner.calibrate.memory import measure_host_memcpy, measure_transfers
from tiergen.planner.calibrate.storage import DISK_MIN, disk_directory, measure_disk


def calibrate(device: torch.device | str = "cpu", directory: Path | None = None,
              size: int = 256 * 2**20, progress: bool = False, link: bool = True) -> Calibration:
    """Measure this machine with ``device`` as the compute device.

    The disk test writes a ``size``-byte file into ``directory`` (default: the tiergen cache
    directory), drops it from the page cache and reads it back sequentially; the file is
    always removed, also on errors and Ctrl-C. ``link``: also measure the link between two
    parallel ranks (a second process for a few seconds; under torchrun, the ranks it started).
    """
    t_start = time.perf_counter()
    dev = calibrated_device(device)
    size = parse_size(size)
    if size < DISK_MIN:
        raise TiergenError(f"the disk test size must be at least 1M, got {size} bytes; "
                           "pass e.g. --size 256M")
    where = disk_directory(directory)

    def step(what: str) -> None:
        if progress:
            print(f"calibrating: {what}", file=sys.stderr, flush=True)

    step(f"disk read ({size / 2**20:.0f} MiB in {where})")
    disk = measure_disk(where, size)
    step("host memory copy")
    memcpy = measure_host_memcpy()
    if dev.type == "cuda":
        step(f"pinned copies to and from {dev}")
        h2d, d2h = measure_transfers(dev)
    else:  # host and device are the same memory
        h2d = d2h = memcpy
    matmul: dict[str, float] = {}
    gemv: dict[str, float] = {}
    dequant: dict[str, float] = {}
    cache_unpack: dict[str, float] = {}
    linear_rows: dict[str, dict[str, float]] = {}
    prompt_attention: dict[str, float] = {}
    tiles = dev.type == "cpu" and amx_prompt(AMX_PROMPT, resolve_activations("auto", dev))
    for dtype in matmul_dtypes(dev):
        name = dtype_name(dtype)
        step(f"{name} matmul and batch-1 gemv on {dev}")
        matmul[name] = measure_matmul(dev, dtype)
        gemv[name] = measure_gemv(dev, dtype)
        dequant[name], cache_unpack[name] = measure_dequant(dev, dtype)
        step(f"{name} products at {', '.join(map(str, LINEAR_ROWS))} rows, dense and packed")
        linear_rows.update(products(dev, dtype, name))
        step(f"{name} attention of a prompt on {dev}")
        prompt_attention[name] = measure_prompt_attention(dev, dtype)
        if tiles and dtype == torch.float32:  # the integer path's long prompts: on the tiles
            prompt_attention[f"amx-{name}"] = measure_prompt_attention(dev, dtype, amx=True)
    step("CPU decode attention")
    attention = measure_cpu_attention()
    links: dict[str, float] = {}
    if link:
        step("the link between two parallel ranks")
        links = rank_link.measure_link(timeout=300.0) or {}
    return Calibration(
        hardware=fingerprint(dev), disk_read=disk, host_to_device=h2d, device_to_host=d2h,
        host_memcpy=memcpy, matmul=matmul, gemv=gemv, cpu_attention=attention, dequant=dequant,
        cache_unpack=cache_unpack, layer_overhead=measure_layer_overhead(dev),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        seconds=time.perf_counter() - t_start, device=str(dev), disk_directory=str(where),
        link=links, linear_rows=linear_rows, prompt_attention=prompt_attention)


def get(device: torch.device | str = "cpu", recalibrate: bool = False,
        progress: bool = False) -> Calibration:
    """The cached calibration for this machine and ``device``, or a fresh one (then saved)."""
    if not recalibrate:
        cal = load(device)
        if cal is not None:
            return cal
    cal = calibrate(device, progress=progress)
    try:
        save(cal)
    except TiergenError as e:  # the measurement is still good for this run
        warnings.warn(str(e), stacklevel=2)
    return cal


def _gbs(x: float) -> str:
    return f"{x / 1e9:.2f} GB/s"


def link_line(link: dict[str, float]) -> str:
    """The link between ranks as a user reads it."""
    if not link:
        return "not measured"
    return (f"{link['latency'] * 1e6:.0f} us + {_gbs(link['bandwidth'])} per message, "
            f"all-reduce {link['reduce_latency'] * 1e6:.0f} us + "
            f"{_gbs(link['reduce_bandwidth'])}")


def format_calibration(cal: Calibration) -> str:
    """A few human-readable lines (GB/s = 1e9 bytes/s, GFLOP/s)."""
    hw = cal.hardware
    machine = (f"{hw.get('cpu', '?')}, {hw.get('logical_cores', '?')} logical cores, "
               f"{hw.get('ram_gib', '?')} GiB RAM, torch {hw.get('torch', '?')} with "
               f"{hw.get('torch_threads', '?')} threads")
    if "gpu" in hw:
        machine += f"; {hw['gpu']} with {hw.get('gpu_memory_gib', '?')} GiB"
    same = "  (CPU: host and device are the same memory)" if cal.device_type == "cpu" else ""
    where = f"  ({cal.disk_directory})" if cal.disk_directory else ""
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in cal.matmul.items()) or "-"
    gemv = ", ".join(f"{k} {_gbs(v)}" for k, v in cal.gemv.items()) or "-"
    m, k, n = GEMM
    gk, gn = GEMV
    t = PROMPT_ATTENTION[2]
    prompt = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in cal.prompt_attention.items()) or "-"
    return "\n".join([
        f"calibration of {cal.device}: {machine}",
        f"  disk read        {_gbs(cal.disk_read)}{where}",
        f"  host -> device   {_gbs(cal.host_to_device)}{same}",
        f"  device -> host   {_gbs(cal.device_to_host)}{same}",
        f"  host memcpy      {_gbs(cal.host_memcpy)}",
        f"  matmul           {flops}  ({m}x{k} @ {k}x{n})",
        f"  gemv, batch 1    {gemv} of weights  (1x{gk} @ {gk}x{gn})",
        f"  CPU attention    {_gbs(cal.cpu_attention)} of float32 KV cache (decode)",
        f"  prompt attention {prompt} GFLOP/s  (one prompt of {t} tokens, causal)",
        "  4-bit unpacking  " + (", ".join(f"{k} {_gbs(v)}" for k, v in cal.dequant.items())
                                 or "-") + " of weights, " + (", ".join(
                                     f"{k} {_gbs(v)}" for k, v in cal.cache_unpack.items())
                                     or "-") + " of KV cache rows",
        f"  layer overhead   {cal.layer_overhead * 1e6:.0f} us per decoder layer call",
        "  products         " + (", ".join(
            f"{k} " + "/".join(f"{t[r] / 1e9:.2f}" for r in ("1", "8", "256") if r in t)
            for k, t in cal.linear_rows.items() if not k.endswith(ONE_THREAD)) or "-")
        + " G weights/s at 1/8/256 rows",
        "  rank link        " + link_line(cal.link),
        f"  measured {cal.measured_at} in {cal.seconds:.1f} s",
    ])
