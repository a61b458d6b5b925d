"""Weights on disk under a host budget smaller than the model, against the same model all in
RAM and against Hugging Face accelerate's disk offload, on the same prompts.

SmolLM2-135M (bfloat16), prompt 128 tokens, 32 new tokens, greedy. Every configuration runs in
a fresh process so that its peak resident memory is its own. Also sweeps the block size
(sequences sharing one trip of each layer's weights) and plots throughput against it.

    python benchmarks/bench_offload.py [--budget 96M] [--blocks 8 16 32 64 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen.offload.memory import resident_set  # peak RSS of this process alone (VmHWM)

from plot import throughput_plot

PROMPT_LEN, NEW_TOKENS = 128, 32
HERE = Path(__file__).resolve().parent


def prompts(n: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (n, PROMPT_LEN), generator=g).tolist()


def run_tiergen(model: str, n: int, block: int, disk: bool, budget: str, offload: str,
                compress: bool = False) -> float:
    from tiergen import LLM, Policy, SamplingParams

    micro = min(block, 32)
    policy = Policy(weights=(0, 0) if disk else (100, 0), gpu_batch_size=micro,
                    num_gpu_batches=block // micro, offload_dir=offload,
                    compress_weights=compress, compress_cache=compress)
    llm = LLM(model, dtype="bfloat16", policy=policy, host_memory=budget if disk else None)
    ps = prompts(n, llm.config.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(ps[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    t = time.perf_counter()
    llm.generate(ps, params)
    seconds = time.perf_counter() - t
    print(llm.last_stats.report(), file=sys.stderr)
    return seconds


def run_accelerate(model: str, n: int, budget: str, offload: str) -> float:
    import torch
    import transformers

    from tiergen.offload.policy import parse_size

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.bfloat16, device_map="auto", offload_folder=offload,
        max_memory={"cpu": parse_size(budget)})
    ids = torch.tensor(prompts(n, hf.config.vocab_size))
    with torch.inference_mode():
        hf.generate(input_ids=ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2,
                    do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t


def make_hf_copy(directory: Path) -> None:
    """The packaged SmolLM2 GGUF as a Hugging Face directory, so that every engine reads the
    same safetensors."""
    import transformers

    from tiergen.weights import _packaged_file

    gguf = _packaged_file("smollm2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig.from_dict(config))
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(directory)


def child(argv: list[str]) -> None:
    engine, model, n, block, budget, offload = argv
    if engine == "accelerate":
        seconds = run_accelerate(model, int(n), budget, offload)
    else:
        seconds = run_tiergen(model, int(n), int(block), engine.startswith("tiergen-disk"),
                              budget, offload, compress=engine == "tiergen-disk-4bit")
    print(json.dumps({"seconds": seconds, "tok_s": int(n) * NEW_TOKENS / seconds,
                      "peak_rss_mb": resident_set()[1] / 2**20}))


def measure(engine: str, model: Path, n: int, block: int, budget: str, work: Path) -> dict:
    offload = work / f"offload-{engine}"
    out = subprocess.run([sys.executable, __file__, "--child", engine, str(model), str(n),
                          str(block), budget, str(offload)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{engine} block {block} failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{engine:14s} prompts {n:4d} block {block:4d}: {r['tok_s']:8.1f} tok/s  "
          f"peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    return {"engine": engine, "prompts": n, "block": block, **r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="96M", help="host budget for the disk runs (model: 270 MB)")
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--plot", default=str(HERE.parent / "docs" / "bench_offload.png"))
    p.add_argument("--child", nargs=6)
    p.add_argument("--compression", action="store_true",
                   help="only compare weights on disk with and without 4-bit weights and cache")
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    if args.compression:
        compression(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "smollm2-hf"
        make_hf_copy(model)
        rows = [measure("tiergen-ram", model, args.prompts, 64, args.budget, work),
                measure("tiergen-disk", model, args.prompts, 64, args.budget, work),
                measure("accelerate", model, args.prompts, args.prompts, args.budget, work)]
        sweep = []
        for block in args.blocks:
            n = max(block, args.prompts)
            sweep += [measure("tiergen-ram", model, n, block, args.budget, work),
                      measure("tiergen-disk", model, n, block, args.budget, work)]
    ram, dsk, acc = (r["tok_s"] for r in rows)
    print(f"\nbatch {args.prompts}, host budget {args.budget}: tiergen disk {dsk:.1f} tok/s = "
          f"{dsk / acc:.1f}x accelerate ({acc:.2f} tok/s), {100 * dsk / ram:.0f}% of tiergen in RAM "
          f"({ram:.1f} tok/s)")
    print("\n| block | tiergen in RAM tok/s | tiergen weights on disk tok/s | disk / RAM |")
    print("|---|---|---|---|")
    for block in args.blocks:
        r, d = (next(x for x in sweep if x["block"] == block and x["engine"] == e)
                for e in ("tiergen-ram", "tiergen-disk"))
        print(f"| {block} | {r['tok_s']:.1f} | {d['tok_s']:.1f} | {100 * d['tok_s'] / r['tok_s']:.0f}% |")
    print(json.dumps({"rows": rows, "sweep": sweep}))

    def tok_s(engine: str, block: int) -> float:
        return next(x["tok_s"] for x in sweep if x["block"] == block and x["engine"] == engine)

    throughput_plot(
        args.plot, args.blocks,
        {"all weights in RAM": ([tok_s("tiergen-ram", b) for b in args.blocks], "-"),
         f"weights on disk, host budget {args.budget}": ([tok_s("tiergen-disk", b) for b in args.blocks], "-")},
        "block size (sequences per trip of the weights)",
        f"SmolLM2-135M bf16, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, 2 CPU cores",
        hline=(acc, f"accelerate disk offload (batch {args.prompts})"))

def compression(args: argparse.Namespace) -> None:
    """Weights on disk under the host budget, plain against 4-bit weights and KV cache."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = work / "smollm2-hf"
        make_hf_copy(model)
        print("\n| block | weights on disk tok/s | 4-bit weights and cache on disk tok/s | ratio |")
        print("|---|---|---|---|")
        for block in args.blocks:
            n = max(block, args.prompts)
            plain = measure("tiergen-disk", model, n, block, args.budget, work)["tok_s"]
            packed = measure("tiergen-disk-4bit", model, n, block, args.budget, work)["tok_s"]
            print(f"| {block} | {plain:.1f} | {packed:.1f} | {packed / plain:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
