"""Machine calibration: measurements, the temporary disk file, the cache and the CLI."""

import argparse
import dataclasses
import errno
import json
import math
import os
from datetime import datetime

import pytest
import torch

import tiergen
from tiergen import TiergenError
from tiergen import calibration, cli, kernels
from tiergen.devices import resolve_activations
from tiergen.offload.policy import parse_size
from tiergen.planner import calibrate as cb
from tiergen.planner.calibrate import attention, compute, memory, storage, timing

MiB = 2**20


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Every test gets its own ~/.cache."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


@pytest.fixture
def fast(monkeypatch):
    """Same shapes, but one timed run per measurement and small buffers: a whole
    calibration takes well under a second."""
    monkeypatch.setattr(timing, "REPEATS", 1)
    monkeypatch.setattr(timing, "MIN_TIME", 0.0)
    monkeypatch.setattr(timing, "MAX_TIME", 0.0)
    monkeypatch.setattr(memory, "COPY_BYTES", 8 * MiB)
    monkeypatch.setattr(compute, "GEMV_BYTES", 0)
    monkeypatch.setattr(compute, "LINEAR_BYTES", 0)
    monkeypatch.setattr(attention, "ATTENTION_BYTES", 0)
    # the link takes a second process (tests/test_parallel_plan.py measures it for real)
    from tiergen.parallel import link
    monkeypatch.setattr(link, "measure_link", lambda timeout=60.0: dict(
        latency=1e-4, bandwidth=1e9, reduce_latency=1e-3, reduce_bandwidth=1e9))


@pytest.fixture
def disk(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    return d


def _positive(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def _fake(**changes) -> calibration.Calibration:
    cal = calibration.Calibration(
        hardware=calibration.fingerprint("cpu"), disk_read=2.5e9, host_to_device=12e9,
        device_to_host=12e9, host_memcpy=12e9,
        matmul={"float32": 150e9, "bfloat16": 400e9}, gemv={"float32": 20e9, "bfloat16": 13e9},
        cpu_attention=30e9, measured_at="2025-01-01T00:00:00+00:00", seconds=3.5,
        device="cpu", disk_directory="/somewhere",
        prompt_attention={"float32": 100e9, "bfloat16": 300e9, "amx-float32": 350e9})
    return dataclasses.replace(cal, **changes)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiergen")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_calibrate_parser(sub)
    return parser


# ----------------------------------------------------------------------------- measuring


def test_calibrate_cpu_gives_positive_finite_numbers(fast, disk):
    cal = cb.calibrate("cpu", disk, size=8 * MiB)
    for name in ("disk_read", "host_to_device", "device_to_host", "host_memcpy",
                 "cpu_attention", "seconds"):
        assert _positive(getattr(cal, name)), name
    assert "float32" in cal.matmul
    assert set(cal.gemv) == set(cal.matmul)
    assert all(_positive(v) for v in [*cal.matmul.values(), *cal.gemv.values()])
    assert "bfloat16" in cal.matmul  # natively, or widened to float32 as linear runs it
    assert "float16" not in cal.matmul  # emulated on CPUs: not measured
    # CPU device: host and device are the same memory.
    assert cal.host_to_device == cal.device_to_host == cal.host_memcpy
    assert cal.hardware == calibration.fingerprint("cpu")
    assert {"cpu", "logical_cores", "ram_gib", "torch", "torch_threads"} <= cal.hardware.keys()
    assert "gpu" not in cal.hardware
    assert cal.device == "cpu" and cal.disk_directory == str(disk)
    assert datetime.fromisoformat(cal.measured_at).tzinfo is not None
    assert list(disk.iterdir()) == []  # the test file is gone
    threads = ("", " x1") if torch.get_num_threads() > 1 else ("",)
    # a long prompt's rows on AMX tiles, where they take them here (the integer path)
    amx = {f"packed-amx-float32{t}" for t in threads
           if kernels.amx_prompt(kernels.AMX_PROMPT, resolve_activations("auto", torch.device("cpu")))}
    assert set(cal.linear_rows) == amx | {f"{p}{d}{t}" for p in ("", "packed-", "packed-exact-")
                                          for d in ("float32", "bfloat16") for t in threads}
    for name, table in cal.linear_rows.items():
        rows = compute.AMX_ROWS if name in amx else compute.LINEAR_ROWS
        assert list(table) == [str(r) for r in rows]
        assert all(_positive(v) for v in table.values())
    # a prompt's attention by compute dtype, and on the tiles where the integer path's go
    tiles = {"amx-float32"} if amx else set()
    assert set(cal.prompt_attention) == {"float32", "bfloat16"} | tiles
    assert all(_positive(v) for v in cal.prompt_attention.values())
    assert cal.link["reduce_latency"] == 1e-3


def test_default_directory_is_the_tiergen_cache(fast, cache_home, monkeypatch):
    seen = []
    real = storage._read_all

    def spy(fd, buf, nbytes):
        seen.extend(p.name for p in (cache_home / "tiergen").iterdir())
        real(fd, buf, nbytes)

    monkeypatch.setattr(storage, "_read_all", spy)
    cal = cb.calibrate("cpu", size=2 * MiB)
    assert cal.disk_directory == str(cache_home / "tiergen")
    assert seen and all(n.startswith(".tiergen-calibrate-") for n in seen)
    assert list((cache_home / "tiergen").iterdir()) == []


def test_bfloat16_is_measured_as_the_model_multiplies_it(fast, disk, monkeypatch):
    """With or without native bfloat16, through ``linear`` (which widens many rows to float32
    where the CPU lacks it)."""
    from tiergen.models import layers

    shapes = []
    real = layers.linear
    monkeypatch.setattr(layers, "linear", lambda x, w, b=None: shapes.append(
        (x.dtype, tuple(x.shape))) or real(x, w, b))
    cal = cb.calibrate("cpu", disk, size=2 * MiB)
    assert list(cal.matmul) == list(cal.gemv) == ["float32", "bfloat16"]
    assert {(torch.bfloat16, (compute.GEMM[0], compute.GEMM[1])), (torch.bfloat16, (1, compute.GEMV[0]))} <= set(shapes)


@pytest.mark.parametrize("exc, raised", [
    (RuntimeError("boom"), RuntimeError), (KeyboardInterrupt(), KeyboardInterrupt),
    (OSError(errno.EIO, os.strerror(errno.EIO)), TiergenError)])
def test_temp_file_removed_when_a_measurement_raises(disk, monkeypatch, exc, raised):
    seen = []

    def fail(fd, buf, nbytes):
        seen.extend((p.name, p.stat().st_size) for p in disk.iterdir())
        raise exc

    monkeypatch.setattr(storage, "_read_all", fail)
    with pytest.raises(raised):
        cb.calibrate("cpu", disk, size=8 * MiB)
    assert len(seen) == 1 and seen[0][1] == 8 * MiB  # it was there, full size
    assert list(disk.iterdir()) == []


def test_temp_file_removed_when_writing_fails(disk, monkeypatch):
    def full(fd, data, nbytes):
        os.write(fd, data[:1000])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(storage, "_write_all", full)
    with pytest.raises(TiergenError, match="cannot write the disk test file.*free space"):
        cb.calibrate("cpu", disk, size=8 * MiB)
    assert list(disk.iterdir()) == []


def test_not_enough_free_space(disk, monkeypatch):
    monkeypatch.setattr(storage, "_free_bytes", lambda d: 10 * MiB)
    with pytest.raises(TiergenError, match=r"needs 8 MiB free .* only 10 MiB is free.*--size"):
        cb.calibrate("cpu", disk, size=8 * MiB)
    assert list(disk.iterdir()) == []


def test_bad_device():
    with pytest.raises(TiergenError, match="unknown device"):
        cb.calibrate("gpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(TiergenError, match="CUDA is not available"):
            cb.calibrate("cuda")


# ----------------------------------------------------------------------------- cache


def test_save_load_round_trip(cache_home):
    cal = _fake()
    path = cb.save(cal)
    assert path == calibration.cache_path() == cache_home / "tiergen" / "calibration.json"
    assert cb.load("cpu") == cal
    assert cb.load(torch.device("cpu")) == cal
    assert sorted(p.name for p in path.parent.iterdir()) == ["calibration.json"]  # no temp left

    # One entry per device type: saving a cuda one keeps the cpu one.
    cuda = _fake(device="cuda:0", hardware={**cal.hardware, "gpu": "Some GPU"})
    cb.save(cuda)
    data = json.loads(path.read_text())
    assert set(data) == {"cpu", "cuda"}
    assert cb.load("cpu") == cal
    assert calibration._from_dict(data["cuda"]) == cuda

    # An explicit path.
    other = cache_home / "elsewhere" / "cal.json"
    assert cb.save(cal, other) == other
    assert cb.load("cpu", other) == cal


def test_load_none_for_other_hardware():
    cb.save(_fake(hardware={**calibration.fingerprint("cpu"), "cpu": "Some Other CPU"}))
    assert cb.load("cpu") is None
    cb.save(_fake(hardware={**calibration.fingerprint("cpu"), "torch_threads": "999"}))
    assert cb.load("cpu") is None
    cb.save(_fake())
    assert cb.load("cpu") is not None


def test_load_none_when_missing_or_corrupt():
    assert cb.load("cpu") is None  # no file yet
    path = calibration.cache_path()
    path.parent.mkdir(parents=True)
    good = dataclasses.asdict(_fake())
    bad_entries = [
        "{not json", "\xff\xfe", "[]", json.dumps({"cpu": 3}),
        json.dumps({"cpu": {"hardware": good["hardware"]}}),  # fields missing
        json.dumps({"cpu": {**good, "disk_read": -1.0}}),
        json.dumps({"cpu": {**good, "matmul": {"float32": "fast"}}}),
        json.dumps({"cpu": {**good, "hardware": [1, 2]}}),
        json.dumps({"cpu": {**good, "gemv": {"float32": float("nan")}}}),
        json.dumps({"cpu": {**good, "device": "not a device"}}),
    ]
    for text in bad_entries:
        path.write_text(text, encoding="latin-1")
        assert cb.load("cpu") is None, text
    # Saving over a corrupt file replaces it.
    cb.save(_fake())
    assert cb.load("cpu") == _fake()
    # Keys from a newer version are ignored.
    path.write_text(json.dumps({"cpu": {**good, "new_field": 1}}))
    assert cb.load("cpu") == _fake()


def test_get_measures_once_then_uses_the_cache(monkeypatch):
    calls = []

    def fake_calibrate(device="cpu", directory=None, size=0, progress=False):
        calls.append(device)
        return _fake()

    monkeypatch.setattr(cb, "calibrate", fake_calibrate)
    assert cb.get("cpu") == _fake() and len(calls) == 1
    assert cb.get("cpu") == _fake() and len(calls) == 1
    assert cb.get("cpu", recalibrate=True) == _fake() and len(calls) == 2


def test_save_to_unwritable_place_is_a_tiergen_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TiergenError, match="cannot save the calibration"):
        cb.save(_fake(), blocker / "calibration.json")


# ----------------------------------------------------------------------------- output, CLI


def test_format_mentions_each_quantity():
    text = cb.format_calibration(_fake())
    for part in ("disk read", "2.50 GB/s", "/somewhere", "host -> device", "device -> host",
                 "host memcpy", "12.00 GB/s", "same memory", "matmul", "float32 150.0 GFLOP/s",
                 "bfloat16 400.0 GFLOP/s", "gemv", "20.00 GB/s", "13.00 GB/s",
                 "attention", "30.00 GB/s", "3.5 s", calibration.fingerprint("cpu")["cpu"]):
        assert part in text, part
    gpu = cb.format_calibration(_fake(device="cuda:0", hardware={"gpu": "H100",
                                                                 "gpu_memory_gib": "79.1"}))
    assert "same memory" not in gpu and "H100" in gpu


def test_cli_measures_prints_and_saves(fast, disk, capsys):
    args = _parser().parse_args(["calibrate", "--device", "cpu", "--size", "4M",
                                 "--dir", str(disk)])
    assert args.func is cli.cmd_calibrate
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert "disk read" in out.out and f"saved to {calibration.cache_path()}" in out.out
    assert "calibrating:" in out.err  # progress goes to stderr
    assert cb.load("cpu") is not None
    assert list(disk.iterdir()) == []


def test_cli_defaults():
    args = _parser().parse_args(["calibrate"])
    assert args.device is None and args.dir is None and parse_size(args.size) == 256 * MiB


@pytest.mark.parametrize("case", ["missing", "file", "size", "tiny"])
def test_cli_bad_input_is_a_tiergen_error(tmp_path, case):
    argv = ["calibrate", "--device", "cpu", "--size", "4M"]
    if case == "missing":
        argv += ["--dir", str(tmp_path / "nope")]
        match = "does not exist; create it"
    elif case == "file":
        f = tmp_path / "afile"
        f.write_text("x")
        argv += ["--dir", str(f)]
        match = "is not a directory"
    elif case == "size":
        argv += ["--size", "lots", "--dir", str(tmp_path)]
        match = "cannot read memory size"
    else:
        argv += ["--size", "1000", "--dir", str(tmp_path)]
        match = "at least 1M"
    args = _parser().parse_args(argv)
    with pytest.raises(TiergenError, match=match):
        args.func(args)
    assert not calibration.cache_path().exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_cli_unwritable_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        args = _parser().parse_args(["calibrate", "--device", "cpu", "--size", "4M",
                                     "--dir", str(d)])
        with pytest.raises(TiergenError, match="cannot write the disk test file"):
            args.func(args)
    finally:
        d.chmod(0o700)


def test_cli_permission_denied(disk, monkeypatch):
    real_open = os.open

    def deny(path, *a, **kw):
        if ".tiergen-calibrate-" in str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(os, "open", deny)
    args = _parser().parse_args(["calibrate", "--device", "cpu", "--size", "4M",
                                 "--dir", str(disk)])
    with pytest.raises(TiergenError, match="Permission denied; pass --dir with a writable"):
        args.func(args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_calibrate_cuda(fast, disk):
    cal = cb.calibrate("cuda", disk, size=8 * MiB)
    assert cal.device.startswith("cuda:") and "gpu" in cal.hardware
    for name in ("disk_read", "host_to_device", "device_to_host", "host_memcpy", "cpu_attention"):
        assert _positive(getattr(cal, name)), name
    assert {"float32", "float16"} <= cal.matmul.keys() and set(cal.gemv) == set(cal.matmul)
    assert all(_positive(v) for v in [*cal.matmul.values(), *cal.gemv.values()])
    cb.save(cal)
    assert cb.load("cuda") == cal
    assert list(disk.iterdir()) == []
