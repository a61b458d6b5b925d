"""`tiergen serve` under load against offline `LLM.generate`, same prompts, same machine.

Starts the server itself (a subprocess on a free loopback port), sends N concurrent streaming
completions for each N (default 1, 8, 32, 64) with httpx, and reports aggregate throughput
(generated tokens/s, from the first request sent to the last token received), time to first
token and latency (p50, p99); between rounds, while the server idles, it runs `LLM.generate`
on the same prompts in this process. Prompts are random token ids; every request generates
exactly --new-tokens tokens (ignore_eos), greedy. The best of --repeat rounds counts.

    python benchmarks/bench_server.py [--model smollm2] [--concurrency 1 8 32 64] [--half-constrained]

With --half-constrained, each N also runs with every other request held to a JSON schema
(``response_format``), and the table gives its throughput against the unconstrained round's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)

MAX_CONCURRENCY = 256  # the load generator refuses more: it is a benchmark, not a flood
TIMEOUT_S = 600


@dataclass
class Load:
    """What one round of N concurrent requests measured."""

    tokens: int
    seconds: float
    ttft: list[float]
    latency: list[float]

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "tiergen.cli", "serve", "--model", args.model, "--host",
           "127.0.0.1", "--port", "0", "--dtype", args.dtype,
           "--max-batch-size", str(max(args.concurrency))]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    found = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not found:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}{proc.stderr.read()}")
    return proc, found.group(0)


# What --half-constrained holds every other request to: a JSON object with a list of at least 64
# strings, which 64 tokens do not close, so that every stream generates as many tokens as the
# others (compact JSON lets a greedy answer close an unbounded list at once: '{"items":[]}').
SCHEMA = {"type": "object", "required": ["items"],
          "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 64}}}


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      new_tokens: int, constrained: bool = False) -> tuple[float, float, int]:
    """Stream one completion; return (time to first token, latency, generated tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "items", "schema": SCHEMA}}
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():  # kept light: the client shares the CPU
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None and '"text":""' not in line and '"choices":[]' not in line:
                first = time.perf_counter() - start
            if '"usage"' in line:  # the last chunk
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return first or 0.0, time.perf_counter() - start, tokens


async def load(url: str, model: str, batch: list[list[int]], new_tokens: int,
               half_constrained: bool = False) -> Load:
    limits = httpx.Limits(max_connections=len(batch), max_keepalive_connections=len(batch))
    async with httpx.AsyncClient(limits=limits, timeout=TIMEOUT_S) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*[
            one_request(client, url, model, p, new_tokens, half_constrained and i % 2 == 1)
            for i, p in enumerate(batch)])
        seconds = time.perf_counter() - start
    return Load(sum(r[2] for r in results), seconds, [r[0] for r in results],
                [r[1] for r in results])


def offline_rate(llm, batch: list[list[int]], new_tokens: int) -> float:
    """Generated tokens per second of LLM.generate on one batch."""
    from tiergen import SamplingParams

    start = time.perf_counter()
    results = llm.generate(batch, SamplingParams(max_tokens=new_tokens, temperature=0,
                                                 ignore_eos=True))
    return sum(r.num_generated_tokens for r in results) / (time.perf_counter() - start)


def measure(args: argparse.Namespace, batches: dict[int, list[list[int]]]
            ) -> dict[int, tuple[Load, float, Load | None]]:
    """For each N, the best of --repeat server rounds and of as many offline runs (and, with
    --half-constrained, of as many server rounds with every other request held to a JSON
    schema), taken alternately (the server idles meanwhile) so that all meet the same
    machine."""
    from tiergen import LLM

    proc, url = start_server(args)
    try:
        llm = LLM(args.model, dtype=args.dtype, max_batch_size=max(args.concurrency))
        warm = batches[max(batches)][:8]
        asyncio.run(load(url, args.model, warm, 4))
        offline_rate(llm, warm, 4)
        results = {}
        if args.half_constrained:
            asyncio.run(load(url, args.model, warm, 4, True))
        for n, batch in batches.items():
            served, offline, constrained = [], [], []
            for _ in range(args.repeat):
                served.append(asyncio.run(load(url, args.model, batch, args.new_tokens)))
                offline.append(offline_rate(llm, batch, args.new_tokens))
                if args.half_constrained:
                    constrained.append(asyncio.run(load(url, args.model, batch, args.new_tokens,
                                                        True)))
            best = max(constrained, key=lambda s: s.throughput) if constrained else None
            results[n] = max(served, key=lambda s: s.throughput), max(offline), best
        return results
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="rounds per N; the best counts")
    p.add_argument("--half-constrained", action="store_true",
                   help="also rounds with every other request held to a JSON schema")
    args = p.parse_args()
    if not all(1 <= n <= MAX_CONCURRENCY for n in args.concurrency):
        raise SystemExit(f"--concurrency values must be between 1 and {MAX_CONCURRENCY}")

    from tiergen.weights import open_model

    vocab = open_model(args.model).config.vocab_size
    everything = prompts(max(args.concurrency), args.prompt_len, vocab)
    batches = {n: everything[:n] for n in args.concurrency}
    results = measure(args, batches)

    print(f"\n{args.model}, {args.dtype}, prompts of {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens each, greedy, streaming over loopback HTTP\n")
    print("| concurrent | server tok/s | offline tok/s | server/offline | TTFT p50 | TTFT p99 "
          "| latency p50 | latency p99 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, (s, offline, _) in results.items():
        print(f"| {n} | {s.throughput:.1f} | {offline:.1f} | {s.throughput / offline:.0%} "
              f"| {percentile(s.ttft, 50):.3f}s | {percentile(s.ttft, 99):.3f}s "
              f"| {percentile(s.latency, 50):.3f}s | {percentile(s.latency, 99):.3f}s |")
    if args.half_constrained:
        print("\n| concurrent | server tok/s | half held to a JSON schema tok/s | ratio |")
        print("|---:|---:|---:|---:|")
        for n, (s, _, c) in results.items():
            print(f"| {n} | {s.throughput:.1f} | {c.throughput:.1f} | "
                  f"{c.throughput / s.throughput:.0%} |")
    for n, target in ((32, 0.95), (64, 0.90)):
        if n in results:
            ratio = results[n][0].throughput / results[n][1]
            print(f"at {n} concurrent requests the server reaches {ratio:.0%} of offline "
                  f"throughput (target: >= {target:.0%})")


if __name__ == "__main__":
    main()
