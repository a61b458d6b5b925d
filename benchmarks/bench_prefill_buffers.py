"""A prompt batch's buffers, three ways: every buffer from glibc's heap, none mapped apart (tiergen's
default, ``_platform.keep_freed_buffers``); buffers above 32 MB mapped apart when the heap has
no free block for them (tiergen's setting before); and glibc's default, which maps every
allocation above its (lower) threshold afresh and unmaps it when it is freed. A batch of 32
random prompts of 128 tokens, prefill alone (one new token) and a whole generation of 64 new
tokens, each way in fresh processes taking turns. Reports each way's median seconds, the page
faults of one prefill and the process's peak resident memory.

    python benchmarks/bench_prefill_buffers.py [--model smollm2] [--turns 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from tiergen.bench import cpu_description

CHILD = r"""
import json, resource, sys, time, torch
from tiergen import LLM, SamplingParams
llm = LLM(sys.argv[1])
ids = torch.randint(100, llm.config.vocab_size, (32, 128),
                    generator=torch.Generator().manual_seed(0)).tolist()
one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
many = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
llm.generate(ids, one)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = time.perf_counter(); llm.generate(ids, one); prefill = time.perf_counter() - t
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
t = time.perf_counter(); llm.generate(ids, many); whole = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"prefill_s": prefill, "faults": faults, "whole_s": whole, "peak_mb": peak}))
"""

# glibc's default: a malloc tunable of the user's (a no-op) makes tiergen leave malloc alone
WAYS = {
    "all from the heap (tiergen)": {},
    "mapped above 32 MB": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=33554432:"
                                             "glibc.malloc.trim_threshold=268435456"},
    "glibc's default": {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']} [{' '.join(cpu['simd'])}]; {args.model}, batch 32, 128 + 64 "
          f"tokens, {args.turns} turns")
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for turn in range(args.turns):
        for way in sorted(WAYS, reverse=turn % 2 == 1):
            env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | WAYS[way]
            out = subprocess.run([sys.executable, "-c", CHILD, args.model], env=env,
                                 check=True, capture_output=True, text=True).stdout
            runs[way].append(json.loads(out.strip().splitlines()[-1]))
    print("| buffers | prefill s | page faults in a prefill | 128 + 64 tokens s | total tok/s "
          "| peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for way, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {way} | {med['prefill_s']:.3f} | {med['faults']:,.0f} | {med['whole_s']:.3f} | "
              f"{32 * 64 / med['whole_s']:.1f} | {med['peak_mb']:,.0f} |")


if __name__ == "__main__":
    main()
