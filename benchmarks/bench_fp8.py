"""FP8 matrices (DeepSeek-V3's block-scaled e4m3, kept as tiergen's FP8 blocks) multiplied
packed, against the same matrix inflated at load to bfloat16 or float32 and multiplied by
torch, and against Q8_0 (the same bits a weight, multiplied packed): milliseconds per product.

    python benchmarks/bench_fp8.py [--threads 2] [--rows 1,8,32,512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import machine  # noqa: E402
from bench_widen import best_ms  # noqa: E402

SHAPES = [(2048, 2048), (1408, 2048), (2048, 1408)]  # (rows, columns): multiples of 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32,512")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tiergen import kernels
    from tiergen.weights.fp8 import fp8_dequantize, fp8_packed
    from tiergen.weights.quant import GGMLType
    from tiergen.weights.quantize import quantize_matrix
    from tiergen.weights.packed import Packed

    print(f"{machine()}; threads {args.threads}")
    print("| matrix | rows | FP8 packed ms | bfloat16 ms | float32 ms | Q8_0 packed ms | "
          "bfloat16 / FP8 |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * k ** -0.5
        scale = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448
        q = (w / scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)).to(
            torch.float8_e4m3fn)
        fp8 = fp8_packed(q, scale, 128)
        dense = fp8_dequantize(q, scale, 128)
        bf16 = dense.to(torch.bfloat16)
        q8 = Packed(quantize_matrix(dense, GGMLType.Q8_0).view(-1), (n, k), ((GGMLType.Q8_0, n),))
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=gen)
            xb = x.to(torch.bfloat16)
            runs = 5 if m > 32 else 30
            with kernels.activations_set("float32"):
                t_fp8 = best_ms(lambda: kernels.packed_linear(x, fp8), runs)
                t_q8 = best_ms(lambda: kernels.packed_linear(x, q8), runs)
            t_bf16 = best_ms(lambda: F.linear(xb, bf16), runs)
            t_f32 = best_ms(lambda: F.linear(x, dense), runs)
            print(f"| {n}x{k} | {m} | {t_fp8:.3f} | {t_bf16:.3f} | {t_f32:.3f} | {t_q8:.3f} | "
                  f"{t_bf16 / t_fp8:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
