"""``tiergen bench``: throughput of a model and policy on this machine, batch size by batch size.

The protocol: ``batch`` prompts of ``prompt_len`` token ids each, ``gen_len`` greedy new tokens
each (EOS ignored), one warm-up run, then one timed run per batch size. It reports tokens per
second of decode and of the whole run (prefill included), and the process's peak resident
memory, with the CPU model and its SIMD flags (numbers mean something only next to a peer
measured on the same machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time

SIMD_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512bw", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")


def cpu_description() -> dict:
    """CPU model name and the SIMD flags that decide which kernels run fast."""
    from tiergen._platform import cpu_flags

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    flags = cpu_flags()
    return {"cpu": model, "simd": [f for f in SIMD_FLAGS if f in flags]}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(llm, batch: int, prompt_len: int, gen_len: int) -> dict:
    from tiergen import SamplingParams

    vocab = llm.config.vocab_size
    prompts = [[(17 + 31 * i + 7 * t) % (vocab - 1) + 1 for t in range(prompt_len)]
               for i in range(batch)]
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - started
    s = llm.last_stats
    return {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
            "total_tok_s": batch * gen_len / seconds,
            "decode_tok_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
            "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
            "seconds": seconds, "peak_rss_mb": peak_rss_mb()}


def cmd_bench(args: argparse.Namespace) -> None:
    from tiergen.cli import _load
    from tiergen.errors import TiergenError

    if min(args.batch + [args.prompt_len, args.gen_len]) < 1:
        raise TiergenError("--batch, --prompt-len and --gen-len must be positive integers")
    started = time.perf_counter()
    llm = _load(args)
    load_seconds = time.perf_counter() - started
    info = {**cpu_description(), "model": llm.name, "dtype": str(llm.dtype).removeprefix("torch."),
            "device": str(llm.device), "load_seconds": load_seconds, "runs": []}
    run(llm, 1, min(8, args.prompt_len), 2)  # warm-up: kernels built, caches touched
    for batch in args.batch:
        info["runs"].append(run(llm, batch, args.prompt_len, args.gen_len))
    if args.json:
        print(json.dumps(info))
        return
    print(f"{info['model']} on {info['device']} ({info['dtype']}); CPU: {info['cpu']} "
          f"[{' '.join(info['simd'])}]; loaded in {load_seconds:.2f}s")
    print(f"{'batch':>5} {'prompt':>6} {'gen':>4} {'decode tok/s':>12} {'total tok/s':>11} "
          f"{'peak RSS':>9}")
    for r in info["runs"]:
        print(f"{r['batch']:5d} {r['prompt_len']:6d} {r['gen_len']:4d} {r['decode_tok_s']:12.1f} "
              f"{r['total_tok_s']:11.1f} {r['peak_rss_mb']:7.0f}MB")
    sys.stdout.flush()


def add_parser(sub) -> None:
    from tiergen.cli import _add_model_options

    p = sub.add_parser("bench", help="measure throughput on this machine, batch size by batch size",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32],
                   help="batch sizes to run (default: 1 32)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default: 128)")
    p.add_argument("--gen-len", type=int, default=64, help="new tokens per prompt (default: 64)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    _add_model_options(p)
    p.set_defaults(func=cmd_bench)
