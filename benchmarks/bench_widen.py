"""bfloat16 matmuls on a CPU: torch's bfloat16 kernel against tiergen's ``linear``, which on a
CPU without native bfloat16 widens the weights to float32 a slice at a time from
``UPCAST_ROWS`` rows on (see tiergen/models/layers.py). One (28672, 4096) matrix, Llama-3.1-8B's
fused gate/up; best of 3 after a warm-up.

    python benchmarks/bench_widen.py [--rows 1 4 8 16 32 128 512]
"""

from __future__ import annotations

import argparse
import time

import tiergen  # noqa: F401  (the CPU guard first)
from tiergen.bench import cpu_description
from tiergen._platform import cpu_has_fast_bfloat16
from tiergen.models.layers import UPCAST_ROWS, linear

import torch
import torch.nn.functional as F


def best_ms(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 128, 512])
    a = p.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}), {torch.get_num_threads()} threads; "
          f"linear widens from {UPCAST_ROWS} rows: {not cpu_has_fast_bfloat16()}")
    w = torch.randn(28672, 4096).bfloat16()
    print("| rows | torch bfloat16 ms | tiergen linear ms | speed-up |")
    print("|---|---|---|---|")
    for rows in a.rows:
        x = torch.randn(rows, 4096).bfloat16()
        ours, theirs = best_ms(lambda: linear(x, w)), best_ms(lambda: F.linear(x, w))
        print(f"| {rows} | {theirs:.0f} | {ours:.0f} | {theirs / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
