"""Prefill attention in float32, bfloat16 and float16 on this CPU: torch's
``scaled_dot_product_attention`` over one 4,096-token causal prompt with SmolLM2's heads (9
query heads, 3 KV heads of 64), milliseconds a layer (mean of 5 after 2 warm-ups).

    python benchmarks/bench_attention_dtype.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import time

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
import torch
import torch.nn.functional as F

from tiergen.bench import cpu_description


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}); {torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(1, h, args.tokens, 64, generator=g).to(dtype) for h in (9, 3, 3))
        run = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        for _ in range(2):
            run()
        t = time.perf_counter()
        for _ in range(5):
            run()
        print(f"{dtype}: {(time.perf_counter() - t) / 5 * 1e3:.1f} ms a layer")


if __name__ == "__main__":
    main()
