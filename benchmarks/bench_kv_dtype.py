"""The integer path's KV cache in float16 against float32, in turns in one process: a batch
of random prompts generated with each, decode and total tokens/s, the median of the turns.

    python benchmarks/bench_kv_dtype.py [--models smollm2 gemma3-270m] [--batch 32]
        [--prompt-len 128] [--gen-len 64] [--turns 3]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tiergen import LLM, SamplingParams
from tiergen.bench import cpu_description


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
          f"random tokens, {a.gen_len} new")
    print("| model | KV cache | decode tok/s | total tok/s | float16 / float32 (total, median "
          "of turns) |")
    print("|---|---|---|---|---|")
    params = SamplingParams(max_tokens=a.gen_len, temperature=0, ignore_eos=True)
    for model in a.models:
        llm = LLM(model)
        assert llm.executor.kv_dtype == torch.float16, "not the integer path on a CPU"
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, llm.config.vocab_size, (a.batch, a.prompt_len),
                            generator=g).tolist()
        llm.generate(ids, params)  # warm-up
        runs: dict[torch.dtype, list[tuple[float, float]]] = {torch.float16: [], torch.float32: []}
        ratios = []
        for turn in range(a.turns):
            took = {}
            for dtype in sorted(runs, key=str, reverse=turn % 2 == 1):
                llm.executor.kv_dtype = dtype
                llm.generate(ids, params)
                s = llm.last_stats
                total = s.decode_tokens + a.batch  # (the prompt's step gives each row one)
                took[dtype] = s.prefill_seconds + s.decode_seconds
                runs[dtype].append((s.decode_tokens / s.decode_seconds, total / took[dtype]))
            ratios.append(took[torch.float32] / took[torch.float16])
        for dtype, r in runs.items():
            decode = statistics.median(x for x, _ in r)
            total = statistics.median(y for _, y in r)
            ratio = f"{statistics.median(ratios):.2f}x" if dtype == torch.float16 else ""
            print(f"| {model} | {str(dtype).removeprefix('torch.')} | {decode:.1f} | {total:.1f} "
                  f"| {ratio} |", flush=True)


if __name__ == "__main__":
    main()
