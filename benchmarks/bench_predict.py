"""How close the cost model's predictions come on an idle machine, without the page-cache
eviction that ``bench_plan.py`` runs: predicted against measured decode tokens/s for a few
policies on SmolLM2-135M (bfloat16), prompt 64, 32 new tokens. Uses the cached calibration
(run ``tiergen calibrate`` first).

    python benchmarks/bench_predict.py
"""

from __future__ import annotations

import shutil
import tempfile

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)

import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.planner import calibrate
from tiergen.planner.cost import Workload, estimate
from tiergen.planner.search import policy_flags


def main() -> None:
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
