"""Pipeline and tensor parallelism on one machine: 2 processes, each with its share of the
model (a span of layers, or a slice of every layer) and of the cores, against one process
with all of them.

1. Efficiency (weights in RAM): ``tiergen bench`` on SmolLM2 (packed Q4_1) at batch 1 and
   at one larger batch size, one process with every core against ``--pipeline-parallel 2``
   and ``--tensor-parallel 2`` (one core per rank).
2. A model over one rank's host budget (Llama-3.2-1B's shapes, random bfloat16 weights,
   benchmarks/scale_model.py): one process under ``--host-memory`` streams its layers from
   disk while a thread keeps evicting the checkpoint from the page cache; two ranks under
   the same budget (pipeline stages or tensor shards) each hold their half in RAM.

Each configuration runs in a fresh process; the table gives generated tokens/s (prefill
included), decode tokens/s, the ratio to the one-process run, and peak RSS per rank.

    python benchmarks/bench_pipeline.py [--dir /var/tmp/tiergen-scale] [--host-memory 2G]
        [--batch 32] [--big-batches 4 32] [--parts 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def status(pid: int | str, key: str) -> int:
    """A byte count from /proc/<pid>/status (kB fields) or /proc/<pid>/io."""
    if key == "read_bytes":
        text = Path(f"/proc/{pid}/io").read_text()
        return next(int(line.split()[1]) for line in text.splitlines() if line.startswith(key))
    text = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith(key))


def child(a: argparse.Namespace) -> dict:
    """One run of the big model in this process (and its ranks)."""
    import tiergen  # noqa: F401  (the CPU guard first)
    from tiergen import LLM, Policy, SamplingParams
    from bench_scale import prompts

    policy = Policy(weights=(0, 0), offload_dir=str(Path(a.dir) / "offload-pipeline"))
    t = time.perf_counter()
    llm = LLM(a.model, dtype="bfloat16", host_memory=a.host_memory,
              policy=policy if a.ranks * a.tensor == 1 else Policy(), pipeline_parallel=a.ranks,
              tensor_parallel=a.tensor)
    load = time.perf_counter() - t
    pids = ["self"] + [p.pid for p in (llm.group.workers if llm.group else [])]
    before = sum(status(p, "read_bytes") for p in pids)
    ids = prompts(a.batch, a.prompt_len, llm.config.vocab_size)
    t = time.perf_counter()
    out = llm.generate(ids, SamplingParams(max_tokens=a.gen_len, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - t
    result = dict(tok_s=a.batch * a.gen_len / seconds, load_s=load,
                  read_per_step=(sum(status(p, "read_bytes") for p in pids) - before) / a.gen_len,
                  rss=[status(p, "VmHWM") for p in pids], tokens=[r.token_ids for r in out[:2]])
    llm.close()
    return result


def predict(model: str, dtype: str, batch: int, prompt_len: int, gen_len: int, stages: int,
            tensor: int, policy, host_memory: str | None = None) -> float:
    """``tiergen plan``'s predicted generated tokens/s (prefill included) of a run."""
    import torch

    from tiergen.devices import resolve_dtype
    from tiergen.offload.memory import Budgets
    from tiergen.offload.policy import parse_size
    from tiergen.planner import calibrate
    from tiergen.planner.cost import Workload
    from tiergen.planner.parallel import plan_parallel, with_link
    from tiergen.weights import open_model

    files = open_model(model)
    cal = with_link(calibrate.get("cpu"))
    budgets = Budgets(None, host_memory and parse_size(host_memory))
    e = plan_parallel(files.config, resolve_dtype(dtype, torch.device("cpu"),
                                                   files.default_dtype),
                      Workload(prompt_len, gen_len, batch), cal, budgets, stages, tensor, policy,
                      source=files.source)
    return e.total_tok_s


def bench(args: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "tiergen.cli", "bench", "--json", *args],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/var/tmp/tiergen-scale")
    p.add_argument("--host-memory", default="2G")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--big-batches", type=int, nargs="+", default=[4, 32])
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                   help="which of the two measurements above to run (default: both)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--tensor", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return

    from bench_scale import machine

    print(machine())
    if 1 in a.parts:
        efficiency(a.batch)
    if 2 in a.parts:
        over_budget(a)


def efficiency(big_batch: int) -> None:
    from tiergen import Policy

    print("\n1. SmolLM2 (Q4_1 packed), weights in RAM: 128-token prompts, 64 new tokens")
    print("| run | batch | decode tok/s | total tok/s | vs one process (total) | predicted "
          "total tok/s | measured / predicted |")
    print("|---|---|---|---|---|---|---|")
    for batch in (1, big_batch):
        base = None
        for name, stages, tensor in [("1 process x 2 threads", 1, 1),
                                     ("2 pipeline ranks x 1 thread", 2, 1),
                                     ("2 tensor ranks x 1 thread", 1, 2)]:
            r = bench(["--batch", str(batch), "--pipeline-parallel", str(stages),
                       "--tensor-parallel", str(tensor)])["runs"][0]
            base = base or r["total_tok_s"]
            guess = predict("smollm2", "auto", batch, 128, 64, stages, tensor, Policy())
            print(f"| {name} | {batch} | {r['decode_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
                  f"{r['total_tok_s'] / base:.0%} | {guess:.1f} | "
                  f"{r['total_tok_s'] / guess:.2f} |", flush=True)


def over_budget(a: argparse.Namespace) -> None:
    import scale_model
    from bench_plan import PageCacheEvictor
    from tiergen import Policy
    from tiergen.planner.calibrate.storage import measure_disk

    a.dir = str(Path(a.dir).resolve())
    paths = scale_model.build(Path(a.dir) / "llama-3.2-1b", scale_model.SHAPES["llama-3.2-1b"],
                              qtypes=())
    hf = paths["hf"]
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    disk = measure_disk(Path(a.dir), 2**30)
    print(f"\n2. Llama-3.2-1B-shaped, bfloat16, {size / 1e9:.2f} GB; host budget {a.host_memory} "
          f"per rank; {a.prompt_len}-token prompts, {a.gen_len} new; page cache evicted; disk "
          f"read {disk / 1e9:.2f} GB/s")
    print("| run | batch | tok/s | vs one process | GB read/step | peak RSS per rank GB | load s "
          "| predicted tok/s | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch in a.big_batches:
        base, tokens = None, None
        for ranks, tensor, name in [(1, 1, "1 process, weights on disk"),
                                    (2, 1, "2 pipeline ranks, weights in RAM"),
                                    (1, 2, "2 tensor ranks, weights in RAM")]:
            cmd = [sys.executable, str(HERE / "bench_pipeline.py"), "--child", "--model", str(hf),
                   "--ranks", str(ranks), "--tensor", str(tensor), "--dir", a.dir, "--host-memory", a.host_memory,
                   "--batch", str(batch), "--prompt-len", str(a.prompt_len),
                   "--gen-len", str(a.gen_len)]
            env = dict(os.environ, PYTHONPATH=str(HERE.parent))
            with PageCacheEvictor(Path(a.dir), period=0.2):
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                print(f"| {name} | {batch} | failed: {done.stderr.strip().splitlines()[-1]} ||||")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            base, tokens = base or r["tok_s"], tokens or r["tokens"]
            same = "" if r["tokens"] == tokens else " (tokens differ!)"
            guess = predict(str(hf), "bfloat16", batch, a.prompt_len, a.gen_len, ranks, tensor,
                            Policy(weights=(0, 0)) if ranks * tensor == 1 else Policy(),
                            a.host_memory)
            print(f"| {name}{same} | {batch} | {r['tok_s']:.2f} | {r['tok_s'] / base:.2f}x | "
                  f"{r['read_per_step'] / 1e9:.2f} | "
                  f"{' + '.join(f'{x / 1e9:.2f}' for x in r['rss'])} | {r['load_s']:.1f} | "
                  f"{guess:.2f} | {r['tok_s'] / guess:.2f} |", flush=True)


if __name__ == "__main__":
    main()
