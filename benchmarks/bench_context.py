"""Batch-1 decode against the context it runs over, tiergen beside llama.cpp: ``tiergen bench
--against llama.cpp`` at each prompt length, its per-turn medians tabled and plotted
(docs/bench_context.png).

    python benchmarks/bench_context.py [--model smollm2] [--lengths 128 1024 4096] [--turns 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from plot import throughput_plot  # noqa: E402

from tiergen.bench import median_run, ratio  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--plot", default=str(HERE.parent / "docs" / "bench_context.png"))
    a = p.parse_args()
    rows = []
    for length in a.lengths:
        out = subprocess.run([sys.executable, "-m", "tiergen.cli", "bench", "--model", a.model,
                              "--batch", "1", "--prompt-len", str(length), "--gen-len",
                              str(a.gen_len), "--turns", str(a.turns), "--against", "llama.cpp",
                              "--json"], check=True, capture_output=True, text=True).stdout
        info = json.loads(out)
        mine, peer = info["turns"]["1"], info["against"]["1"].get("llama.cpp")
        if peer is None:
            sys.exit("llama.cpp did not run: see `tiergen bench --against llama.cpp`")
        rows.append((length, median_run(mine)["decode_tok_s"], median_run(peer)["decode_tok_s"],
                     ratio(mine, peer, "decode_tok_s")))
        print(f"{length:6d} tokens: tiergen {rows[-1][1]:.1f}, llama.cpp {rows[-1][2]:.1f} "
              f"decode tok/s, {rows[-1][3]:.2f}x", flush=True)
    print(f"\n{info['cpu']} [{' '.join(info['simd'])}], {info['threads']} threads\n")
    print("| context (prompt tokens) | tiergen decode tok/s | llama.cpp decode tok/s | ratio |")
    print("|---|---|---|---|")
    for length, mine, theirs, r in rows:
        print(f"| {length} | {mine:.1f} | {theirs:.1f} | {r:.2f}x |")
    throughput_plot(a.plot, [r[0] for r in rows],
                    {"tiergen": ([r[1] for r in rows], "-"),
                     "llama.cpp": ([r[2] for r in rows], "--")},
                    "prompt tokens before the decode", f"{a.model}, batch-1 decode, "
                    f"{info['threads']} CPU threads", ylabel="decode tokens/s")


if __name__ == "__main__":
    main()
