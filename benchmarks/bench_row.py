"""What bounds a decode step's packed products of one activation row (the integer path):
this machine's read bandwidth, one-row products of a large matrix (in cache) per type on one
and two threads, and what a call costs beside its arithmetic (a 64-row matrix).

    python benchmarks/bench_row.py [--types Q4_0,Q8_0,Q4_K]

--against REV times this tree's one-row products against a git revision's kernels (both
built here, taking turns, as ``bench_int8.py --against`` does) on the 8192x8192 matrix and
a DeepSeek-V3-shaped model's expert matrices (bench_moe_gguf.py's), for --types.

    python benchmarks/bench_row.py --against HEAD~1 --types Q4_0,Q4_1 [--march haswell]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiergen import kernels
from tiergen.bench import cpu_description
from tiergen.weights.quant import GGMLType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8 import builds, in_turns, random_packed  # noqa: E402
from bench_widen import best_ms  # noqa: E402


def per_call(f, n: int) -> float:
    """Seconds per call of ``f``, after a warm-up."""
    for _ in range(max(1, n // 10)):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_0,Q8_0,Q4_K")
    ap.add_argument("--against", metavar="REV", help="a git revision to time against")
    ap.add_argument("--march", help="with --against: build both for this -march")
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})")
    torch.set_num_threads(2)
    if args.against:
        against(args.against, args.types.split(","), args.march)
        return
    ones = torch.ones(2**28)  # 1 GiB
    print(f"read bandwidth, torch.sum over 1 GiB, 2 threads: "
          f"{ones.nbytes / per_call(ones.sum, 5) / 1e9:.1f} GB/s")
    del ones
    print("| type | threads | ms (8192x8192, one row) | G weights/s | GB/s |")
    print("|---|---|---|---|---|")
    x = torch.randn(1, 8192)
    for name in args.types.split(","):
        w = random_packed(GGMLType[name], 8192, 8192)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            s = per_call(lambda: kernels.integer_linear(x, w, None, 4), 20)
            print(f"| {name} | {threads} | {s * 1e3:.2f} | {8192 * 8192 / s / 1e9:.1f} | "
                  f"{w.data.numel() / s / 1e9:.1f} |")
    torch.set_num_threads(2)
    small, x = random_packed(GGMLType.Q4_0, 64, 2048), torch.randn(1, 2048)
    a, y = kernels.quantize_activations(x, 4), torch.empty(1, 64)
    desc, lib = kernels.matrix_descriptor(small), kernels.library()
    whole = per_call(lambda: kernels.integer_linear(x, small, None, 4), 3000)
    quantise = per_call(lambda: kernels.quantize_activations(x, 4), 3000)
    product = per_call(lambda: lib.tg_qmatmul(desc, a.q.data_ptr(), None, a.scales.data_ptr(),
                                              a.sums.data_ptr(), 4, 1, y.data_ptr()), 3000)
    print(f"a call on 64x2048 Q4_0: integer_linear {whole * 1e6:.1f} us, of which quantising "
          f"the row {quantise * 1e6:.1f} us and the product's call {product * 1e6:.1f} us")


def against(rev: str, types: list[str], march: str | None) -> None:
    """One-row products, this tree's kernels against ``rev``'s, 2 threads, in turns."""
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(rev, Path(tmp), march)
        print(f"| type | matrix | {rev} ms | this tree ms | this tree GB/s | "
              f"speed-up (median of turns) |")
        print("|---|---|---|---|---|---|")
        for name in types:
            for n, k in ((8192, 8192), (2816, 2048), (2048, 1408)):
                w, x = random_packed(GGMLType[name], n, k), torch.randn(1, k)
                best, ratio = in_turns(
                    libs, lambda: best_ms(lambda: kernels.integer_linear(x, w, None, 4), 5),
                    10, rev)
                print(f"| {name} | {n}x{k} | {best[rev]:.3f} | {best['this tree']:.3f} | "
                      f"{w.data.numel() / best['this tree'] / 1e6:.1f} | {ratio:.2f}x |",
                      flush=True)


if __name__ == "__main__":
    main()
