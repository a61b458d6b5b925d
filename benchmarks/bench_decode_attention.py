"""One new token's attention over a cache: tiergen's C kernel (kernels.decode_attention)
against the torch path it replaces (layers.attention with the library disabled), for
SmolLM2's and Gemma 3's head shapes; a quarter of the slots masked out. --against REV times
this tree's kernel against a git revision's instead, taking turns; with --layers N too, on a
float16 cache (the integer path's) of N layers, each call through all of them as a decode step
goes, so that the cache lies past L2 as a batch's does.

    python benchmarks/bench_decode_attention.py [--against HEAD~1 [--layers 30]]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiergen import kernels
from tiergen.bench import cpu_description
from tiergen.cache import attention as layers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8 import builds, in_turns  # noqa: E402

SHAPES = [  # (name, batch, query heads, KV heads, slots, head dim)
    ("smollm2", 1, 9, 3, 192, 64), ("smollm2", 32, 9, 3, 192, 64),
    ("gemma3-270m", 1, 4, 1, 192, 256), ("gemma3-270m", 32, 4, 1, 192, 256),
    ("gemma3-270m ring", 32, 4, 1, 512, 256),
]


def per_call(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def inputs(B: int, H: int, KVH: int, S: int, D: int):
    q = torch.randn(B, H, 1, D)
    kv = torch.randn(2, B, KVH, S, D)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[..., S * 3 // 4:] = False
    return q, kv[0], kv[1], mask


def call(lib, q, k, v, mask) -> torch.Tensor:
    """``lib``'s kernel (a revision's from before the float16 cache too: no kv16 argument)."""
    B, H, _, D = q.shape
    out = torch.empty(B, H, 1, v.shape[-1])
    strides = (ctypes.c_int64 * 6)(*k.stride()[:3], *v.stride()[:3])
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    args = [ptr(t.data_ptr()) for t in (q, k, v, mask)]
    args += [i64(n) for n in (B, H, k.shape[1], k.shape[2], D, v.shape[-1])]
    args += [strides, ctypes.byref(strides, 24), ctypes.c_float(D**-0.5)]
    kv16 = [ctypes.c_int(k.dtype == torch.float16)] if hasattr(lib, "tg_to_half") else []
    lib.tg_decode_attention(*args, *kv16, ptr(out.data_ptr()))
    return out


def against(rev: str) -> None:
    """This tree's kernel against revision ``rev``'s on a float32 cache, in turns: each one's
    best of the turns, and the median of the turns' ratios; then this tree's on a float16
    cache (the integer path's) against ``rev``'s on float32."""
    print(f"| shape | batch | slots | {rev} ms | this tree ms | speed-up | this tree, float16 "
          f"cache ms | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(rev, Path(tmp))
        for lib in libs.values():
            lib.tg_decode_attention.argtypes = None  # (call gives each its own arguments)
        for name, B, H, KVH, S, D in SHAPES:
            q, k, v, mask = inputs(B, H, KVH, S, D)
            k16, v16 = k.half(), v.half()
            n = 500 if B == 1 else 50
            best, ratio = in_turns(
                libs, lambda: per_call(lambda: call(kernels._lib, q, k, v, mask), n), 10, rev)
            # (in turns: rev on float32, this tree on float16)
            best16, ratio16 = in_turns(
                libs, lambda: per_call(lambda: call(kernels._lib, q, *(
                    (k16, v16) if kernels._lib is libs["this tree"] else (k, v)), mask), n),
                10, rev)
            print(f"| {name} | {B} | {S} | {best[rev]:.3f} | {best['this tree']:.3f} | "
                  f"{ratio:.2f}x | {best16['this tree']:.3f} | {ratio16:.2f}x |", flush=True)
        kernels.bind(libs["this tree"])


def against_layers(rev: str, layers: int) -> None:
    """This tree's kernel against ``rev``'s over a float16 cache of ``layers`` layers (a
    quarter of the slots masked out), in turns: each one's best time a step, and the median
    of the turns' ratios."""
    print(f"| shape | batch | slots | {rev} ms a step | this tree ms a step | speed-up |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(rev, Path(tmp))
        kernels.bind(libs[rev])
        for name, B, H, KVH, S, D in SHAPES:
            q, _, _, mask = inputs(B, H, KVH, S, D)
            caches = [torch.randn(2, B, KVH, S, D).half() for _ in range(layers)]
            steps = 3 if B > 1 else 30

            def step_ms() -> float:
                t = time.perf_counter()
                for _ in range(steps):
                    for kv in caches:
                        kernels.decode_attention(q, kv[0], kv[1], mask)
                return (time.perf_counter() - t) / steps * 1e3

            best, ratio = in_turns(libs, step_ms, 15, rev)
            print(f"| {name} | {B} | {S} | {best[rev]:.2f} | {best['this tree']:.2f} | "
                  f"{ratio:.2f}x |", flush=True)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", metavar="REV", help="a git revision to time against")
    ap.add_argument("--layers", type=int, help="with --against: a float16 cache of this many "
                    "layers, each timed call through all of them")
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}), {torch.get_num_threads()} threads\n")
    if args.against and args.layers:
        return against_layers(args.against, args.layers)
    if args.against:
        return against(args.against)
    print("| shape | batch | slots | C kernel ms | torch ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, B, H, KVH, S, D in SHAPES:
        q, k, v, mask = inputs(B, H, KVH, S, D)
        n = 2000 if B == 1 else 200
        c = per_call(lambda: kernels.decode_attention(q, k, v, mask), n)
        lib, kernels._lib = kernels._lib, False
        try:
            t = per_call(lambda: layers.attention(q, k, v, mask), n)
        finally:
            kernels._lib = lib
        print(f"| {name} | {B} | {S} | {c:.3f} | {t:.3f} | {t / c:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
