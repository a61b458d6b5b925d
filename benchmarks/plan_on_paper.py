"""Predicted throughput of models that cannot run here, on machines that are not here:
``tiergen plan --config MODEL --machine PROFILE`` for each shipped model config and machine
profile, printed as a markdown table (the plan's flags, memory per tier and predicted
generated tokens/s, with and without compression).

The workload defaults to FlexGen's published benchmark (prompts of 512 tokens, 32 generated,
effective batch up to 256), whose figures docs/BENCHMARKS-HISTORY.md puts beside these predictions.

    python benchmarks/plan_on_paper.py [--machines t4-flexgen,gpu-24g-workstation]
        [--models llama-3.1-70b,...] [--prompt-len 512] [--gen-len 32] [--batch 256]
"""

from __future__ import annotations

import argparse

import tiergen  # noqa: F401  (the CPU guard first)
from tiergen.offload.memory import Budgets, fmt
from tiergen.planner import paper
from tiergen.planner.cost import Workload
from tiergen.planner.search import choose_policy, policy_flags


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machines", default="t4-flexgen,gpu-24g-workstation")
    p.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b,qwen2.5-72b,mixtral-8x22b,"
                                       "deepseek-v2")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    work = Workload(a.prompt_len, a.gen_len, a.batch)
    print(f"{a.batch} prompts of {a.prompt_len} tokens, {a.gen_len} generated each\n")
    print("| machine | model | dtype | compression | plan | device / host / disk | "
          "predicted tok/s |")
    print("|---|---|---|---|---|---|---|")
    for m in map(paper.load_machine, a.machines.split(",")):
        budgets = Budgets(m.budgets.device, m.budgets.host)
        for name in a.models.split(","):
            cfg, ckpt = paper.load_config(name)
            dtype = paper.default_dtype(m.calibration, ckpt)
            for compress in (False, True):
                try:
                    policy, e = choose_policy(cfg, dtype, work, m.calibration,
                                              m.calibration.device_type, budgets,
                                              allow_compression=compress)
                except tiergen.TiergenError as err:
                    print(f"| {m.name} | {name} | | {'allowed' if compress else 'no'} | "
                          f"nothing fits: {err} | | |")
                    continue
                mem = " / ".join(fmt(e.memory[t]) for t in ("device", "host", "disk"))
                print(f"| {m.name} | {name} | {str(dtype).removeprefix('torch.')} | "
                      f"{'allowed' if compress else 'no'} | `{policy_flags(policy)}` | {mem} | "
                      f"{e.total_tok_s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
