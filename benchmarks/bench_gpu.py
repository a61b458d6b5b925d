"""On a CUDA GPU: tiergen against transformers with the weights on the GPU, and tiergen's
weights streamed from pinned host RAM against accelerate's CPU offload, on the same checkpoint.

A Llama-3.2-1B-shaped model with random weights (bfloat16, 2.5 GB) is written once as a
safetensors checkpoint. Prompts of 128 random tokens, 32 new tokens, greedy, ignoring EOS.
Each (engine, batch) runs in a fresh process, so that its peak GPU memory is its own:

- ``hf``: transformers ``generate``, every weight on the GPU;
- ``tiergen``: every weight on the GPU;
- ``tiergen-host``: every weight in pinned host RAM, each layer's copied to the GPU while the
  layer before it computes (``Policy(weights=(0, 100))``, micro-batches of 32 sharing a trip);
- ``accelerate``: ``device_map="auto"`` with 1 GiB of GPU memory, so accelerate's hooks move
  the offloaded layers' weights to the GPU at every forward.

Reports generated tokens/s (prefill included), peak GPU memory, and the share of tokens that
agree with transformers (bfloat16 products on a GPU are not exact, so near-ties may differ).

    python benchmarks/bench_gpu.py [--batches 32 64] [--dir /tmp/tiergen-gpu-bench]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN, NEW_TOKENS = 128, 32
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
             max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True)


def build(directory: Path) -> None:
    import torch
    import transformers

    if (directory / "config.json").exists():
        return
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, torch_dtype="bfloat16")
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


def prompts(n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, SHAPE["vocab_size"] - 100, (n, PROMPT_LEN), generator=g).tolist()


def run(engine: str, model: str, n: int) -> tuple[float, list[list[int]]]:
    import torch

    ps = prompts(n)
    if engine in ("hf", "accelerate"):
        import transformers

        kw = (dict(device_map="cuda") if engine == "hf" else
              dict(device_map="auto", max_memory={0: "1GiB", "cpu": "100GiB"}))
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, **kw)
        ids = torch.tensor(ps, device="cuda")
        mask, greedy = torch.ones_like(ids), dict(do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            hf.generate(input_ids=ids[:2], attention_mask=mask[:2], max_new_tokens=2, **greedy)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, **greedy)
            torch.cuda.synchronize()
        return time.perf_counter() - t, out[:, PROMPT_LEN:].tolist()

    from tiergen import LLM, Policy, SamplingParams

    policy = (Policy(weights=(0, 100), gpu_batch_size=min(n, 32), num_gpu_batches=max(1, n // 32))
              if engine == "tiergen-host" else None)
    llm = LLM(model, dtype="bfloat16", device="cuda", policy=policy, max_batch_size=max(64, n))
    llm.generate(ps[:2], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate(ps, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    return time.perf_counter() - t, [r.token_ids for r in res]


def child(engine: str, model: str, n: int) -> None:
    import torch

    seconds, tokens = run(engine, model, n)
    print(json.dumps({"seconds": seconds, "tok_s": n * NEW_TOKENS / seconds, "tokens": tokens,
                      "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    p.add_argument("--engines", default="hf,tiergen,tiergen-host,accelerate")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each, in turns; the median is shown")
    p.add_argument("--dir", default="/tmp/tiergen-gpu-bench")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    import torch

    model = Path(args.dir)
    build(model)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; Llama-3.2-1B shape, "
          f"random bfloat16 weights; prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens", flush=True)
    print("| batch | engine | tok/s, median (each run) | peak GPU MB "
          "| tokens equal to transformers' |")
    print("|---|---|---|---|---|", flush=True)
    engines = args.engines.split(",")
    for n in args.batches:
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for _ in range(args.repeat):
            for engine in engines:
                out = subprocess.run([sys.executable, __file__, "--child", engine, str(model),
                                      str(n)], capture_output=True, text=True)
                if out.returncode:
                    print(f"| {n} | {engine} | failed: {out.stderr.strip()[-1500:]} |", flush=True)
                else:
                    runs[engine].append(json.loads(out.stdout.strip().splitlines()[-1]))
        ref = runs["hf"][0]["tokens"] if runs.get("hf") else None
        for engine, rs in runs.items():
            if not rs:
                continue
            r = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
            equal = None if ref is None else sum(
                a == b for x, y in zip(r["tokens"], ref) for a, b in zip(x, y))
            same = "-" if equal is None else f"{100 * equal / (n * NEW_TOKENS):.1f} %"
            each = ", ".join(f"{x['tok_s']:.0f}" for x in rs)
            print(f"| {n} | {engine} | {r['tok_s']:.1f} ({each}) "
                  f"| {r['peak_gpu_mb']:.0f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
