"""Start-up of the packaged models: importing tiergen, loading the model (``LLM(name)``) and
the first token of a short prompt, each in a fresh process, --turns times in turns, and the
medians. --cold-tokenizer also times loads whose tokenizer finds nothing kept in the cache
directory (a SentencePiece vocabulary's merges are derived once, then read back).

    python benchmarks/bench_startup.py [--models smollm2 gemma3-270m] [--turns 3]
        [--cold-tokenizer]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys

CHILD = """
import json, time
t0 = time.perf_counter()
import tiergen
from tiergen import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM({model!r})
t2 = time.perf_counter()
llm.generate(["Hello"], SamplingParams(max_tokens=1))
t3 = time.perf_counter()
print(json.dumps(dict(import_s=t1 - t0, load_s=t2 - t1, first_token_s=t3 - t2)))
"""


def run(model: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD.format(model=model)], check=True,
                          capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--cold-tokenizer", action="store_true")
    a = ap.parse_args()
    from tiergen.bench import cpu_description
    from tiergen.paths import cache_dir

    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})")
    # (a cold load keeps what the kept one after it reads)
    ways = {"tokenizer cold": True, "kept": False} if a.cold_tokenizer else {"kept": False}
    runs: dict[tuple[str, str], list[dict]] = {(m, w): [] for m in a.models for w in ways}
    for model in a.models:  # a first load, not timed: the kernels built, the tokenizer kept
        run(model)
    for _ in range(a.turns):
        for model in a.models:
            for way, cold in ways.items():
                if cold:
                    shutil.rmtree(cache_dir() / "tokenizers", ignore_errors=True)
                runs[(model, way)].append(run(model))
    print("| model | tokenizer cache | import s | load s | first token s |")
    print("|---|---|---|---|---|")
    for (model, way), results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(f"| {model} | {way} | {med['import_s']:.2f} | {med['load_s']:.2f} | "
              f"{med['first_token_s']:.2f} |")


if __name__ == "__main__":
    main()
