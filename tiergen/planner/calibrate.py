"""Measure the speeds an offloading cost model needs: disk, host RAM, host<->device copies,
matmuls at large and batch-1 shapes, and CPU decode attention.

``calibrate()`` runs the measurements (a few seconds on a CPU); ``get()`` returns the cached
result for this machine, measuring and saving it first when there is none or the hardware
changed. The cache is ``~/.cache/tiergen/calibration.json`` (``$XDG_CACHE_HOME`` honoured):
one entry per device type ("cpu", "cuda"), each with a hardware fingerprint that must match
the current machine for the entry to be used.

Units: bandwidths are bytes per second (decimal: 1 GB/s = 1e9 B/s), compute is FLOP per
second (a multiply-add counts 2). Each figure is the best of a few timed repeats after a
warm-up: noise on a busy machine only ever makes a run slower, so the best run is the closest
to what the hardware does.

On a CPU-only machine host and device are the same memory: ``host_to_device`` and
``device_to_host`` are then the host memory copy bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from datetime import datetime, timezone
from pathlib import Path

# Safe here: importing this module ran tiergen/__init__ (the CPU guard) first.
import torch

from tiergen.errors import TiergenError
from tiergen.offload.policy import parse_size

# Shapes and sizes of the measurements. A transformer layer's GEMM at a large batch
# (compute-bound), the same weights streamed at batch 1 (memory-bound decode), decode
# attention over a float32 KV cache.
GEMM = (256, 1024, 4096)  # (M, K, N): (M, K) @ (K, N)
GEMV = (2048, 8192)  # (K, N): (1, K) @ (K, N)
GEMV_BYTES = 256 * 2**20  # weights cycled per gemv run: more than any L2/L3, so it hits RAM
LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64, 256)  # rows of the (rows, K) @ (K, N) products timed
LINEAR_BYTES = 64 * 2**20  # weights cycled at the few-row counts (those read weights)
ONE_THREAD = " x1"  # suffix of linear_rows measured with one thread (a parallel rank's share)
ATTENTION = (8, 8, 8, 2048, 64)  # (B, H, KVH, S, D): q (B, H, 1, D), K/V (B, KVH, S, D)
ATTENTION_BYTES = 256 * 2**20  # KV caches cycled per run (one per layer, as in decode)
COPY_BYTES = 128 * 2**20  # host memcpy and host<->device copies
DISK_CHUNK = 2**20  # read size: the disk tier reads one file per tensor, about a MiB or more
DISK_MIN = 2**20
DISK_RESERVE = 64 * 2**20  # free space left over after the disk test file

# Timing: a warm-up, then at least REPEATS runs and MIN_TIME seconds; stop after MAX_TIME.
REPEATS = 3
MIN_TIME = 0.3
MAX_TIME = 2.0
CUDA_INNER = 10  # calls between a pair of CUDA events (launch overhead hides behind the queue)

CACHE_FILE = "calibration.json"


@dataclass
class Calibration:
    """Measured speeds of one machine and compute device (bytes/s, FLOP/s)."""

    hardware: dict[str, str]  # fingerprint: cpu, cores, RAM, torch, threads (+ gpu on cuda)
    disk_read: float  # disk -> host RAM in MiB reads, page cache dropped
    host_to_device: float  # pinned host -> device copy; host memcpy on a CPU device
    device_to_host: float  # device -> pinned host copy; host memcpy on a CPU device
    host_memcpy: float  # host RAM -> host RAM copy (bytes copied per second)
    matmul: dict[str, float]  # dtype name -> FLOP/s of a (256, 1024) @ (1024, 4096) GEMM
    gemv: dict[str, float]  # dtype name -> weight bytes/s of (1, 2048) @ (2048, 8192)
    cpu_attention: float  # KV-cache bytes/s scanned by float32 decode attention on the CPU
    measured_at: str  # ISO 8601, UTC
    seconds: float  # how long calibration took
    device: str = "cpu"  # the compute device measured, e.g. "cpu" or "cuda:0"
    disk_directory: str = ""  # where the disk test file was written
    # dtype name -> bytes/s of full-precision output when unpacking 4-bit groups of 64: of
    # weight matrices, and of KV-cache rows (many small groups)
    dequant: dict[str, float] = field(default_factory=dict)
    cache_unpack: dict[str, float] = field(default_factory=dict)
    layer_overhead: float = 0.0  # seconds of dispatch per decoder layer call (a tiny layer)
    # between parallel ranks (tiergen.parallel.link): seconds per message ("latency") and
    # bytes/s ("bandwidth") of point-to-point messages, and the same of a float32 all-reduce
    # ("reduce_latency", "reduce_bandwidth"); empty where not measured
    link: dict[str, float] = field(default_factory=dict)
    # weight parameters/s of tiergen's linear at each row count of LINEAR_ROWS ("1", "2",
    # ...): by compute dtype name, and "packed-<dtype>" for GGML Q4_0 blocks multiplied packed;
    # the same with ONE_THREAD appended, measured with one thread (on a CPU of several)
    linear_rows: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type


# ----------------------------------------------------------------------------- machine


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tiergen`` or ``~/.cache/tiergen``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "tiergen"


def cache_path() -> Path:
    """Where ``save`` and ``load`` keep calibrations by default."""
    return cache_dir() / CACHE_FILE


def _resolve_device(device: torch.device | str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise TiergenError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise TiergenError(f"cannot calibrate {device}: CUDA is not available (torch "
                               f"{torch.__version__}); use --device cpu or install a CUDA "
                               "build of PyTorch")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise TiergenError(f"cannot calibrate {device}: there are only "
                               f"{torch.cuda.device_count()} CUDA devices")
        return torch.device("cuda", index)
    raise TiergenError(f"calibration supports cpu and cuda devices, not {dev.type!r}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 0


def fingerprint(device: torch.device | str = "cpu") -> dict[str, str]:
    """What a calibration depends on; a cached one is reused only if this still matches.

    GPU name and memory are part of it only for a CUDA device.
    """
    dev = _resolve_device(device)
    hw = {
        "cpu": _cpu_name(),
        "logical_cores": str(os.cpu_count() or 0),
        "ram_gib": f"{_ram_bytes() / 2**30:.1f}",
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        hw["gpu"] = props.name
        hw["gpu_memory_gib"] = f"{props.total_memory / 2**30:.1f}"
    return hw


def _matmul_dtypes(dev: torch.device) -> list[torch.dtype]:
    """The dtypes worth measuring on ``dev``.

    On a CPU: float32 and bfloat16 (natively where the CPU has it, else as ``linear`` runs it:
    widened to float32 from a few rows on). float16 is left out on CPUs: tiergen never picks
    it there, and PyTorch emulates it (hundreds of times slower than float32), so measuring it
    would take most of the calibration time. On CUDA: float32,
    float16, and bfloat16 where the GPU runs it natively (compute capability 8.0 and up, or
    ROCm), not where PyTorch would emulate it.
    """
    if dev.type == "cuda":
        out = [torch.float32, torch.float16]
        if torch.version.hip or torch.cuda.get_device_properties(dev).major >= 8:
            out.insert(1, torch.bfloat16)
        return out
    return [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------- timing


def _cpu_seconds(fn, quick: bool = False) -> float:
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


def _cuda_seconds(fn, dev: torch.device, inner: int | None = None) -> float:
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


def _seconds(fn, dev: torch.device, quick: bool = False) -> float:
    return _cuda_seconds(fn, dev) if dev.type == "cuda" else _cpu_seconds(fn, quick)


# ----------------------------------------------------------------------------- disk


def _disk_directory(directory: Path | str | None) -> Path:
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


def _measure_disk(directory: Path, size: int) -> float:
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
                if n >= REPEATS or spent >= MAX_TIME:
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


# ----------------------------------------------------------------------------- memory, compute


def _measure_host_memcpy() -> float:
    nbytes = COPY_BYTES
    src = torch.ones(nbytes, dtype=torch.uint8)  # written now, so no lazy zero pages
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return nbytes / _cpu_seconds(lambda: dst.copy_(src))


def _measure_transfers(dev: torch.device) -> tuple[float, float]:
    """(host->device, device->host) bytes/s between pinned host memory and ``dev``."""
    nbytes = COPY_BYTES
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    device_buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    h2d = nbytes / _cuda_seconds(lambda: device_buf.copy_(host, non_blocking=True), dev, inner=4)
    d2h = nbytes / _cuda_seconds(lambda: host.copy_(device_buf, non_blocking=True), dev, inner=4)
    return h2d, d2h


def _measure_matmul(dev: torch.device, dtype: torch.dtype) -> float:
    from tiergen.models.layers import linear  # as the model multiplies

    m, k, n = GEMM
    a = torch.randn(m, k, device=dev).to(dtype)
    w = torch.randn(n, k, device=dev).to(dtype)
    return 2 * m * k * n / _seconds(lambda: linear(a, w), dev)


def _measure_gemv(dev: torch.device, dtype: torch.dtype) -> float:
    from tiergen.models.layers import linear

    k, n = GEMV
    base = torch.randn(n, k, device=dev).to(dtype)
    count = max(1, math.ceil(GEMV_BYTES / base.nbytes))
    weights = [base] + [base.clone() for _ in range(count - 1)]
    x = torch.randn(1, k, device=dev).to(dtype)

    def run() -> None:
        for w in weights:
            linear(x, w)

    return count * base.nbytes / _seconds(run, dev)


def _random_q4_0(n: int, k: int, dev: torch.device):
    """An (n, k) matrix of random GGML Q4_0 blocks (each: a float16 scale, 32 4-bit values)."""
    from tiergen.weights.packed import Packed
    from tiergen.weights.quant import GGMLType

    blocks = torch.randint(0, 256, (n * k // 32, 18), dtype=torch.uint8)
    blocks[:, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    return Packed(blocks.reshape(-1).to(dev), (n, k), ((GGMLType.Q4_0, n),))


def _measure_linear_rows(dev: torch.device, dtype: torch.dtype, packed: bool = False
                         ) -> dict[str, float]:
    """Weight parameters/s that tiergen's ``linear`` multiplies by (rows, 2048) inputs, for
    each row count of LINEAR_ROWS: few rows read the weights (cycled through more memory
    than the caches hold, as a model's layers are), many rows compute. Each kind of weight
    has its own steps between the two (bfloat16 without native support, packed blocks)."""
    from tiergen.models.layers import linear

    k, n = GEMV
    first = _random_q4_0(n, k, dev) if packed else torch.randn(n, k, device=dev).to(dtype)
    weights = [first] + [(replace(first, data=first.data.clone()) if packed else first.clone())
                         for _ in range(max(1, LINEAR_BYTES // first.nbytes) - 1)]
    out = {}
    for rows in LINEAR_ROWS:
        x = torch.randn(rows, k, device=dev).to(dtype)
        use = weights if rows < 32 else weights[:1]

        def run() -> None:
            for w in use:
                linear(x, w)

        out[str(rows)] = len(use) * n * k / _seconds(run, dev, quick=True)
    return out


def _products(dev: torch.device, dtype: torch.dtype, name: str) -> dict[str, dict[str, float]]:
    """linear_rows's tables for ``dtype``: dense and packed, with all threads and (on a CPU
    of several) with one."""
    out = {}
    threads = torch.get_num_threads()
    for suffix, n in [("", threads)] + [(ONE_THREAD, 1)] * (dev.type == "cpu" and threads > 1):
        torch.set_num_threads(n)
        try:
            out[name + suffix] = _measure_linear_rows(dev, dtype)
            out[f"packed-{name}{suffix}"] = _measure_linear_rows(dev, dtype, packed=True)
        finally:
            torch.set_num_threads(threads)
    return out


def _measure_dequant(dev: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """Bytes/s of ``dtype`` output that unpacking 4-bit groups of 64 writes: for weight
    matrices the size of a small model's MLP, and for a KV cache's rows (a layer of 32
    sequences x 96 slots)."""
    from tiergen.offload.compress import dequantize, pack_rows, quantize, unpack_rows

    q = quantize(torch.randn(3072, 576, device=dev).to(dtype), 4, 64)
    out = torch.empty(3072, 576, device=dev, dtype=dtype)
    count = max(1, math.ceil(GEMV_BYTES / 8 / out.nbytes))
    rows = pack_rows(torch.randn(2, 32, 4, 96, 64, device=dev).to(dtype), 4, 64)

    def run() -> None:
        for _ in range(count):
            dequantize(q, out)

    def run_rows() -> None:
        unpack_rows(rows, 64, 4, 64, dtype)

    return (count * out.nbytes / _seconds(run, dev),
            2 * 32 * 4 * 96 * 64 * dtype.itemsize / _seconds(run_rows, dev))


def _measure_layer_overhead(dev: torch.device) -> float:
    """Seconds of one decode step through a decoder layer too small to cost anything but
    dispatch: the fixed price of every layer call of tiergen's Llama family."""
    from tiergen.cache.kv import KVView
    from tiergen.config import ModelConfig
    from tiergen.cache.step import StepMeta
    from tiergen.models.llama import Llama

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, max_position=64)
    model = Llama(cfg)
    w = {n: torch.randn(shape, device=dev) for n, shape in model.packed_specs(0).items()}
    kv = torch.zeros(2, 1, 1, 16, 4, device=dev)
    valid = torch.ones(1, 16, dtype=torch.bool, device=dev)
    meta = StepMeta.build(valid, 8, 1)
    shared = model.prepare(meta, torch.float32)
    h = torch.randn(1, 1, 8, device=dev)

    def run() -> None:
        with torch.inference_mode():
            for _ in range(20):
                model.layer(0, w, h, meta, KVView(kv), shared)

    return _seconds(run, dev) / 20


def _measure_cpu_attention() -> float:
    """KV bytes/s of decode attention as tiergen runs it on the CPU (cache.attention.attention,
    T == 1): query heads folded per KV head into one batched matmul, softmax, matmul by V."""
    b, h, kvh, s, d = ATTENTION
    q = torch.randn(b, h, 1, d)
    k = torch.randn(b, kvh, s, d)
    v = torch.randn(b, kvh, s, d)
    count = max(1, math.ceil(ATTENTION_BYTES / (k.nbytes + v.nbytes)))
    caches = [(k, v)] + [(k.clone(), v.clone()) for _ in range(count - 1)]  # like layers

    def run() -> None:
        for kc, vc in caches:
            scores = torch.matmul(q.view(b, kvh, h // kvh, d), kc.transpose(-1, -2)) * d**-0.5
            torch.matmul(torch.softmax(scores, dim=-1), vc)

    return count * (k.nbytes + v.nbytes) / _cpu_seconds(run)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def calibrate(device: torch.device | str = "cpu", directory: Path | None = None,
              size: int = 256 * 2**20, progress: bool = False, link: bool = True) -> Calibration:
    """Measure this machine with ``device`` as the compute device.

    The disk test writes a ``size``-byte file into ``directory`` (default: the tiergen cache
    directory), drops it from the page cache and reads it back sequentially; the file is
    always removed, also on errors and Ctrl-C. ``link``: also measure the link between two
    parallel ranks (a second process for a few seconds; under torchrun, the ranks it started).
    """
    t_start = time.perf_counter()
    dev = _resolve_device(device)
    size = parse_size(size)
    if size < DISK_MIN:
        raise TiergenError(f"the disk test size must be at least 1M, got {size} bytes; "
                           "pass e.g. --size 256M")
    where = _disk_directory(directory)

    def step(what: str) -> None:
        if progress:
            print(f"calibrating: {what}", file=sys.stderr, flush=True)

    step(f"disk read ({size / 2**20:.0f} MiB in {where})")
    disk = _measure_disk(where, size)
    step("host memory copy")
    memcpy = _measure_host_memcpy()
    if dev.type == "cuda":
        step(f"pinned copies to and from {dev}")
        h2d, d2h = _measure_transfers(dev)
    else:  # host and device are the same memory
        h2d = d2h = memcpy
    matmul: dict[str, float] = {}
    gemv: dict[str, float] = {}
    dequant: dict[str, float] = {}
    cache_unpack: dict[str, float] = {}
    linear_rows: dict[str, dict[str, float]] = {}
    for dtype in _matmul_dtypes(dev):
        name = _dtype_name(dtype)
        step(f"{name} matmul and batch-1 gemv on {dev}")
        matmul[name] = _measure_matmul(dev, dtype)
        gemv[name] = _measure_gemv(dev, dtype)
        dequant[name], cache_unpack[name] = _measure_dequant(dev, dtype)
        step(f"{name} products at {', '.join(map(str, LINEAR_ROWS))} rows, dense and packed")
        linear_rows.update(_products(dev, dtype, name))
    step("CPU decode attention")
    attention = _measure_cpu_attention()
    links: dict[str, float] = {}
    if link:
        from tiergen.parallel.link import measure_link

        step("the link between two parallel ranks")
        links = measure_link(timeout=300.0) or {}
    return Calibration(
        hardware=fingerprint(dev), disk_read=disk, host_to_device=h2d, device_to_host=d2h,
        host_memcpy=memcpy, matmul=matmul, gemv=gemv, cpu_attention=attention, dequant=dequant,
        cache_unpack=cache_unpack, layer_overhead=_measure_layer_overhead(dev),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        seconds=time.perf_counter() - t_start, device=str(dev), disk_directory=str(where),
        link=links, linear_rows=linear_rows)


# ----------------------------------------------------------------------------- cache


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None
    return data if isinstance(data, dict) else None


def _rate(x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"not a positive finite number: {x!r}")
    return float(x)


def _from_dict(d: object) -> Calibration:
    """A Calibration from its JSON form; TypeError/ValueError when anything is missing or
    malformed."""
    if not isinstance(d, dict):
        raise TypeError("not an object")
    names = {f.name for f in fields(Calibration)}
    required = {f.name for f in fields(Calibration)
                if f.default is MISSING and f.default_factory is MISSING}
    if not required <= d.keys():
        raise ValueError(f"missing {sorted(required - d.keys())}")
    hw, mm, gv = d["hardware"], d["matmul"], d["gemv"]
    if not (isinstance(hw, dict) and all(isinstance(k, str) and isinstance(v, str)
                                         for k, v in hw.items())):
        raise ValueError("bad hardware")
    for table in (mm, gv):
        if not (isinstance(table, dict) and all(isinstance(k, str) for k in table)):
            raise ValueError("bad dtype table")
    for key in ("measured_at", "device", "disk_directory"):
        if key in d and not isinstance(d[key], str):
            raise ValueError(f"bad {key}")
    seconds = d["seconds"]
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and seconds >= 0):
        raise ValueError("bad seconds")
    kwargs = {k: d[k] for k in names & d.keys()}  # keys of newer versions are ignored
    dq, cu = d.get("dequant", {}), d.get("cache_unpack", {})
    for table in (dq, cu):
        if not (isinstance(table, dict) and all(isinstance(k, str) for k in table)):
            raise ValueError("bad dtype table")
    rows = d.get("linear_rows", {})
    if not (isinstance(rows, dict) and all(isinstance(t, dict) for t in rows.values())):
        raise ValueError("bad linear_rows")
    link = d.get("link", {})
    if not (isinstance(link, dict) and all(isinstance(k, str) for k in link)):
        raise ValueError("bad link")
    overhead = d.get("layer_overhead", 0.0)
    if isinstance(overhead, bool) or not isinstance(overhead, (int, float)) or not (
            math.isfinite(overhead) and overhead >= 0):
        raise ValueError("bad layer_overhead")
    kwargs.update(
        hardware=dict(hw), matmul={k: _rate(v) for k, v in mm.items()},
        dequant={k: _rate(v) for k, v in dq.items()},
        cache_unpack={k: _rate(v) for k, v in cu.items()}, layer_overhead=float(overhead),
        link={k: _rate(v) for k, v in link.items()},
        linear_rows={k: {str(int(r)): _rate(v) for r, v in t.items()} for k, t in rows.items()},
        gemv={k: _rate(v) for k, v in gv.items()}, seconds=float(seconds),
        **{k: _rate(d[k]) for k in ("disk_read", "host_to_device", "device_to_host",
                                    "host_memcpy", "cpu_attention")})
    cal = Calibration(**kwargs)
    torch.device(cal.device)  # RuntimeError on nonsense
    return cal


def save(cal: Calibration, path: Path | None = None) -> Path:
    """Store ``cal`` under its device type, keeping other device types' entries; atomic
    (a temporary file in the same directory, then ``os.replace``). Returns the path."""
    path = Path(path) if path is not None else cache_path()
    data = _read_json(path) or {}
    data[cal.device_type] = asdict(cal)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise TiergenError(f"cannot save the calibration to {path}: {e.strerror or e}; make "
                           f"{path.parent} writable or set XDG_CACHE_HOME to a writable "
                           "directory") from None
    return path


def load(device: torch.device | str = "cpu", path: Path | None = None) -> Calibration | None:
    """The cached calibration for ``device``'s type if it was measured on this hardware;
    None when there is none, the hardware differs, or the file is damaged."""
    dev = _resolve_device(device)
    data = _read_json(Path(path) if path is not None else cache_path())
    if data is None or dev.type not in data:
        return None
    try:
        cal = _from_dict(data[dev.type])
    except (TypeError, ValueError, RuntimeError):
        return None
    if cal.hardware != fingerprint(dev):
        return None
    return cal


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
        import warnings

        warnings.warn(str(e), stacklevel=2)
    return cal


# ----------------------------------------------------------------------------- output, CLI


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
    return "\n".join([
        f"calibration of {cal.device}: {machine}",
        f"  disk read        {_gbs(cal.disk_read)}{where}",
        f"  host -> device   {_gbs(cal.host_to_device)}{same}",
        f"  device -> host   {_gbs(cal.device_to_host)}{same}",
        f"  host memcpy      {_gbs(cal.host_memcpy)}",
        f"  matmul           {flops}  ({m}x{k} @ {k}x{n})",
        f"  gemv, batch 1    {gemv} of weights  (1x{gk} @ {gk}x{gn})",
        f"  CPU attention    {_gbs(cal.cpu_attention)} of float32 KV cache (decode)",
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


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _busy() -> str:
    """Why the measurements would run slow now (other processes on the CPUs), or ''."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    cores = os.cpu_count() or 1
    if load >= max(0.5, 0.25 * cores):
        return f"the machine is busy (load average {load:.1f} on {cores} logical cores)"
    return ""


def main(args: argparse.Namespace) -> int:
    """``tiergen calibrate``: measure afresh, print the result, save it to the cache."""
    from tiergen.parallel.group import under_torchrun

    if under_torchrun() and os.environ["RANK"] != "0":  # rank 0 measures, with this one
        from tiergen.parallel.link import measure_link

        measure_link(timeout=300.0)
        return 0
    device = args.device or _default_device()
    size = parse_size(args.size)
    directory = Path(args.dir).expanduser() if args.dir else None
    busy = _busy()
    if busy:
        print(f"tiergen: note: {busy}; the numbers will be low, calibrate again when it is idle",
              file=sys.stderr)
    cal = calibrate(device, directory, size, progress=True)
    path = save(cal)
    print(format_calibration(cal))
    print(f"saved to {path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``calibrate`` on the ``tiergen`` command's subparsers (``func`` = ``main``)."""
    p = sub.add_parser(
        "calibrate", help="measure disk, memory, transfer and compute speeds of this machine",
        description="Measure disk read, host memory and host<->device copy bandwidth, matmul "
                    "speed at large and few-row shapes (dense and packed), CPU decode "
                    "attention and the link between two parallel ranks, print them and save "
                    "them to ~/.cache/tiergen/calibration.json for the offload planner. "
                    "Always measures afresh (tens of seconds).")
    p.add_argument("--device", default=None,
                   help="compute device to measure, e.g. cpu, cuda or cuda:1 "
                        "(default: cuda if present, else cpu)")
    p.add_argument("--size", default="256M", metavar="SIZE",
                   help="size of the disk test file, e.g. 256M or 1G; larger is more accurate "
                        "on disks with big caches (default: 256M)")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="directory on the disk to measure, where the test file is written and "
                        "removed (default: ~/.cache/tiergen)")
    p.set_defaults(func=main)
