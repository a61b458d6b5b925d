"""Packed products with float32 activations against the integer kernels' activation formats,
side by side on the same matrices: 8-bit activations with a scale per 4, 8 or 16 values, and
16-bit ones as two int8 halves. Shapes of SmolLM2 and Gemma 3 270M's layers; times are the
best of several runs, one thread unless --threads says otherwise. --cold cycles through copies
of each matrix (256 MiB in all), so that every product reads its weights from memory, as a
model's layers do, instead of from a cache warmed by the run before.

    python benchmarks/bench_int8.py [--threads 2] [--types Q4_1,Q4_K,Q6_K,Q8_0] [--rows 1,2,32,512] [--cold]

--against REV times this tree's int8 products (tiergen's int8 format: a scale per 8 values)
against those of a git revision,
both built here and loaded in this process, taking turns: the best time of each and the median
of their ratios over the turns (this machine's speed drifts between runs; turns see the same
drift).

    python benchmarks/bench_int8.py --threads 2 --against HEAD~1 [--rows 4,32,512] [--march haswell]

--march builds both for another instruction set than this CPU's own (haswell: AVX2 without
VNNI, the path of an AMD EPYC).

--batch-invariant times this tree's int8 products as they are by default against the same
products batch invariant (every product in the tiles' order: kernels.set_activations), taking
turns; with --cold and --march as above.

    python benchmarks/bench_int8.py --batch-invariant --rows 1,2,4 [--cold] [--march haswell]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from tiergen import kernels
from tiergen.bench import cpu_description
from tiergen.weights.packed import Packed
from tiergen.weights.quant import GGMLType, ggml_type_sizes


def best_ms(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of fn after a warm-up, in milliseconds."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


FORMATS = {"int8/4": (4, False), "int8/8": (8, False), "int8/16": (16, False),
           "int16": (16, True)}
SHAPES = [(1536, 640), (640, 2048), (2048, 1024)]


def random_packed(ggml_type: int, rows: int, cols: int) -> Packed:
    """Random blocks with small float16 scales (random bytes there would give NaN)."""
    rng = np.random.default_rng(0)
    block, size = ggml_type_sizes(ggml_type)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16).view(np.uint8)
    at = 208 if ggml_type == GGMLType.Q6_K else 0
    blocks[:, at:at + 2] = scale.reshape(-1, 2)
    if ggml_type in (GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q4_K, GGMLType.Q5_K):
        blocks[:, 2:4] = scale.reshape(-1, 2)
    if ggml_type == GGMLType.MXFP4:  # an E8M0 exponent, then nibbles: scales 2^-10 to 2^-3
        blocks[:, 0] = rng.integers(118, 126, size=len(blocks))
        blocks[:, 1:3] = rng.integers(0, 256, size=(len(blocks), 2))
    return Packed(torch.from_numpy(blocks.reshape(-1)), (rows, cols), ((ggml_type, rows),))


ISA_NAMES = ["portable C", "AVX2", "VNNI"]  # by tg_int8_isa


def matrices(types: list[str], cold: bool) -> Iterator[tuple[str, int, int, Iterator[Packed]]]:
    """(type, n, k, copies) for each type and shape of SHAPES its blocks fit: random blocks,
    cycled through copies of 256 MiB in all where ``cold`` (each product then reads its
    weights from memory), else the one matrix again and again."""
    for name in types:
        ggml_type = GGMLType[name]
        for n, k in SHAPES:
            if k % ggml_type_sizes(ggml_type)[0]:
                continue
            w = random_packed(ggml_type, n, k)
            copies = max(1, (256 << 20) // w.data.numel()) if cold else 1
            yield name, n, k, itertools.cycle(
                [w] + [Packed(w.data.clone(), w.shape, w.parts) for _ in range(copies - 1)])


def build_at(rev: str | None, out: Path, march: str | None = None) -> ctypes.CDLL:
    """The C kernels of git revision ``rev`` (None: this tree), built into ``out`` for
    ``-march=march`` (None: this CPU)."""
    root = Path(__file__).resolve().parents[1]
    src = out.parent / "src"
    src.mkdir()
    here = Path(kernels.__file__).parent
    for path in kernels.SOURCES + kernels.HEADERS:
        if rev is None:
            text = path.read_bytes()
        else:
            shown = subprocess.run(
                ["git", "-C", str(root), "show", f"{rev}:{path.relative_to(root)}"],
                check=path in kernels.SOURCES, capture_output=True)
            if shown.returncode:  # a header the revision's sources do not include yet
                continue
            text = shown.stdout
        dest = src / path.relative_to(here)  # (int8/'s headers in their folder)
        dest.parent.mkdir(exist_ok=True)
        dest.write_bytes(text)
    flags = [f for f in kernels.FLAGS if not f.startswith("-march")] + [f"-march={march}"] \
        if march else kernels.FLAGS
    kernels._compile(out, flags, sources=[src / p.name for p in kernels.SOURCES])
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tg_quantize_act.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr]
    lib.tg_quantize_act.restype = None
    lib.tg_qmatmul.argtypes = [ptr, ptr, ptr, ptr, ptr, ctypes.c_int, i64, ptr]
    return lib


def builds(rev: str, tmp: Path, march: str | None = None) -> dict[str, ctypes.CDLL]:
    """Revision ``rev``'s kernels and this tree's, built under ``tmp`` (this tree's: the loaded
    library, unless built for another ``march``), keyed by ``rev`` and "this tree"."""
    (tmp / "rev").mkdir(), (tmp / "tree").mkdir()
    return {rev: build_at(rev, tmp / "rev" / "k.so", march),
            "this tree": build_at(None, tmp / "tree" / "k.so", march) if march
            else kernels.library()}


def in_turns(libs: dict[str, ctypes.CDLL], time_ms: Callable[[], float], turns: int,
             rev: str) -> tuple[dict[str, float], float]:
    """``time_ms`` with each of ``libs`` as the C kernels, ``turns`` times in turns (the order
    alternating): each one's best time, and the median over the turns of ``rev``'s time over
    "this tree"'s. The kernels are this tree's again afterwards."""
    best, ratios = dict.fromkeys(libs, float("inf")), []
    try:
        for turn in range(turns):
            took = {}
            for key in sorted(libs, reverse=turn % 2 == 1):
                kernels._lib = libs[key]
                took[key] = time_ms()
                best[key] = min(best[key], took[key])
            ratios.append(took[rev] / took["this tree"])
    finally:
        kernels._lib = libs["this tree"]
    return best, statistics.median(ratios)


def against(rev: str, types: list[str], rows: list[int], march: str | None) -> None:
    """This tree's int8 products (tiergen's int8 format) against revision ``rev``'s, taking
    turns."""
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(rev, Path(tmp), march)
        block = kernels.ACTIVATION_FORMATS["int8"][0]
        print(f"| type | matrix | rows | {rev} ms | this tree ms | speed-up (median of turns) |")
        print("|---|---|---|---|---|---|")
        for name, n, k, ws in matrices(types, False):
            w = next(ws)
            for m in rows:
                x = torch.randn(m, k)
                best, ratio = in_turns(
                    libs, lambda: best_ms(lambda: kernels.integer_linear(x, w, None, block), 3),
                    20, rev)
                print(f"| {name} | {n}x{k} | {m} | {best[rev]:.3f} | {best['this tree']:.3f} | "
                      f"{ratio:.2f}x |", flush=True)


def invariance(types: list[str], rows: list[int], cold: bool, march: str | None) -> None:
    """This tree's int8 products by default against batch invariant, taking turns."""
    with tempfile.TemporaryDirectory() as tmp:
        lib = kernels.bind(build_at(None, Path(tmp) / "k.so", march)) if march \
            else kernels.library()
        before = kernels.library()
        kernels._lib = lib
        try:
            isa = ISA_NAMES[lib.tg_int8_isa()]
            print(f"integer kernels: {isa}; {'weights from memory' if cold else 'warm'}")
            print("| type | matrix | rows | default ms | batch invariant ms | invariant / default "
                  "(median of turns) |")
            print("|---|---|---|---|---|---|")
            for name, n, k, ws in matrices(types, cold):
                for m in rows:
                    x = torch.randn(m, k)
                    best, ratios = [float("inf")] * 2, []
                    for turn in range(10):
                        took = [0.0, 0.0]
                        for inv in (turn % 2, 1 - turn % 2):
                            with kernels.activations_set("int8", bool(inv)):
                                took[inv] = best_ms(
                                    lambda: kernels.integer_linear(x, next(ws), None, 8), 5)
                            best[inv] = min(best[inv], took[inv])
                        ratios.append(took[1] / took[0])
                    print(f"| {name} | {n}x{k} | {m} | {best[0]:.3f} | {best[1]:.3f} | "
                          f"{statistics.median(ratios):.2f}x |", flush=True)
        finally:
            kernels._lib = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default="Q4_1,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default="1,2,32,512")
    ap.add_argument("--cold", action="store_true", help="weights from memory, not cache")
    ap.add_argument("--against", metavar="REV", help="a git revision to time against")
    ap.add_argument("--march", help="with --against or --batch-invariant: build for this -march")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="time the default products against batch-invariant ones")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}); threads {args.threads}")
    if args.against:
        return against(args.against, args.types.split(","), list(map(int, args.rows.split(","))),
                       args.march)
    if args.batch_invariant:
        return invariance(args.types.split(","), list(map(int, args.rows.split(","))), args.cold,
                          args.march)
    print(f"threads {args.threads}; {'weights from memory' if args.cold else 'warm'}; integer kernels: "
          f"{ISA_NAMES[kernels.library().tg_int8_isa()]}")
    print("| type | matrix | rows | float32 ms | " + " | ".join(f"{f} ms (x)" for f in FORMATS)
          + " |")
    print("|---" * (4 + len(FORMATS)) + "|")
    for name, n, k, ws in matrices(args.types.split(","), args.cold):
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            runs = 5 if m > 32 else 30
            base = best_ms(lambda: kernels.packed_linear(x, next(ws)), runs)
            cells = []
            for block, wide in FORMATS.values():
                t = best_ms(lambda: kernels.integer_linear(x, next(ws), None, block, wide), runs)
                cells.append(f"{t:.3f} ({base / t:.2f})")
            print(f"| {name} | {n}x{k} | {m} | {base:.3f} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
