"""Whether a prompt's greedy answer depends on the prompts beside it: N prompts of 8 to about
40 tokens completed by `tiergen serve` under N concurrent requests; by `LLM.generate` in one
offline batch of N, in batches of 8 other prompts each (other lengths, so other padding), and
one prompt at a time; same machine, same run, every answer exactly --new-tokens long (EOS
ignored, so that a batch keeps its size to the end). Reports how many answers agree with the
server's (the text, to the character). --batch-invariant runs the server and the offline
engine so (LLM(batch_invariant=True)).

    python benchmarks/bench_same_answers.py [--model smollm2] [--streams 64] [--new-tokens 48] [--batch-invariant]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys

import httpx

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)

TOPICS = ["the sea", "a clock", "winter", "bread", "a violin", "the moon", "rivers", "chess"]


def offline(model: str, prompts: list[str], new_tokens: int, invariant: bool
            ) -> dict[str, list[str]]:
    """The answers in one batch, in batches of 8 (prompts i, i + N / 8, ...), and alone."""
    from tiergen import LLM, SamplingParams

    llm = LLM(model, batch_invariant=invariant)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    n, groups = len(prompts), max(1, len(prompts) // 8)
    try:
        batch = [out.text for out in llm.generate(prompts, params)]
        eights = [""] * n
        for g in range(groups):
            rows = list(range(g, n, groups))
            for i, out in zip(rows, llm.generate([prompts[i] for i in rows], params)):
                eights[i] = out.text
        alone = [llm.generate([prompt], params)[0].text for prompt in prompts]
    finally:
        llm.close()
    return {"one offline batch": batch, "batches of 8": eights, "alone": alone}


def served(model: str, prompts: list[str], new_tokens: int, invariant: bool) -> list[str]:
    """The answers of a server that receives every prompt at once."""
    cmd = [sys.executable, "-m", "tiergen.cli", "serve", "--model", model, "--host",
           "127.0.0.1", "--port", "0", "--max-batch-size", str(len(prompts))]
    cmd += ["--batch-invariant"] if invariant else []
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+", line)
        if not found:
            raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
        url = found.group(0)

        async def ask(client: httpx.AsyncClient, prompt: str) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": new_tokens,
                    "temperature": 0, "ignore_eos": True}
            r = await client.post(url + "/v1/completions", json=body, timeout=600)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        async def all_at_once() -> list[str]:
            limits = httpx.Limits(max_connections=len(prompts))
            async with httpx.AsyncClient(limits=limits) as client:
                return await asyncio.gather(*[ask(client, p) for p in prompts])

        return asyncio.run(all_at_once())
    finally:
        proc.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--batch-invariant", action="store_true")
    args = p.parse_args()
    prompts = [f"A short story about {TOPICS[i % len(TOPICS)]}"
               + " and a very old house" * (i % 7) + f" and the number {i}:"
               for i in range(args.streams)]
    answers = offline(args.model, prompts, args.new_tokens, args.batch_invariant)
    server = served(args.model, prompts, args.new_tokens, args.batch_invariant)
    same = "; ".join(f"{name} {sum(a == b for a, b in zip(got, server))}/{len(prompts)}"
                     for name, got in answers.items())
    mode = ", batch invariant" if args.batch_invariant else ""
    print(f"{args.model}{mode}, {len(prompts)} prompts, {args.new_tokens} greedy tokens, the same "
          f"answer as under {len(prompts)} concurrent server streams: {same}")


if __name__ == "__main__":
    main()
