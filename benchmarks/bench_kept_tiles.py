"""Kept tiles against tiles built at every product: batched generation with
``Policy(keep_tiles=True)`` (the default) and ``False``, both LLMs in one process, taking
turns (this machine's speed drifts between runs; turns see the same drift). Reports each
one's median total and decode tokens/s, and the tiles' bytes.

    python benchmarks/bench_kept_tiles.py [--models smollm2 gemma3-270m] [--batch 32]
        [--prompt-len 128] [--gen-len 64] [--turns 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.bench import cpu_description
from tiergen.weights.packed import Packed


def kept_bytes(llm: LLM) -> int:
    seen = {id(t): t for t in llm.executor.globals.values() if isinstance(t, Packed)}
    for layer in llm.executor.weights._views.values():
        seen.update({id(t): t for t in layer.values() if isinstance(t, Packed)})
    return sum(t.tiles.numel() for t in seen.values() if t.tiles is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    a = ap.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']} [{' '.join(cpu['simd'])}]; batch {a.batch}, "
          f"{a.prompt_len} + {a.gen_len} tokens, {a.turns} turns")
    print("| model | tiles | total tok/s | decode tok/s | tiles kept |")
    print("|---|---|---|---|---|")
    for model in a.models:
        llms = {keep: LLM(model, policy=Policy(keep_tiles=keep)) for keep in (True, False)}
        ids = torch.randint(100, llms[True].config.vocab_size, (a.batch, a.prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
        params = SamplingParams(max_tokens=a.gen_len, temperature=0, ignore_eos=True)
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for turn in range(a.turns):
            for keep in ((True, False) if turn % 2 else (False, True)):
                t = time.perf_counter()
                llms[keep].generate(ids, params)
                seconds = time.perf_counter() - t
                s = llms[keep].last_stats
                runs[keep].append((a.batch * a.gen_len / seconds,
                                   s.decode_tokens / s.decode_seconds))
        for keep in (True, False):
            total = statistics.median(r[0] for r in runs[keep])
            decode = statistics.median(r[1] for r in runs[keep])
            print(f"| {model} | {'kept' if keep else 'built at each product'} | {total:.1f} | "
                  f"{decode:.1f} | {kept_bytes(llms[keep]) / 2**20:.0f} MiB |", flush=True)
        del llms


if __name__ == "__main__":
    main()
