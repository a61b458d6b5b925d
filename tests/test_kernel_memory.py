"""The C kernels' memory use checked by AddressSanitizer: the kernels' tests and the models'
native decode paths (layers, latent attention, experts) run again against a build of the
kernels with ``-fsanitize=address``, so that a read or write past a buffer, which in the
normal build may go unnoticed or corrupt the heap far from its cause, fails here with its
place in the source. Built with -O2: with the sanitizer -O3 takes minutes to compile, and -O1
rounds differently enough (loops not vectorised) to move the tests' int8 roundings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiergen.kernels as kernels

HERE = Path(__file__).resolve().parent
TESTS = ["test_int8_kernels.py", "test_decode_kernels.py", "test_packed.py", "test_moe.py",
         "test_fused_layer.py", "test_gguf_moe.py::test_one_tokens_experts_in_one_call_equal_"
         "them_one_by_one", "test_gguf_moe.py::test_deepseek_latent_attention_in_one_call"]
PLUGIN = '''
from pathlib import Path
import tiergen.kernels as k
target = Path({target!r})
k._compile(target, flags=k.FLAGS + ["-fsanitize=address", "-fno-omit-frame-pointer", "-g", "-O2"],
           timeout=600)  # (a minute on an idle 2-core machine, twice that in a slow hour)
k._library_path = lambda: target


def pytest_collection_modifyitems(config, items):
    # what runs no code of the sanitized build: the plain-torch path, and other builds
    def other(item):
        params = getattr(item, "callspec", None)
        return params is not None and (params.params.get("kernel_path") == "torch"
                                       or "isa_library" in params.params)
    left = [i for i in items if other(i)]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [i for i in items if not other(i)]
'''


def _runtime() -> str | None:
    """The AddressSanitizer runtime of the compiler the kernels are built with."""
    cc = os.environ.get("CC") or "cc"
    try:
        found = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True,
                               text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found if os.path.isabs(found) and os.path.exists(found) else None


@pytest.mark.slow
def test_kernels_under_address_sanitizer(tmp_path):
    runtime = _runtime()
    if runtime is None or kernels.library() is None:
        pytest.skip("no C compiler with an AddressSanitizer runtime here")
    (tmp_path / "asan_kernels.py").write_text(PLUGIN.format(target=str(tmp_path / "k.so")))
    log = tmp_path / "asan"
    env = dict(os.environ, LD_PRELOAD=runtime, PYTHONPATH=f"{tmp_path}{os.pathsep}{HERE}",
               ASAN_OPTIONS=f"detect_leaks=0:log_path={log}")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "asan_kernels",
                           "-p", "no:cacheprovider", "-m", "not slow", *TESTS],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=1500)
    reports = "".join(p.read_text()[:4000] for p in tmp_path.glob("asan*") if p.is_file()
                      and p.suffix != ".py")
    assert done.returncode == 0 and not reports, (reports or done.stdout[-3000:]
                                                   + done.stderr[-3000:])
