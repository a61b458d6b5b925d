"""Does the planner choose well, and how close are its predictions?

SmolLM2-135M (bfloat16) under a host budget smaller than its weights (default 60 % of the
bfloat16 weight bytes), so that every plan must put weights on disk or compress them: runs the
policy that ``tiergen plan`` chooses and a hand-made grid of policies that fit the same budget
(weights on device / disk, micro-batch and block sizes, compression), and reports for each the
predicted and the measured throughput and their ratio, then the plan against the grid's best
(target: at least 90 %). Prints a markdown table.

The calibration measures disk reads with the page cache dropped; on a machine with free RAM
the OS would cache the offloaded files and serve later reads from memory, which a machine whose
RAM really is the budget cannot do. So while a policy runs, a thread keeps evicting the offload
directory from the page cache (``--warm-page-cache`` turns that off).

    python benchmarks/bench_plan.py [--prompt-len 64] [--gen-len 32] [--batch 32]
                                    [--budget-fraction 0.6] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen import LLM, Policy, SamplingParams
from tiergen.engine.executor import block_needs
from tiergen.models import build_model
from tiergen.offload.memory import Budgets, fmt
from tiergen.offload.weights import WeightPlan
from tiergen.planner import calibrate
from tiergen.planner.cost import Workload, blocks, estimate
from tiergen.planner.search import choose_policy, over_budget, policy_flags
from tiergen.weights import open_model

import torch


def grid(batch: int) -> list[Policy]:
    """Hand-made policies: disk share of the weights, micro-batch x block, compression."""
    q, h = max(batch // 4, 1), max(batch // 2, 1)
    return [Policy(**kw) for kw in [
        dict(weights=(0, 0), gpu_batch_size=batch),
        dict(weights=(0, 0), gpu_batch_size=h, num_gpu_batches=2),
        dict(weights=(0, 0), gpu_batch_size=q, num_gpu_batches=4),
        dict(weights=(0, 0), gpu_batch_size=q),
        dict(weights=(10, 0), gpu_batch_size=q),
        dict(weights=(20, 0), cache=(0, 0), gpu_batch_size=h, num_gpu_batches=2),
        dict(weights=(0, 0), cache=(0, 0), gpu_batch_size=batch),
        dict(weights=(30, 0), cache=(0, 0), gpu_batch_size=batch),
        dict(weights=(30, 0), cache=(50, 0), gpu_batch_size=h, num_gpu_batches=2),
        dict(weights=(0, 0), gpu_batch_size=batch, compress_weights=True),
        dict(weights=(50, 0), gpu_batch_size=batch, compress_weights=True),
        dict(weights=(100, 0), cache=(0, 0), gpu_batch_size=batch, compress_weights=True),
        dict(weights=(100, 0), gpu_batch_size=h, compress_weights=True, compress_cache=True),
        dict(weights=(100, 0), gpu_batch_size=q, compress_weights=True),
        dict(weights=(100, 0), gpu_batch_size=batch, compress_weights=True, compress_cache=True),
        dict(weights=(0, 0), gpu_batch_size=batch, compress_cache=True),
    ]]


class PageCacheEvictor(threading.Thread):
    """Drops every file under ``root`` from the page cache every ``period`` seconds (files
    are held open between sweeps, and looked for again every ``rescan`` sweeps, so that a
    sweep costs one system call per file)."""

    def __init__(self, root: Path, period: float = 0.05, rescan: int = 20) -> None:
        super().__init__(daemon=True)
        self.root, self.period, self.rescan = root, period, rescan
        self.done = threading.Event()
        self.files: dict[str, int] = {}

    def _scan(self) -> None:
        found = {os.path.join(d, n) for d, _, names in os.walk(self.root) for n in names}
        for path in set(self.files) - found:
            os.close(self.files.pop(path))
        for path in found - set(self.files):
            try:
                self.files[path] = os.open(path, os.O_RDONLY)
            except OSError:
                pass  # a spill file removed meanwhile

    def run(self) -> None:
        sweeps = 0
        while not self.done.wait(self.period):
            if sweeps % self.rescan == 0:
                self._scan()
            sweeps += 1
            for fd in self.files.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def __enter__(self) -> PageCacheEvictor:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join()
        for fd in self.files.values():
            os.close(fd)


def measure(policy: Policy, work: Workload, budget: int, device: str, evict: bool,
            offload: Path) -> dict[str, float]:
    """Generated tokens per second of one policy (decode alone, and prefill + decode)."""
    llm = LLM("smollm2", dtype="bfloat16", device=device, host_memory=budget,
              policy=dataclasses.replace(policy, offload_dir=offload))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, llm.config.vocab_size - 100, (work.batch, work.prompt_len),
                            generator=g).tolist()
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    params = SamplingParams(max_tokens=work.gen_len, temperature=0, ignore_eos=True)
    if evict and hasattr(os, "posix_fadvise"):
        with PageCacheEvictor(offload):
            llm.generate(prompts, params)
    else:
        llm.generate(prompts, params)
    s = llm.last_stats
    out = {"decode": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
           "total": work.batch * work.gen_len / (s.prefill_seconds + s.decode_seconds)}
    del llm
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budget-fraction", type=float, default=0.6,
                   help="host budget as a fraction of the bfloat16 weight bytes (default: 0.6)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--warm-page-cache", action="store_true",
                   help="let the OS cache the offloaded files (disk reads from RAM)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: batch 4, prompt 16, 4 new tokens, the plan and 2 grid policies")
    args = p.parse_args()
    if args.quick:
        args.prompt_len, args.gen_len, args.batch = 16, 4, 4
    work = Workload(args.prompt_len, args.gen_len, args.batch)
    files = open_model("smollm2")
    cfg, dtype, device = files.config, torch.bfloat16, torch.device(args.device)
    model = build_model(cfg)
    weight_bytes = WeightPlan.make(model, dtype, Policy(), device).needs()["device"]
    budget = int(args.budget_fraction * weight_bytes)
    budgets = Budgets(host=budget)
    if calibrate.load(device) is None:
        print(f"note: measuring {device} first (tiergen calibrate)", file=sys.stderr)
    cal = calibrate.get(device, progress=True)
    chosen, _ = choose_policy(cfg, dtype, work, cal, device.type, budgets, model_family=model)

    def fits(policy: Policy) -> bool:
        plan = WeightPlan.make(model, dtype, policy, device)
        rows = blocks(policy, work.batch, 64)[0]
        needs = block_needs(plan, cfg, dtype, policy, [(r, work.prompt_len + work.gen_len)
                                                      for r in rows], work.prompt_len)
        return not over_budget(needs, budgets, device.type)

    candidates = [q for q in grid(work.batch) if fits(q) and q != chosen]
    if args.quick:
        candidates = candidates[:2]
    elif len(candidates) < 12:
        print(f"note: only {len(candidates)} grid policies fit the budget", file=sys.stderr)
    print(f"SmolLM2-135M bfloat16 on {device}: {work.batch} prompts of {work.prompt_len} tokens, "
          f"{work.gen_len} new; host budget {fmt(budget)} ({args.budget_fraction:.0%} of "
          f"{fmt(weight_bytes)} of weights); page cache "
          f"{'warm' if args.warm_page_cache else 'evicted'}",
          file=sys.stderr)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="tiergen-bench-plan-"))
    try:
        for i, policy in enumerate([chosen, *candidates]):
            e = estimate(cfg, dtype, policy, work, cal, device.type)
            m = measure(policy, work, budget, args.device, not args.warm_page_cache,
                        tmp / "offload")
            rows.append((i == 0, policy, e, m))
            print(f"{policy_flags(policy)}: predicted {e.total_tok_s:.1f}, measured "
                  f"{m['total']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| policy | memory device / host / disk | decode tok/s predicted | measured | "
          "measured / predicted | total tok/s predicted | measured | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for is_plan, policy, e, m in rows:
        name = ("**plan** " if is_plan else "") + f"`{policy_flags(policy)}`"
        mem = " / ".join(fmt(e.memory[t]) for t in ("device", "host", "disk"))
        print(f"| {name} | {mem} | {e.decode_tok_s:.1f} | {m['decode']:.1f} | "
              f"{m['decode'] / e.decode_tok_s:.2f} | {e.total_tok_s:.1f} | {m['total']:.1f} | "
              f"{m['total'] / e.total_tok_s:.2f} |")
    best = max(rows, key=lambda r: r[3]["total"])
    share = rows[0][3]["total"] / best[3]["total"]
    print(f"\nThe plan's measured throughput is {share:.0%} of the best measured policy "
          f"(`{policy_flags(best[1])}`, {best[3]['total']:.1f} tok/s); target at least 90 %.")


if __name__ == "__main__":
    main()
