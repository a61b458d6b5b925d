"""``tiergen bench --against``: the peers on the same workload, in turns, each turn's ratio,
and a peer that is not installed named with how to get it instead of a failure."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from tiergen import bench
from tiny_models import build


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiergen.cli", "bench", "--batch", "1", "2",
                           "--prompt-len", "6", "--gen-len", "3", *args],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_ratios_are_each_turns_own_then_their_median():
    mine = [{"total_tok_s": 10.0}, {"total_tok_s": 30.0}, {"total_tok_s": 20.0}]
    theirs = [{"total_tok_s": 5.0}, {"total_tok_s": 30.0}, {"total_tok_s": 40.0}]
    assert bench.ratio(mine, theirs, "total_tok_s") == 1.0  # turns 2x, 1x, 0.5x
    assert bench.ratio(mine, [{"total_tok_s": None}] * 3, "total_tok_s") is None
    assert bench.median_run(mine) == {"total_tok_s": 20.0}


def test_a_missing_peer_is_named_with_how_to_get_it():
    proc = _bench("--turns", "1", "--against", "llama.cpp",
                  env={"TIERGEN_LLAMA_CPP_PYTHON": "/nonexistent/python"})
    assert proc.returncode == 0, proc.stderr
    assert "llama.cpp: not run" in proc.stdout and "pip install llama-cpp-python" in proc.stdout
    assert "| 1 | tiergen |" in proc.stdout and "| 2 | tiergen |" in proc.stdout


def test_an_unknown_peer_is_refused():
    proc = _bench("--against", "vllm")
    assert proc.returncode == 2 and "unknown peer 'vllm'" in proc.stderr


def test_a_peer_runs_in_turns_on_the_same_prompts(tmp_path):
    """A stand-in for llama.cpp's interpreter records the jobs it is given and answers fixed
    figures: it gets the same prompts as tiergen, once a turn, and the ratios come out."""
    seen = tmp_path / "jobs"
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    f"cat >> {seen}\necho >> {seen}\n"
                    "echo '{\"total_tok_s\": 1.0, \"decode_tok_s\": 2.0, \"peak_rss_mb\": 3.0}'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    proc = _bench("--turns", "2", "--against", "llama.cpp", "--json",
                  env={"TIERGEN_LLAMA_CPP_PYTHON": str(fake)})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert [len(info["against"][b]["llama.cpp"]) for b in ("1", "2")] == [2, 2]
    assert [len(info["turns"][b]) for b in ("1", "2")] == [2, 2]
    jobs = [json.loads(line) for line in seen.read_text().split("\n") if line.strip()]
    assert [len(j["prompts"]) for j in jobs] == [1, 1, 2, 2]
    from tiergen import LLM
    vocab = LLM("smollm2").config.vocab_size
    assert jobs[2]["prompts"] == bench.prompt_ids(2, 6, vocab) and jobs[2]["gen_len"] == 3
    results = {int(b): {"tiergen": info["turns"][b], **info["against"][b]} for b in ("1", "2")}
    table = bench.table(results, 6, 3)
    want = bench.ratio(info["turns"]["1"], info["against"]["1"]["llama.cpp"], "total_tok_s")
    assert f"/ {want:.2f}x |" in table.splitlines()[2]


def test_transformers_runs_the_same_checkpoint(tmp_path):
    """The transformers peer on a small checkpoint: figures for each batch."""
    build("llama-gqa-tied", tmp_path / "hf")
    proc = _bench("--turns", "1", "--against", "transformers", "--json", "--model",
                  str(tmp_path / "hf"), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout)["against"]
    for b in ("1", "2"):
        (r,) = runs[b]["transformers"]
        assert r["total_tok_s"] > 0 and r["peak_rss_mb"] > 0 and r["dtype"] in ("float32", "bfloat16")
