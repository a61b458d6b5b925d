"""Where a generate call's time goes: the packed products and the fused decode layers (each
timed around its call) and the torch operations (torch's profiler), for one batch of random
prompts.

    python benchmarks/profile_generate.py                          # batch 1 decode: 128 + 64
    python benchmarks/profile_generate.py --prompt-len 4096 --gen-len 1   # a long prefill
    python benchmarks/profile_generate.py --model DIR --batch 32 --split  # a Llama-family
        model's decode step by the family's calls (a generate of 1 token subtracted)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import tiergen.kernels as K
import tiergen.models.layers as layers
from tiergen import LLM, SamplingParams
from tiergen.bench import cpu_description


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--rows", type=int, default=10, help="rows of the profiler's table")
    p.add_argument("--split", action="store_true")
    a = p.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})")
    llm = LLM(a.model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, llm.config.vocab_size, (a.batch, a.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=a.gen_len, temperature=0, ignore_eos=True)
    llm.generate(ids, params)  # warm-up
    if a.split:
        return split(llm, ids, a.gen_len)

    spent = {"prefill": 0.0, "decode": 0.0, "fused": 0.0, "attention": 0.0, "glu": 0.0}
    packed_linear, rounded_linear, run_steps, amx_attention, amx_glu = (
        K.packed_linear, K.rounded_linear, layers.run_steps, K.amx_attention, K.amx_glu)
    inside = [False]  # (packed_linear calls rounded_linear: each product timed once)

    def product(call):
        def timed(x, *args, **kw):
            if inside[0]:
                return call(x, *args, **kw)
            inside[0], t = True, time.perf_counter()
            try:
                return call(x, *args, **kw)
            finally:  # x is (batch, new tokens, features): one new token is a decode step
                inside[0] = False
                spent["decode" if x.dim() == 3 and x.shape[1] == 1 else "prefill"] += \
                    time.perf_counter() - t
        return timed

    def adding(call, key):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return call(*args, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        return timed

    K.packed_linear, K.rounded_linear = product(packed_linear), product(rounded_linear)
    layers.run_steps = adding(run_steps, "fused")
    K.amx_attention = adding(amx_attention, "attention")
    K.amx_glu = adding(amx_glu, "glu")
    t = time.perf_counter()
    llm.generate(ids, params)
    total = time.perf_counter() - t
    s = llm.last_stats
    print(f"generate: {total:.3f} s, of which packed products with more than one new token "
          f"(prompts) {spent['prefill']:.3f} s, gate and up in one pass on AMX tiles "
          f"(kernels.amx_glu) {spent['glu']:.3f} s, attention on AMX tiles "
          f"(kernels.amx_attention) {spent['attention']:.3f} s")
    if a.gen_len > 1:
        steps = a.gen_len - 1
        print(f"per decode step: {s.decode_seconds / steps * 1e3:.1f} ms, of which packed "
              f"products {spent['decode'] / steps * 1e3:.1f} ms and whole layers in one call "
              f"(kernels/layer.c: their products included) {spent['fused'] / steps * 1e3:.1f} ms")
    K.packed_linear, K.rounded_linear = packed_linear, rounded_linear
    layers.run_steps, K.amx_attention, K.amx_glu = run_steps, amx_attention, amx_glu
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(ids, params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))


def split(llm: LLM, ids: list[list[int]], gen_len: int) -> None:
    """Milliseconds a decode step spends in a Llama-family layer and its parts (each timed
    around its call; attention with the cache's writes), and in the head: a generate of
    ``gen_len`` tokens less one of a single token, over ``gen_len - 1`` steps."""
    import tiergen.cache.kv as kv
    import tiergen.models.llama as llama

    spent: dict[str, float] = {}
    patched = [(llama.Llama, "layer"), (llama.Llama, "head"), (llama, "linear"),
               (llama, "ffn"), (llama, "apply_rope"), (llama, "rms_norm"), (kv, "attention")]
    for owner, name in patched:
        def timed(*args, _f=getattr(owner, name), _n=name, **kw):
            t = time.perf_counter()
            try:
                return _f(*args, **kw)
            finally:
                spent[_n] = spent.get(_n, 0.0) + time.perf_counter() - t
        setattr(owner, name, timed)

    def run(n: int) -> dict[str, float]:
        spent.clear()
        llm.generate(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return dict(spent)

    one, many = run(1), run(gen_len)
    for name, total in many.items():
        print(f"{name}: {(total - one.get(name, 0.0)) / (gen_len - 1) * 1e3:.1f} ms a decode step")


if __name__ == "__main__":
    main()
