"""Process-wide settings tiergen makes at import (tiergen/_platform.py), and when it leaves
them to the user."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = ("import os, tiergen._platform as p; "
         "print(os.environ.get('ONEDNN_MAX_CPU_ISA'), p.keep_freed_buffers())")


def probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ONEDNN_MAX_CPU_ISA", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=clean | env, check=True,
                         capture_output=True, text=True).stdout
    return out.split()


X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.mark.skipif(not X86, reason="x86 only")
def test_onednn_is_capped_below_amx_only_where_amx_does_not_work(monkeypatch):
    from tiergen import _platform as p

    assert probe()[0] == ("None" if p.amx_usable() else p.ONEDNN_CAP)
    assert probe(ONEDNN_MAX_CPU_ISA="ALL")[0] == "ALL"  # the user's choice wins
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert p.cap_onednn(lambda: True) is None and "ONEDNN_MAX_CPU_ISA" not in os.environ
    assert p.cap_onednn(lambda: False) == p.ONEDNN_CAP == os.environ["ONEDNN_MAX_CPU_ISA"]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert p.cap_onednn(lambda: False) is None and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


@pytest.mark.parametrize("child", [
    "import os, signal; os.kill(os.getpid(), signal.SIGILL)",  # a VM that hides the tiles
    "print('not a verdict')",
    "import time; time.sleep(30)",
])
def test_a_probe_that_dies_or_says_nothing_is_a_no(child):
    from tiergen._platform import run_amx_probe

    assert run_amx_probe(child, timeout=5)[0] is False


def test_the_verdict_is_kept_for_the_next_process(monkeypatch, tmp_path):
    from tiergen import _platform as p

    monkeypatch.setenv("TIERGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(p, "cpu_flags", lambda: frozenset({"amx_tile", "amx_bf16"}))
    monkeypatch.setattr(p, "run_amx_probe", lambda: (False, "no tiles here"))
    assert p.amx_usable.__wrapped__() is False
    monkeypatch.setattr(p, "run_amx_probe", lambda: pytest.fail("probed twice"))
    assert p.amx_usable.__wrapped__() is False
    [kept] = (tmp_path / "platform").iterdir()
    assert json.loads(kept.read_text()) == {"amx": False, "why": "no tiles here"}


@pytest.mark.skipif(not X86 or "amx_bf16" not in open("/proc/cpuinfo").read(),
                    reason="the CPU does not list AMX")
def test_where_amx_works_torch_multiplies_bfloat16_on_tiles():
    from tiergen._platform import amx_usable

    if not amx_usable():
        pytest.skip("this machine lists AMX but its probe says the tiles do not work")
    code = ("import tiergen, torch; a, b = torch.randn(64, 96), torch.randn(96, 80); "
            "got = (a.bfloat16() @ b.bfloat16()).float(); "
            "want = a.bfloat16().float() @ b.bfloat16().float(); "
            "print(torch.allclose(got, want, rtol=2e-2, atol=1e-1))")
    clean = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    out = subprocess.run([sys.executable, "-c", code], env=clean | {"ONEDNN_VERBOSE": "1"},
                         check=True, capture_output=True, text=True).stdout
    matmuls = [line for line in out.splitlines() if ",exec," in line and "matmul" in line]
    assert out.strip().endswith("True")
    assert matmuls and all("amx" in line for line in matmuls), out


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's malloc")
def test_freed_buffers_are_kept_unless_the_user_tunes_malloc():
    assert probe()[1] == "True"
    assert probe(GLIBC_TUNABLES="glibc.malloc.perturb=0")[1] == "False"
    assert probe(MALLOC_TRIM_THRESHOLD_="131072")[1] == "False"
