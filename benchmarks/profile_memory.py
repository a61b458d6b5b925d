"""Where a batch-1 generation's resident memory goes: the process's RSS and peak after each
phase (torch imported, tiergen imported, the model loaded, a generation), and after the
generation the mappings holding the most of it (``/proc/self/smaps``: the model file's pages,
torch's libraries, the heap).

    python benchmarks/profile_memory.py [--model smollm2] [--top 8]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import torch


def status() -> str:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    mb = {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    return (f"RSS {mb['VmRSS']:.0f} MB (peak {mb['VmHWM']:.0f}; anonymous {mb['RssAnon']:.0f}, "
            f"file-backed {mb['RssFile']:.0f})")


def mappings() -> Counter:
    """Resident kB per mapped file ([heap], [anon] and the like for the rest)."""
    held: Counter = Counter()
    name = "[anon]"
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split()
            name = parts[5] if len(parts) > 5 else "[anon]"
        elif line.startswith("Rss:"):
            held[name] += int(line.split()[1])
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    print("torch imported:", status())
    from tiergen import LLM, SamplingParams
    print("tiergen imported:", status())
    llm = LLM(a.model)
    print("model loaded:", status())
    ids = torch.randint(100, llm.config.vocab_size, (1, 128),
                        generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    print("128 + 64 tokens generated:", status())
    for name, kb in mappings().most_common(a.top):
        print(f"  {kb / 1024:7.1f} MB  {name}")


if __name__ == "__main__":
    main()
