"""Process-wide settings tiergen makes at import (tiergen/_platform.py), and when it leaves
them to the user."""

from __future__ import annotations

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


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 only")
def test_onednn_is_capped_below_amx_unless_the_user_chose():
    assert probe()[0] == "AVX512_CORE_BF16"
    assert probe(ONEDNN_MAX_CPU_ISA="ALL")[0] == "ALL"


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's malloc")
def test_freed_buffers_are_kept_unless_the_user_tunes_malloc():
    assert probe()[1] == "True"
    assert probe(GLIBC_TUNABLES="glibc.malloc.perturb=0")[1] == "False"
    assert probe(MALLOC_TRIM_THRESHOLD_="131072")[1] == "False"
