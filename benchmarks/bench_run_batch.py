"""`tiergen run-batch` against `LLM.generate` on the same requests, same process, same run.

--requests completion requests in OpenAI's batch format (prompts of random token ids of 16 to
--prompt-len tokens, --new-tokens greedy tokens each, EOS ignored) run through the batch
runner (`tiergen.batch.run_batch`: validation, grouping by length, a synced write of every
group's results) and then through `LLM.generate` on the same prompts and parameters, the
model loaded once for both. Reports generated tokens/s of each and the ratio.

    python benchmarks/bench_run_batch.py [--model smollm2] [--requests 1000] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen import LLM, SamplingParams
from tiergen.batch import read_input, run_batch
from tiergen.bench import cpu_description


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})")
    llm = LLM(args.model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, args.prompt_len + 1, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(100, llm.config.vocab_size - 100, (n,), generator=g).tolist()
               for n in lengths]
    body = {"model": args.model, "max_tokens": args.new_tokens, "temperature": 0,
            "ignore_eos": True}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        requests, output = Path(tmp) / "requests.jsonl", Path(tmp) / "results.jsonl"
        requests.write_text("".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                        "body": {**body, "prompt": p}}) + "\n" for i, p in enumerate(prompts)))
        t = time.perf_counter()
        summary = run_batch(llm, read_input(requests), output, model_names=[args.model],
                            progress=False)
        batch_s = time.perf_counter() - t
        assert summary.ok == args.requests, summary
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    generate_s = time.perf_counter() - t
    tokens = sum(r.num_generated_tokens for r in results)
    assert tokens == summary.generated_tokens == args.requests * args.new_tokens
    print(f"{args.requests} requests, prompts of 16-{args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens each")
    print("| run | seconds | generated tok/s | vs LLM.generate |")
    print("|---|---|---|---|")
    print(f"| tiergen run-batch | {batch_s:.1f} | {tokens / batch_s:.1f} | "
          f"{generate_s / batch_s:.2f}x |")
    print(f"| LLM.generate | {generate_s:.1f} | {tokens / generate_s:.1f} | - |")


if __name__ == "__main__":
    main()
