"""The packed kernels of this tree against a variant of them, built side by side: milliseconds
per product (few activation rows) on SmolLM2's and Gemma 3's matrices, and how far the
variant's results are from the tree's, relative to the output's largest value.

A variant is a patch to tiergen/kernels/packed.c (``benchmarks/variants/``);
``int16-activations.patch`` rounds the activations to 16-bit integers and multiplies
integers (vpmaddwd) in the few-row path, an experiment not kept: faster, but it spends most of
the 1e-4 the products promise.

    python benchmarks/bench_kernel_variant.py [--patch benchmarks/variants/int16-activations.patch]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import tiergen.kernels as K
from tiergen.bench import cpu_description
from tiergen.weights import open_model

ROOT = Path(__file__).resolve().parents[1]
MATRICES = {"smollm2": ["gate_proj", "down_proj", "embed_tokens"],
            "gemma3-270m": ["gate_proj", "down_proj", "embed_tokens"]}


def build(sources: list[Path], out: Path) -> ctypes.CDLL:
    K._compile(out, sources=sources)
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tg_matmul.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr, i64]
    lib.tg_dequant.argtypes = [ctypes.c_int, ptr, i64, ptr]
    return lib


def per_product(lib: ctypes.CDLL, x: torch.Tensor, w, repeat: int = 20) -> float:
    K._lib = lib
    K.packed_linear(x, w)
    start = time.perf_counter()
    for _ in range(repeat):
        K.packed_linear(x, w)
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patch", default=str(ROOT / "benchmarks/variants/int16-activations.patch"))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 3])
    a = p.parse_args()
    tree = [ROOT / "tiergen/kernels/packed.c", ROOT / "tiergen/kernels/decode.c"]
    with tempfile.TemporaryDirectory() as tmp:
        variant = Path(tmp) / "packed.c"
        variant.write_bytes(tree[0].read_bytes())
        subprocess.run(["patch", "-s", str(variant), a.patch], check=True)
        base = build(tree, Path(tmp) / "tree.so")
        other = build([variant, tree[1]], Path(tmp) / "variant.so")
        cpu = cpu_description()
        print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}); variant: {Path(a.patch).name}\n")
        print("| model | matrix | rows | tree ms | variant ms | speed-up | max difference |")
        print("|---|---|---|---|---|---|---|")
        for model, names in MATRICES.items():
            source = open_model(model).source
            for name in names:
                full = ("model.embed_tokens.weight" if name == "embed_tokens" else
                        f"model.layers.3.mlp.{name}.weight")
                w = source.get(full)
                for rows in a.rows:
                    x = torch.randn(rows, w.shape[1])
                    K._lib = base
                    want = K.packed_linear(x, w)
                    K._lib = other
                    diff = ((K.packed_linear(x, w) - want).abs().max() / want.abs().max()).item()
                    # alternated, best of two each: the machine drifts
                    t0, t1 = per_product(base, x, w), per_product(other, x, w)
                    t0, t1 = min(t0, per_product(base, x, w)), min(t1, per_product(other, x, w))
                    print(f"| {model} | {name} {tuple(w.shape)} | {rows} | {t0:.3f} | {t1:.3f} "
                          f"| {t0 / t1:.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
