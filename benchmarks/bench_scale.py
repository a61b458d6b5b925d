"""Real scale: an 8B-shaped model (Llama-3.1-8B's shapes, random weights) under a host budget
its weights do not fit, streamed from disk with the page cache evicted.

Builds once (cached in --dir) the model as a bfloat16 safetensors checkpoint and as Q8_0 and
Q4_0 GGUF files (benchmarks/scale_model.py), measures the disk's read rate, then runs each
system in a fresh process while a thread keeps evicting every file under --dir from the page
cache (so reads come from the disk, as on a machine whose RAM really is the budget):

- tiergen, weights on disk, bfloat16 (converted once into its offload directory; the
  conversion is timed on a fresh directory, then the run reuses it);
- tiergen, weights on disk, the Q4_0 GGUF kept packed;
- tiergen --policy auto on the bfloat16 checkpoint under the same budget (the planner's choice,
  and its predicted tokens/s next to the measured), and the same on the Q4_0 GGUF
  (tiergen-q4-auto): what a user who gives tiergen the budget gets, where the runs above put
  every weight on disk whatever the budget;
- accelerate's disk offload (transformers, device_map="auto" with max_memory = the budget);
- llama.cpp on the Q4_0 GGUF (llama-cpp-python from ../shared/peers/build_llamacpp.sh), which
  maps the whole file and decodes one prompt at a time: it runs one prompt (batch 1).

Reported per run: generated tokens/s (prefill included), seconds per decode step, bytes read
from storage per step (/proc/self/io), the bound that bytes over the measured disk
rate sets, peak RSS, and load or conversion time.

    python benchmarks/bench_scale.py [--dir /var/tmp/tiergen-scale] [--host-memory 6G]
        [--batch 32] [--prompt-len 16] [--gen-len 8] [--runs tiergen-bf16,tiergen-q4,...]
        [--llamacpp-python .peers/llamacpp-venv/bin/python] [--shape llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = ["tiergen-bf16", "tiergen-q4", "tiergen-auto", "tiergen-q4-auto", "accelerate",
        "llamacpp"]


def rss_peak() -> int:
    """Peak resident bytes of this process (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def read_bytes() -> int:
    """Bytes this process (all its threads) caused to be read from storage."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(300, vocab) for _ in range(length)] for _ in range(batch)]


# ----------------------------------------------------------------------------- children


def child_tiergen(a: argparse.Namespace, paths: dict[str, str]) -> dict:
    import tiergen  # noqa: F401  (the CPU guard first)
    from tiergen import LLM, Policy, SamplingParams
    from tiergen.weights import open_model

    offload = Path(a.dir) / f"offload-{a.child}"
    packed = a.child.startswith("tiergen-q4")
    t = time.perf_counter()
    files = open_model(paths["Q4_0"] if packed else paths["hf"])
    opened = time.perf_counter() - t
    dtype = "float32" if packed else "bfloat16"
    result: dict = {}
    if a.child.endswith("-auto"):
        import torch

        from tiergen.offload.memory import Budgets
        from tiergen.offload.policy import parse_size
        from tiergen.planner import calibrate
        from tiergen.planner.cost import Workload
        from tiergen.planner.search import choose_policy, policy_flags

        policy, e = choose_policy(files.config, getattr(torch, dtype),
                                  Workload(a.prompt_len, a.gen_len, a.batch),
                                  calibrate.get("cpu"), "cpu", Budgets(host=parse_size(a.host_memory)),
                                  source=files.source)
        result.update(plan=policy_flags(policy), predicted_tok_s=e.total_tok_s,
                      predicted_step_s=e.decode_seconds / max(a.gen_len - 1, 1))
    else:
        policy = Policy(weights=(0, 0))
    policy.offload_dir = str(offload)
    t = time.perf_counter()
    llm = LLM(files, dtype=dtype, policy=policy, host_memory=a.host_memory)
    result["load_s"] = opened + time.perf_counter() - t
    ids = prompts(a.batch, a.prompt_len, llm.config.vocab_size)
    before = read_bytes()
    t = time.perf_counter()
    out = llm.generate(ids, SamplingParams(max_tokens=a.gen_len, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - t
    s = llm.last_stats
    result.update(tok_s=a.batch * a.gen_len / seconds, seconds=seconds,
                  prefill_s=s.prefill_seconds, step_s=s.decode_seconds / max(a.gen_len - 1, 1),
                  read_per_step=(read_bytes() - before) / a.gen_len, rss=rss_peak(),
                  tokens=[r.token_ids for r in out[:2]], batch=a.batch,
                  compute_s=sum(s.compute), wait_weights_s=sum(s.wait_weights))
    return result


def child_accelerate(a: argparse.Namespace, paths: dict[str, str]) -> dict:
    import torch
    import transformers

    from tiergen.offload.policy import parse_size

    class Clock(transformers.LogitsProcessor):
        """Timestamps of each step (called once per generated token)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    offload = Path(a.dir) / "offload-accelerate"
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        paths["hf"], dtype=torch.bfloat16, device_map="auto",
        max_memory={"cpu": parse_size(a.host_memory)}, offload_folder=str(offload))
    load = time.perf_counter() - t
    ids = torch.tensor(prompts(a.batch, a.prompt_len, model.config.vocab_size))
    clock = Clock()
    before = read_bytes()
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.gen_len,
                             min_new_tokens=a.gen_len, do_sample=False,
                             logits_processor=[clock], pad_token_id=0)
    seconds = time.perf_counter() - t
    return dict(load_s=load, tok_s=a.batch * a.gen_len / seconds, seconds=seconds,
                prefill_s=clock.times[0] - t,
                step_s=(clock.times[-1] - clock.times[0]) / max(len(clock.times) - 1, 1),
                read_per_step=(read_bytes() - before) / a.gen_len, rss=rss_peak(),
                tokens=out[:2, ids.shape[1]:].tolist(), batch=a.batch)


def child_llamacpp(a: argparse.Namespace, paths: dict[str, str]) -> dict:
    import llama_cpp

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=paths["Q4_0"], n_ctx=a.prompt_len + a.gen_len + 8,
                          n_threads=os.cpu_count(), n_batch=512, verbose=False)
    load = time.perf_counter() - t
    ids = prompts(1, a.prompt_len, llm.n_vocab())[0]
    before = read_bytes()
    t = time.perf_counter()
    llm.eval(ids)
    times, tokens = [time.perf_counter()], []
    for _ in range(a.gen_len):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        tokens.append(tok)
        if len(tokens) < a.gen_len:
            llm.eval([tok])
        times.append(time.perf_counter())
    seconds = time.perf_counter() - t
    return dict(load_s=load, tok_s=a.gen_len / seconds, seconds=seconds, prefill_s=times[0] - t,
                step_s=(times[-2] - times[0]) / max(a.gen_len - 1, 1),
                read_per_step=(read_bytes() - before) / a.gen_len, rss=rss_peak(),
                tokens=[tokens], batch=1)


# ----------------------------------------------------------------------------- parent


def machine() -> str:
    from tiergen.bench import cpu_description

    cpu = cpu_description()
    return (f"{cpu['cpu']} ({' '.join(cpu['simd'])}), {os.cpu_count()} cores, "
            f"{platform.python_version()}")


def run_child(a: argparse.Namespace, name: str, paths: dict[str, Path]) -> dict:
    from bench_plan import PageCacheEvictor  # not at the top: llama.cpp's child has no torch

    python = a.llamacpp_python if name == "llamacpp" else sys.executable
    cmd = [python, str(HERE / "bench_scale.py"), "--child", name, "--dir", a.dir,
           "--host-memory", a.host_memory, "--batch", str(a.batch), "--prompt-len",
           str(a.prompt_len), "--gen-len", str(a.gen_len), "--paths",
           json.dumps({k: str(v) for k, v in paths.items()})]
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    with PageCacheEvictor(Path(a.dir), period=0.2):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip()
                else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def convert_time(a: argparse.Namespace, paths: dict[str, Path], name: str) -> float:
    """Seconds tiergen takes to load a checkpoint with a fresh offload directory (converting
    into it where the weights cannot be read in place)."""
    shutil.rmtree(Path(a.dir) / f"offload-{name}", ignore_errors=True)
    r = run_child(a, name + "-convert", paths)
    if "error" in r:
        raise SystemExit(f"{name}: loading failed: {r['error']}")
    return r["load_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/var/tmp/tiergen-scale")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--host-memory", default="6G")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--qtypes", default="Q8_0,Q4_0",
                   help="GGUF files to build beside the checkpoint (the runs use Q4_0)")
    p.add_argument("--llamacpp-python", default=".peers/llamacpp-venv/bin/python")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--paths", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        paths = json.loads(a.paths)
        kind = a.child.removesuffix("-convert")
        if a.child.endswith("-convert"):  # load only: the conversion into a fresh directory
            a.child, a.gen_len, a.batch = kind, 1, 1
        fn = {"accelerate": child_accelerate, "llamacpp": child_llamacpp}.get(kind, child_tiergen)
        print(json.dumps(fn(a, paths)))
        return

    import scale_model
    from tiergen.planner.calibrate.storage import measure_disk

    a.dir = str(Path(a.dir).resolve())
    t = time.perf_counter()
    qtypes = tuple(a.qtypes.split(","))
    paths = scale_model.build(Path(a.dir) / a.shape, scale_model.SHAPES[a.shape], qtypes=qtypes)
    print(f"checkpoint ready in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    disk = measure_disk(Path(a.dir), 2**30)
    hf_bytes = sum(f.stat().st_size for f in paths["hf"].glob("*.safetensors"))
    print(f"{machine()}; disk read {disk / 1e9:.2f} GB/s; host budget {a.host_memory}; "
          f"{a.batch} prompts x {a.prompt_len} tokens, {a.gen_len} new; page cache evicted")
    print(f"checkpoint: {hf_bytes / 1e9:.1f} GB bfloat16 safetensors, "
          + ", ".join(f"{q} {paths[q].stat().st_size / 1e9:.1f} GB" for q in qtypes))
    print("| run | batch | tok/s | s/decode step | GB read/step | bound s/step (bytes/disk) "
          "| step vs bound | peak RSS GB | load s |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    for name in a.runs.split(","):
        if name in ("tiergen-bf16", "tiergen-q4"):
            size = hf_bytes if name == "tiergen-bf16" else paths["Q4_0"].stat().st_size
            print(f"{name}: load with a fresh offload directory (converting into it unless read "
                  f"in place) {convert_time(a, paths, name):.1f} s; reading the checkpoint once "
                  f"at the disk rate: {size / disk:.1f} s", file=sys.stderr, flush=True)
        r = results[name] = run_child(a, name, paths)
        if "error" in r:
            print(f"| {name} | failed: {r['error']} |||||||")
            continue
        bound = r["read_per_step"] / disk
        extra = f" (plan {r['plan']}, predicted {r['predicted_tok_s']:.2f} tok/s)" if "plan" in r else ""
        print(f"| {name}{extra} | {r['batch']} | {r['tok_s']:.2f} | {r['step_s']:.1f} | "
              f"{r['read_per_step'] / 1e9:.2f} | {bound:.1f} | {bound / r['step_s']:.0%} | "
              f"{r['rss'] / 1e9:.2f} | {r['load_s']:.1f} |", flush=True)
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
