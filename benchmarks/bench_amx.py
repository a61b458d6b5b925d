"""torch's bfloat16 matmul with oneDNN free to use AMX (tiergen's choice where its probe says
the tiles work) against oneDNN capped at AVX512_CORE_BF16, each in a fresh process, since
oneDNN reads its ceiling once.

    python benchmarks/bench_amx.py [--threads N]

Shapes: a square 2048 product, and SmolLM2's MLP and a Llama-8B-shaped MLP at a prompt chunk
of 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import tiergen  # noqa: F401  (first: its probe decides oneDNN's ceiling)
from tiergen._platform import ONEDNN_CAP, amx_usable
from tiergen.bench import cpu_description

SHAPES = [(2048, 2048, 2048), (512, 576, 1536), (512, 4096, 14336)]

CHILD = r"""
import json, sys, time
import tiergen, torch
torch.set_num_threads(int(sys.argv[1]))
out = []
for m, k, n in json.loads(sys.argv[2]):
    a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
    a @ b
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < 1.0:
        a @ b
        runs += 1
    out.append(2 * m * k * n * runs / (time.perf_counter() - start) / 1e12)
print(json.dumps(out))
"""


def rates(threads: int, cap: str | None) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if cap:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), json.dumps(SHAPES)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}), {args.threads} threads; "
          f"AMX usable: {amx_usable()}")
    capped, free = rates(args.threads, ONEDNN_CAP), rates(args.threads, None)
    print("\n| m x k x n | capped at AVX512_CORE_BF16 TFLOP/s | tiergen's choice TFLOP/s | ratio |")
    print("|---|---:|---:|---:|")
    for (m, k, n), c, f in zip(SHAPES, capped, free):
        print(f"| {m} x {k} x {n} | {c:.3f} | {f:.3f} | {f / c:.1f}x |")


if __name__ == "__main__":
    main()
