"""``tiergen bench``: throughput of a model and policy on this machine, batch size by batch size.

The protocol: ``batch`` prompts of ``prompt_len`` token ids each, ``gen_len`` greedy new tokens
each (EOS ignored), one warm-up run, then one timed run per batch size. It reports tokens per
second of decode and of the whole run (prefill included), and the process's peak resident
memory, with the CPU model and its SIMD flags (numbers mean something only next to a peer
measured on the same machine).
"""

from __future__ import annotations

import resource
import time

from tiergen._platform import cpu_flags, cpu_model
from tiergen.engine.sampler import SamplingParams

SIMD_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512bw", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")


def cpu_description() -> dict:
    """CPU model name and the SIMD flags that decide which kernels run fast."""
    flags = cpu_flags()
    return {"cpu": cpu_model(), "simd": [f for f in SIMD_FLAGS if f in flags]}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(llm, batch: int, prompt_len: int, gen_len: int) -> dict:
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
