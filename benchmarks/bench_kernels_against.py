"""Whole generations with this tree's C kernels against a git revision's, both built here and
loaded in one process with one model, taking turns (this machine's speed drifts between runs;
turns see the same drift): each one's median total, prefill and decode tokens/s, and the
median over the turns of the ratio of their total times (and their spread). Where a kernel
change shows in `bench_int8.py` but a whole step is what counts (kept tiles, the decode layer,
attention). The revision's kernels must take the arguments this tree passes them (the same
functions and layer description).

    python benchmarks/bench_kernels_against.py --against HEAD~1 [--models smollm2 gemma3-270m]
        [--batch 32] [--prompt-len 128] [--gen-len 64] [--turns 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tiergen import LLM, kernels
from tiergen.bench import cpu_description, run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8 import build_at  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, metavar="REV")
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--turns", type=int, default=5)
    a = ap.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']} [{' '.join(cpu['simd'])}]; batch {a.batch}, "
          f"{a.prompt_len} + {a.gen_len} tokens, {a.turns} turns")
    print(f"| model | kernels | total tok/s | prefill tok/s | decode tok/s | "
          f"speed-up over {a.against} (median of turns) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "rev").mkdir()
        libs = {a.against: kernels.bind(build_at(a.against, Path(tmp) / "rev" / "k.so")),
                "this tree": kernels.library()}
        try:
            for model in a.models:
                llm = LLM(model)
                run(llm, a.batch, a.prompt_len, a.gen_len)  # warm-up: tiles kept, buffers made
                runs: dict[str, list[dict]] = {key: [] for key in libs}
                for turn in range(a.turns):
                    for key in sorted(libs, reverse=turn % 2 == 1):
                        kernels._lib = libs[key]
                        runs[key].append(run(llm, a.batch, a.prompt_len, a.gen_len))
                ratios = [r["seconds"] / t["seconds"]
                          for r, t in zip(runs[a.against], runs["this tree"])]
                ratio = statistics.median(ratios)
                for key in libs:
                    med = {f: statistics.median(r[f] for r in runs[key])
                           for f in ("total_tok_s", "prefill_tok_s", "decode_tok_s")}
                    print(f"| {model} | {key} | {med['total_tok_s']:.1f} | "
                          f"{med['prefill_tok_s']:.0f} | {med['decode_tok_s']:.1f} | "
                          + (f"{ratio:.3f}x ({min(ratios):.2f}-{max(ratios):.2f}x) |"
                             if key == "this tree" else "- |"), flush=True)
        finally:
            kernels._lib = libs["this tree"]


if __name__ == "__main__":
    main()
