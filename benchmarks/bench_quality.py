"""What compression and sparse attention cost in quality: perplexity of SmolLM2-135M (float32)
on the public-domain text in tests/data/perplexity.txt.

Whole text fed in chunks of 512 through the cache, for weight and cache compression; then the
first 1,200 characters token by token (every query reads the cache, as decode does), for the
cache and sparse attention.

    python benchmarks/bench_quality.py
"""

from __future__ import annotations

from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)

from tiergen import LLM, Policy

TEXT = (Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt").read_text()

CHUNKED = [
    ("dense", {}),
    ("8-bit weights (groups of 64)", dict(compress_weights=True, compress_bits=8)),
    ("8-bit KV cache", dict(compress_cache=True, compress_bits=8)),
    ("8-bit weights and cache", dict(compress_weights=True, compress_cache=True, compress_bits=8)),
    ("4-bit KV cache (groups of 64)", dict(compress_cache=True)),
    ("4-bit weights, groups of 64 (the default)", dict(compress_weights=True)),
    ("4-bit weights and cache, groups of 64", dict(compress_weights=True, compress_cache=True)),
    ("4-bit weights, groups of 32", dict(compress_weights=True, compress_group_size=32)),
    ("4-bit weights and cache, groups of 32",
     dict(compress_weights=True, compress_cache=True, compress_group_size=32)),
]
DECODE = [
    ("dense", {}),
    ("4-bit KV cache", dict(compress_cache=True)),
    ("attn_sparsity 0.5", dict(attn_sparsity=0.5)),
    ("attn_sparsity 0.25", dict(attn_sparsity=0.25)),
    ("attn_sparsity 0.5 and 4-bit cache", dict(attn_sparsity=0.5, compress_cache=True)),
]


def table(title: str, text: str, cases: list, chunk: int) -> None:
    tokens = len(LLM("smollm2", dtype="float32").encode(text))
    print(f"\n{title} ({tokens} tokens)\n\n| policy | perplexity | vs dense |\n|---|---|---|")
    base = None
    for name, options in cases:
        ppl = LLM("smollm2", dtype="float32", prefill_chunk_size=chunk,
                  policy=Policy(**options)).perplexity(text)
        base = base or ppl
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / base - 1):+.1f} % |", flush=True)


def main() -> None:
    table("Whole text, chunks of 512", TEXT, CHUNKED, 512)
    table("First 1,200 characters, token by token", TEXT[:1200], DECODE, 1)


if __name__ == "__main__":
    main()
