"""How close the cost model's predictions come on an idle machine, without the page-cache
eviction that ``bench_plan.py`` runs: predicted against measured decode tokens/s for a few
policies on SmolLM2-135M (bfloat16), prompt 64, 32 new tokens. Uses the cached calibration
(run ``tiergen calibrate`` first). --prefill: predicted against measured prefill tokens/s
of the packaged GGUF models on the integer path (one 4,096-token prompt; 32 of 128), with the
calibration's rates of a long prompt on AMX tiles (products, packed-amx-, and a prompt's
attention, prompt_attention) and without them.

    python benchmarks/bench_predict.py [--prefill]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)

import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.planner import calibrate
from tiergen.planner.cost import PlacedWeights, Workload, estimate
from tiergen.planner.search import policy_flags
from tiergen.weights import open_model


def prefill() -> None:
    cal = calibrate.get("cpu")
    products = dataclasses.replace(cal, prompt_attention={})
    plain = dataclasses.replace(products, linear_rows={
        k: t for k, t in cal.linear_rows.items() if not k.startswith("packed-amx-")})
    print("| model | prompts | measured tok/s | predicted: the tiles' products and attention "
          "| their products only | neither |")
    print("|---|---|---:|---:|---:|---:|")
    for model in ("smollm2", "gemma3-270m"):
        llm, files = LLM(model), open_model(model)
        placed = PlacedWeights.make(files.config, torch.float32, Policy(), "cpu",
                                    source=files.source)
        llm.generate([list(range(100, 400))], SamplingParams(max_tokens=1))  # warm-up
        for length, batch in ((4096, 1), (128, 32)):
            work = Workload(length, 1, batch)
            predicted = [estimate(files.config, torch.float32, Policy(), work, c,
                                  placed=placed).prefill_tok_s for c in (cal, products, plain)]
            ids = torch.randint(100, 40000, (batch, length),
                                generator=torch.Generator().manual_seed(0)).tolist()
            start = time.perf_counter()
            llm.generate(ids, SamplingParams(max_tokens=1, temperature=0))
            measured = batch * length / (time.perf_counter() - start)
            print(f"| {model} | {batch} x {length} | {measured:.0f} | "
                  + " | ".join(f"{p:.0f}" for p in predicted) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="store_true")
    if p.parse_args().prefill:
        return prefill()
    cal = calibrate.get("cpu")
    offload = tempfile.mkdtemp(prefix="tiergen-bench-predict-")
    prompts = torch.randint(100, 40000, (32, 64), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    cases = [(Policy(), 1), (Policy(), 32), (Policy(weights=(0, 0), offload_dir=offload), 32),
             (Policy(weights=(0, 0), gpu_batch_size=8, num_gpu_batches=4, offload_dir=offload), 32),
             (Policy(compress_weights=True), 32), (Policy(compress_cache=True), 32)]
    print("| policy | batch | decode tok/s predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|")
    for policy, batch in cases:
        llm = LLM("smollm2", dtype="bfloat16", policy=policy)
        e = estimate(llm.config, torch.bfloat16, policy, Workload(64, 32, batch), cal)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))
        llm.generate(prompts[:batch], params)
        s = llm.last_stats
        measured = s.decode_tokens / s.decode_seconds
        print(f"| `{policy_flags(policy)}` | {batch} | {e.decode_tok_s:.1f} | {measured:.1f} | "
              f"{measured / e.decode_tok_s:.2f} |", flush=True)
    shutil.rmtree(offload, ignore_errors=True)


if __name__ == "__main__":
    main()
