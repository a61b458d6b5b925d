"""A machine's measured speeds (:mod:`tiergen.planner.calibrate` measures them) and the file that
keeps them: ``~/.cache/tiergen/calibration.json`` (``$XDG_CACHE_HOME`` honoured), one entry
per device type ("cpu", "cuda"), each with a hardware fingerprint that must match the
current machine for the entry to be used.

Units: bandwidths are bytes per second (decimal: 1 GB/s = 1e9 B/s), compute is FLOP per
second (a multiply-add counts 2)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

from tiergen.errors import TiergenError
from tiergen.paths import cache_dir


CACHE_FILE = "calibration.json"
ONE_THREAD = " x1"  # suffix of linear_rows measured with one thread (a parallel rank's share)


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
    # ...): by compute dtype name, and "packed-<dtype>" for GGML Q4_0 blocks multiplied packed
    # as an LLM does by default (on a CPU the integer path; "packed-exact-<dtype>": the float
    # path); the same with ONE_THREAD appended, measured with one thread (on a CPU of several)
    linear_rows: dict[str, dict[str, float]] = field(default_factory=dict)
    # FLOP/s of a prompt's causal attention as tiergen runs it: by compute dtype name, and
    # "amx-<dtype>" for the integer path's long prompts, whose attention takes AMX tiles
    # (a multiply-add counts 2, over the (query, key) pairs of q.k and p.v)
    prompt_attention: dict[str, float] = field(default_factory=dict)

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type


def cache_path() -> Path:
    """Where ``save`` and ``load`` keep calibrations by default."""
    return cache_dir() / CACHE_FILE


def calibrated_device(device: torch.device | str) -> torch.device:
    """The device a calibration describes, with its CUDA index; refused unless it is here."""
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
    dev = calibrated_device(device)
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
    known = {k: d[k] for k in names & d.keys()}  # keys of newer versions are ignored
    dq, cu, pa = d.get("dequant", {}), d.get("cache_unpack", {}), d.get("prompt_attention", {})
    for table in (dq, cu, pa):
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
    cal = Calibration(**dict(
        known, hardware=dict(hw), matmul={k: _rate(v) for k, v in mm.items()},
        dequant={k: _rate(v) for k, v in dq.items()},
        cache_unpack={k: _rate(v) for k, v in cu.items()}, layer_overhead=float(overhead),
        prompt_attention={k: _rate(v) for k, v in pa.items()},
        link={k: _rate(v) for k, v in link.items()},
        linear_rows={k: {str(int(r)): _rate(v) for r, v in t.items()} for k, t in rows.items()},
        gemv={k: _rate(v) for k, v in gv.items()}, seconds=float(seconds),
        **{k: _rate(d[k]) for k in ("disk_read", "host_to_device", "device_to_host",
                                    "host_memcpy", "cpu_attention")}))
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
    dev = calibrated_device(device)
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
