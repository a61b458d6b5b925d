"""Where the packed kernels stop paying: milliseconds per product of SmolLM2's packed matrices
(three of a layer's, and the 49152-row LM head) with x of 1..128 rows, through packed.c
(blocks decoded on the fly, in registers or a tile at a time) and through
decode-into-a-buffer then the BLAS; tiergen.kernels.ROW_THRESHOLD should sit at the crossover.
Then whether one-row products are bound by memory: the gate projection multiplied again and
again (in cache), and copies of it cycled through 200 MB (from RAM).

    python benchmarks/bench_threshold.py [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import tiergen.kernels as K
from tiergen.bench import cpu_description
from tiergen.weights import open_model

MATRICES = ["model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.gate_proj.weight",
            "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"]


def per_product(x: torch.Tensor, w, threshold: int, repeat: int = 10) -> float:
    K.ROW_THRESHOLD = threshold
    K.packed_linear(x, w)
    t = time.perf_counter()
    for _ in range(repeat):
        K.packed_linear(x, w)
    return (time.perf_counter() - t) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})")
    files = open_model("smollm2")
    print("| threads | matrix | rows | packed.c ms | decode + BLAS ms |")
    print("|---|---|---|---|---|")
    for threads in a.threads:
        torch.set_num_threads(threads)
        for name in MATRICES:
            w = files.source.get(name)
            for rows in (1, 2, 4, 8, 16, 32, 64, 128):
                x = torch.randn(rows, w.shape[1])
                kernel, blas = per_product(x, w, 1 << 30), per_product(x, w, 0)
                print(f"| {threads} | {name.split('.')[-2]} {tuple(w.shape)} | {rows} | "
                      f"{kernel:.2f} | {blas:.2f} |", flush=True)
    print("\n| threads | gate (1536, 576), 1 row | ms | G values/s |")
    print("|---|---|---|---|")
    K.ROW_THRESHOLD = 1 << 30  # the kernel (per_product left it at the BLAS)
    w = files.source.get(MATRICES[1])
    copies = [replace(w, data=w.data.clone()) for _ in range(200 * 2**20 // w.nbytes)]
    x = torch.randn(1, w.shape[1])
    for threads in a.threads:
        torch.set_num_threads(threads)
        for where, use in (("in cache", [w] * len(copies)), ("from RAM", copies)):
            for v in use[:5]:
                K.packed_linear(x, v)
            t = time.perf_counter()
            for v in use:
                K.packed_linear(x, v)
            ms = (time.perf_counter() - t) / len(use) * 1e3
            print(f"| {threads} | {where} | {ms:.3f} | {w.shape[0] * w.shape[1] / ms / 1e6:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
