"""One new token's attention over a cache: tiergen's C kernel (kernels.decode_attention)
against the torch path it replaces (layers.attention with the library disabled), for
SmolLM2's and Gemma 3's head shapes; a quarter of the slots masked out.

    python benchmarks/bench_decode_attention.py
"""

from __future__ import annotations

import time

import torch

from tiergen import kernels
from tiergen.bench import cpu_description
from tiergen.cache import attention as layers

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


@torch.inference_mode()
def main() -> None:
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}), {torch.get_num_threads()} threads\n")
    print("| shape | batch | slots | C kernel ms | torch ms | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, B, H, KVH, S, D in SHAPES:
        q = torch.randn(B, H, 1, D)
        kv = torch.randn(2, B, KVH, S, D)
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        mask[..., S * 3 // 4:] = False
        n = 2000 if B == 1 else 200
        c = per_call(lambda: kernels.decode_attention(q, kv[0], kv[1], mask), n)
        lib, kernels._lib = kernels._lib, False
        try:
            t = per_call(lambda: layers.attention(q, kv[0], kv[1], mask), n)
        finally:
            kernels._lib = lib
        print(f"| {name} | {B} | {S} | {c:.3f} | {t:.3f} | {t / c:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
