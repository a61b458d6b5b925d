"""Process-wide settings that must be in place before torch runs its first kernel.

Some x86 virtual machines advertise Intel AMX in CPUID but hide the leaves that describe
the tiles; oneDNN then takes its AMX path on the first bfloat16 matmul and the process
dies with SIGILL, without a traceback. /proc/cpuinfo does not reliably show this, so on
x86 tiergen caps oneDNN at AVX512_CORE_BF16 (a ceiling: CPUs below it are unaffected; only
real AMX hardware gives up its tile units for bfloat16). A user who knows their AMX works
sets ONEDNN_MAX_CPU_ISA themselves (e.g. to "ALL"), and tiergen leaves it alone.

With glibc, freed buffers of up to 32 MB go back to the heap for the next product instead of
being unmapped (see keep_freed_buffers).
"""

import ctypes
import functools
import os
import platform
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (read once: they do not change while the process runs)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bfloat16() -> bool:
    """True when the CPU multiplies bfloat16 natively (then it beats float32 here)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


if platform.machine().lower() in ("x86_64", "amd64") and "ONEDNN_MAX_CPU_ISA" not in os.environ:
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"


def keep_freed_buffers() -> bool:
    """Let glibc reuse freed buffers of up to 32 MB instead of unmapping them.

    A prompt batch's products allocate tens of MB of outputs and quantised activations each.
    glibc maps every allocation above its threshold afresh and unmaps it when freed, so the
    kernel faults in and zeroes each of its pages again at every product: about 350,000 page
    faults for a prefill of 32 prompts of 128 tokens (benchmarks/bench_prefill_buffers.py). So
    the threshold is set to glibc's largest, 32 MB, and the heap is trimmed only once 256 MB lie
    free at its top. A process that tunes malloc itself (GLIBC_TUNABLES or MALLOC_*_
    variables) keeps its own settings. Whether the settings were applied."""
    if platform.system() != "Linux" or "GLIBC_TUNABLES" in os.environ or any(
            k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 256 << 20))


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
    main thread (benchmarks/bench_load_thread.py compares). Loading here leaves the
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
