"""float32 matrix-product rate of this CPU on SmolLM2's shapes, and the best total tokens/s at
batch 32 that it allows: the bound behind docs/BENCHMARKS-HISTORY.md's reading of the batch-32
target.

Prefill multiplies 32 x 128 prompt tokens through the layer weights (4096-row products);
decode multiplies 32 rows through every weight, LM head included, once per new token. With
every product at the rates measured here and nothing else costing time, a 32 x (128 + 64)
call cannot finish faster than the printed bound.

    python benchmarks/bench_gemm_peak.py [--model smollm2] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from tiergen.bench import cpu_description
from tiergen.weights import open_model


def rate(m: int, k: int, n: int, repeat: int = 10) -> float:
    """GFLOP/s of (m, k) @ (k, n) in float32."""
    a, b = torch.randn(m, k), torch.randn(n, k)
    for _ in range(3):
        a @ b.T
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b.T
    return 2 * m * k * n * repeat / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = open_model(a.model).config
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}), {a.threads} threads, {a.model}")
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = 2 * h * q + 2 * h * kv + 3 * h * f  # q, o; k, v; gate, up, down
    weights = cfg.num_layers * layer
    tokens = a.batch * a.prompt_len
    prefill = rate(tokens, h, f)
    decode = rate(a.batch, h, f)
    print(f"| product | GFLOP/s |\n|---|---|\n| ({tokens}, {h}) x ({h}, {f}) | {prefill:.1f} |\n"
          f"| ({a.batch}, {h}) x ({h}, {f}) | {decode:.1f} |")
    prefill_s = 2 * tokens * weights / prefill / 1e9
    step_s = 2 * a.batch * (weights + h * v) / decode / 1e9
    total = prefill_s + (a.gen_len - 1) * step_s
    print(f"\nlayer weights {weights / 1e6:.1f} M, LM head {h * v / 1e6:.1f} M: prefill >= "
          f"{prefill_s:.2f} s, a decode step >= {step_s * 1e3:.1f} ms; at best "
          f"{a.batch * a.gen_len / total:.0f} tok/s for {a.batch} x ({a.prompt_len} + "
          f"{a.gen_len}) tokens, prefill included")


if __name__ == "__main__":
    main()
