"""A few-shot-style scoring job with and without shared prefixes, same run, same process.

--prompts prompts share a --prefix-token preamble (the text of tests/data/perplexity.txt, as
few-shot examples are) and each ends with its own --question tokens; every prompt is scored
as lm-evaluation-harness scores a choice (``max_tokens=0``, ``prompt_logprobs=1``: echo with
log-probabilities). tiergen runs it with its shared prefixes (the default) and with
``share_prefixes=False`` on the first --baseline-prompts prompts (enough for a rate: each row
then costs the same), and reports prompts per second, the ratio, and the largest difference
between the two runs' log-probabilities of each prompt's question tokens. The prefix is
computed in chunks of its own, so that difference is the one a change of
``prefill_chunk_size`` makes: float rounding on the float path (``--exact``), and on the
integer path, whose 8-bit rounding of activations turns float rounding into whole steps, the
integer path's own noise (see docs/BENCHMARKS.md).

    python benchmarks/bench_prefix.py [--model smollm2] [--prompts 256] [--prefix 1000] [--question 10] [--exact]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen import LLM, SamplingParams
from tiergen.bench import cpu_description

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt"


def score(llm: LLM, prompts: list[list[int]], question: int) -> tuple[float, list[float]]:
    """Seconds to score ``prompts``, and each one's log-probability of its question tokens."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - t
    sums = []
    for p, r in zip(prompts, results):
        entries = r.prompt_logprobs[-question:]
        sums.append(sum(e[tok].logprob for tok, e in zip(p[-question:], entries)))
    return seconds, sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--question", type=int, default=10)
    ap.add_argument("--baseline-prompts", type=int, default=32)
    ap.add_argument("--exact", action="store_true", help="the float path (activations float32)")
    args = ap.parse_args()
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})")
    llm = LLM(args.model, activations="float32" if args.exact else "auto")
    text = llm.tokenizer.encode(TEXT.read_text())
    if len(text) < args.prefix + args.question:
        raise SystemExit(f"{TEXT} has {len(text)} tokens: ask for a shorter --prefix")
    prefix, tail = text[:args.prefix], text[args.prefix:]
    prompts = [prefix + [tail[(7 * i + j) % len(tail)] for j in range(args.question)]
               for i in range(args.prompts)]
    score(llm, prompts[:2], args.question)  # warm-up

    shared_s, shared = score(llm, prompts, args.question)
    stats = llm.last_stats
    llm.share_prefixes = False
    n = min(args.baseline_prompts, args.prompts)
    alone_s, alone = score(llm, prompts[:n], args.question)
    rate_shared, rate_alone = args.prompts / shared_s, n / alone_s
    tokens = args.prefix + args.question
    print(f"{args.prompts} prompts of {tokens} tokens ({args.prefix} shared), scored with "
          f"prompt log-probabilities; {llm.micro_batch} rows per block; activations "
          f"{llm.activations}")
    print("| run | prompts | seconds | prompts/s | prompt tokens/s | vs without |")
    print("|---|---|---|---|---|---|")
    print(f"| shared prefixes | {args.prompts} | {shared_s:.1f} | {rate_shared:.2f} | "
          f"{rate_shared * tokens:.0f} | {rate_shared / rate_alone:.1f}x |")
    print(f"| without | {n} | {alone_s:.1f} | {rate_alone:.2f} | {rate_alone * tokens:.0f} | - |")
    print(f"prompt tokens copied from shared prefixes: {stats.shared_prompt_tokens}")
    diff = max(abs(a - b) for a, b in zip(shared, alone))
    print(f"largest difference in a question's log-probability between the runs: {diff:.2e}")


if __name__ == "__main__":
    main()
