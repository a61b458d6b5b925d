"""Process-wide settings that must be in place before torch runs its first kernel.

Intel AMX multiplies bfloat16 in tiles, 7.6x faster than AVX-512 in torch's 2048 x 2048
bfloat16 matmul on a 2-core Xeon (benchmarks/bench_amx.py). But some x86 virtual machines
advertise AMX in /proc/cpuinfo and hide the CPUID leaves that describe the tiles; oneDNN then
takes its AMX path on the first bfloat16 matmul and the process dies with SIGILL, without a
traceback. So whether AMX works is probed once per machine (:func:`amx_usable`): CPUID's AMX
bits and tile leaves 0x1d/0x1e, the tile state enabled by the OS in XCR0, the kernel's
permission to use it (``arch_prctl``), and a bfloat16 matmul, all in a child process, so a
wrong answer kills the child, never the caller; the verdict is kept in the cache directory.
Where AMX does not work, oneDNN is capped at AVX512_CORE_BF16 (a ceiling: CPUs below it are
unaffected). A user's own ONEDNN_MAX_CPU_ISA wins: tiergen then leaves oneDNN alone.

With glibc, freed buffers of up to 32 MB go back to the heap for the next product instead of
being unmapped (see keep_freed_buffers).
"""

import ctypes
import functools
import hashlib
import json
import os
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """/proc/cpuinfo's fields of the first CPU (read once; empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (they do not change while the process runs)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """The CPU's model name, or the machine's type where /proc/cpuinfo gives none."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_has_fast_bfloat16() -> bool:
    """True when the CPU multiplies bfloat16 natively (then it beats float32 here)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


ONEDNN_CAP = "AVX512_CORE_BF16"  # oneDNN's ceiling where AMX does not work
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158

# Run in a child process: prints a JSON verdict, or dies trying. CPUID and XGETBV run from a
# few bytes of machine code (x86-64 System V calls).
AMX_PROBE = r"""
import ctypes, json, mmap
CPUID = bytes.fromhex("5389f889f14989d00fa2418900418958044189480841895" "00c5bc3")
XGETBV = bytes.fromhex("89f90f01d048c1e2204809d0c3")
def function(code, restype, *argtypes):
    buf = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    buf.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    function.keep.append(buf)
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)
function.keep = []
cpuid_raw = function(CPUID, None, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)
def cpuid(leaf, sub=0):
    out = (ctypes.c_uint32 * 4)()
    cpuid_raw(leaf, sub, ctypes.addressof(out))
    return list(out)
def verdict(why, ok=False):
    print(json.dumps({"amx": ok, "why": why}))
    raise SystemExit
if cpuid(0)[0] < 0x1e:
    verdict("CPUID has no tile leaves")
edx7 = cpuid(7)[3]
if not (edx7 >> 24 & 1 and edx7 >> 22 & 1 and edx7 >> 25 & 1):
    verdict("CPUID: no AMX-TILE, AMX-BF16 and AMX-INT8")
if not cpuid(1)[2] >> 27 & 1:
    verdict("the OS has not enabled XSAVE")
xcr0 = function(XGETBV, ctypes.c_uint64, ctypes.c_uint32)(0)
if cpuid(0xd)[0] >> 17 & 3 != 3 or xcr0 >> 17 & 3 != 3:
    verdict("the OS does not save the tile state (XCR0)")
palette = cpuid(0x1d)[0]
tiles = cpuid(0x1d, 1)
tmul = cpuid(0x1e)[1]
# palette 1: 8 tiles of 16 rows of 64 bytes (8 KiB); the multiplier takes K 16, N 64
if (palette < 1 or tiles[0] & 0xffff != 8192 or tiles[1] != 8 << 16 | 64
        or tiles[2] & 0xffff != 16 or tmul & 0xffffff != 64 << 8 | 16):
    verdict(f"CPUID's tile leaves describe no palette 1 of 8 tiles of 16 x 64 bytes "
            f"({palette}, {tiles}, {tmul:#x})")
libc = ctypes.CDLL(None, use_errno=True)
if libc.syscall(%(SYS)d, %(REQ)d, %(XTILEDATA)d):
    verdict(f"the kernel refused the tile state (errno {ctypes.get_errno()})")
try:
    import torch
except ImportError:
    verdict("tiles described and permitted", True)
a, b = torch.randn(64, 96), torch.randn(96, 80)
got = (a.bfloat16() @ b.bfloat16()).float()
want = a.bfloat16().float() @ b.bfloat16().float()
if not torch.allclose(got, want, rtol=2e-2, atol=1e-1):
    verdict("a bfloat16 matmul gave wrong numbers")
verdict("a bfloat16 matmul ran on tiles", True)
""" % {"SYS": SYS_ARCH_PRCTL, "REQ": ARCH_REQ_XCOMP_PERM, "XTILEDATA": XFEATURE_XTILEDATA}


def run_amx_probe(code: str = AMX_PROBE, timeout: float = 120.0) -> tuple[bool, str]:
    """Whether ``code`` in a child process (with oneDNN uncapped) prints an AMX verdict of
    true, and why; a child that dies, hangs or prints anything else is a no."""
    import subprocess  # (only when probing: the verdict is usually cached)

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=timeout)
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        return bool(found["amx"]), str(found["why"])
    except (OSError, subprocess.SubprocessError, ValueError, LookupError, TypeError,
            AttributeError) as e:
        return False, f"the probe failed ({type(e).__name__})"


def _probe_key() -> str:
    """What the verdict depends on: the CPU as described, the kernel, the interpreter."""
    ident = f"{cpu_model()}|{sorted(cpu_flags())}|{platform.release()}|{sys.executable}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


@functools.cache
def amx_usable() -> bool:
    """Whether this process may use Intel AMX tiles (and has asked the kernel for their
    state). Probed once per machine, in a child process, and kept in the cache directory."""
    if platform.system() != "Linux" or not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return False
    from tiergen.paths import cache_dir  # (the ground floor; no torch)

    path = cache_dir() / "platform" / f"amx-{_probe_key()}.json"
    try:
        ok = json.loads(path.read_text())["amx"] is True
    except (OSError, ValueError, LookupError, TypeError):
        ok, why = run_amx_probe()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"amx": ok, "why": why}))
        except OSError:
            pass  # probed again next time
    libc = ctypes.CDLL(None, use_errno=True)
    return ok and libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def cap_onednn(amx: Callable[[], bool] = amx_usable) -> str | None:
    """Cap oneDNN below AMX unless AMX works or the user chose a ceiling; the cap set, if
    any."""
    if (platform.machine().lower() not in ("x86_64", "amd64")
            or "ONEDNN_MAX_CPU_ISA" in os.environ or amx()):
        return None
    os.environ["ONEDNN_MAX_CPU_ISA"] = ONEDNN_CAP
    return ONEDNN_CAP


cap_onednn()


def keep_freed_buffers() -> bool:
    """Let glibc reuse freed buffers of every size instead of unmapping them.

    A prompt batch's products allocate tens of MB of outputs and quantised activations each.
    glibc maps an allocation above its threshold afresh (where no free block of its heap is
    large enough) and unmaps it when it is freed, so the kernel faults in and zeroes each of
    its pages again at every product: about 350,000 page faults for a prefill of 32 prompts of
    128 tokens (docs/BENCHMARKS-HISTORY.md). The threshold cannot be raised past
    32 MB, and SmolLM2's MLP alone makes a 50 MB buffer a layer at that batch, so glibc maps
    nothing apart (M_MMAP_MAX 0; it still maps what its heap cannot hold), and the heap is
    trimmed only once 256 MB lie free at its top. A process that tunes malloc itself
    (GLIBC_TUNABLES or MALLOC_*_ variables) keeps its own settings. Whether the settings were
    applied."""
    if platform.system() != "Linux" or "GLIBC_TUNABLES" in os.environ or any(
            k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 256 << 20))


keep_freed_buffers()


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``). A load frees
    what it only needed for a while (a GGUF's vocabulary as Python strings, once the tokenizer
    holds it; decoded tensors), which the heap would otherwise keep for good, since
    keep_freed_buffers raised its trim threshold far above it: 2-3 MB of SmolLM2's peak."""
    if platform.system() != "Linux":
        return
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def on_short_lived_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread of its own that ends with it, and return its result.

    Each thread that runs a parallel torch kernel keeps an OpenMP worker pool for as long as
    it lives, and OpenMP throttles every pool's waiting once the pools hold more threads than
    the CPU has cores, which can slow the scheduler's thread when the model was loaded on the
    main thread (docs/BENCHMARKS-HISTORY.md). Loading here leaves the
    scheduler's pool alone.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="tiergen-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
