"""The integer path's KV cache in float16 against float32, in turns in one process: a batch
of prompts generated with each (``tiergen.bench.run``), decode and total tokens/s, the
median of the turns.

    python benchmarks/bench_kv_dtype.py [--models smollm2 gemma3-270m] [--batch 32]
        [--prompt-len 128] [--gen-len 64] [--turns 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tiergen import LLM
from tiergen.bench import cpu_description, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--turns", type=int, default=3)
    a = p.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}); batch {a.batch}, prompts of {a.prompt_len} "
          f"tokens, {a.gen_len} new")
    print("| model | KV cache | decode tok/s | total tok/s | float16 / float32 (total, median "
          "of turns) |")
    print("|---|---|---|---|---|")
    for model in a.models:
        llm = LLM(model)
        assert llm.executor.kv_dtype == torch.float16, "not the integer path on a CPU"
        run(llm, a.batch, a.prompt_len, a.gen_len)  # warm-up
        runs: dict[torch.dtype, list[dict]] = {torch.float16: [], torch.float32: []}
        for turn in range(a.turns):
            for dtype in sorted(runs, key=str, reverse=turn % 2 == 1):
                llm.executor.kv_dtype = dtype
                runs[dtype].append(run(llm, a.batch, a.prompt_len, a.gen_len))
        ratio = statistics.median(r32["seconds"] / r16["seconds"]
                                  for r16, r32 in zip(runs[torch.float16], runs[torch.float32]))
        for dtype, r in runs.items():
            decode = statistics.median(x["decode_tok_s"] for x in r)
            total = statistics.median(x["total_tok_s"] for x in r)
            print(f"| {model} | {str(dtype).removeprefix('torch.')} | {decode:.1f} | {total:.1f} "
                  f"| {f'{ratio:.2f}x' if dtype == torch.float16 else ''} |", flush=True)


if __name__ == "__main__":
    main()
