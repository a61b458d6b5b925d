"""Mixed load on `tiergen serve`: streams decoding while a long prompt arrives.

Starts the server (as bench_server.py does), then runs two rounds of --streams concurrent
streaming completions (--new-tokens each, greedy, random prompts of --prompt-len tokens):
alone, and again with one --long-prompt-token prompt sent once every stream has produced
--join-after tokens. Reports the streams' inter-token gaps (p50, p99, max) in both rounds,
in the second only while the long prompt is being prefilled, and the long prompt's time to
first token. Target: the p99 gap during the long prefill at most 3x the p50 gap alone.

A gap is per token: the server sends a chunk when a token completes some text, so a character
that takes two tokens arrives in one chunk two steps after the previous one. Each chunk says how
many tokens the stream has generated so far (``stream_options.continuous_usage_stats``), and a
chunk that brings k tokens counts as k gaps of a k-th of its wait. The gaps between the chunks
themselves are reported too.

    python benchmarks/bench_mixed.py [--model smollm2] [--streams 32] [--long-prompt 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from bench_server import percentile, prompts, start_server
from tiergen.bench import cpu_description


async def stream(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                 new_tokens: int, times: list[tuple[float, int]]) -> None:
    """Stream one completion, appending (arrival time, tokens generated so far) of each chunk
    that carries text to ``times``."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():  # kept light: the client shares the CPU
            if line.startswith("data: ") and '"text":""' not in line and line != "data: [DONE]":
                arrived = time.perf_counter()
                times.append((arrived, json.loads(line[6:])["usage"]["completion_tokens"]))


async def round_(url: str, args: argparse.Namespace, batch: list[list[int]],
                 long_prompt: list[int] | None) -> tuple[list[list[tuple[float, int]]],
                                                          list[tuple[float, int]]]:
    """Chunk arrivals of each stream, and of the long prompt (empty if none was sent)."""
    limits = httpx.Limits(max_connections=len(batch) + 1)
    async with httpx.AsyncClient(limits=limits, timeout=1800) as client:
        times: list[list[tuple[float, int]]] = [[] for _ in batch]
        tasks = [asyncio.create_task(stream(client, url, args.model, p, args.new_tokens, t))
                 for p, t in zip(batch, times)]
        long_times: list[tuple[float, int]] = []
        if long_prompt is not None:
            while min(t[-1][1] if t else 0 for t in times) < args.join_after:
                await asyncio.sleep(0.01)
            long_times.append((time.perf_counter(), 0))  # sent
            tasks.append(asyncio.create_task(
                stream(client, url, args.model, long_prompt, 4, long_times)))
        await asyncio.gather(*tasks)
    return times, long_times


def gaps(times: list[list[tuple[float, int]]], start: float = 0.0, end: float = float("inf"),
         per_token: bool = True) -> list[float]:
    """Inter-token gaps (or, with ``per_token=False``, gaps between chunks) of every stream
    that end within [start, end]."""
    out = []
    for t in times:
        for (a, m), (b, n) in zip(t, t[1:]):
            if start <= b <= end:
                k = n - m if per_token else 1
                out += [(b - a) / k] * k
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--long-prompt", type=int, default=8000)
    p.add_argument("--join-after", type=int, default=8)
    args = p.parse_args()

    from tiergen.weights import open_model

    vocab = open_model(args.model).config.vocab_size
    batch = prompts(args.streams, args.prompt_len, vocab)
    long_prompt = prompts(1, args.long_prompt, vocab)[0]
    server = argparse.Namespace(model=args.model, dtype=args.dtype,
                                concurrency=[args.streams * 2])
    proc, url = start_server(server)
    try:
        asyncio.run(round_(url, args, batch[:4], None))  # warm up
        alone, _ = asyncio.run(round_(url, args, batch, None))
        mixed, long_times = asyncio.run(round_(url, args, batch, long_prompt))
    finally:
        proc.terminate()
        proc.wait(30)

    sent, first = long_times[0][0], long_times[1][0]
    base, during = gaps(alone), gaps(mixed, sent, first)
    cpu = cpu_description()
    print(f"\n{args.model}, {args.dtype}, CPU: {cpu['cpu']} ({' '.join(cpu['simd'])}); "
          f"{args.streams} streams of {args.new_tokens} tokens, a "
          f"{args.long_prompt}-token prompt joining after {args.join_after}\n")
    print("| gap | streams | p50 | p99 | max | gaps |")
    print("|---|---|---:|---:|---:|---:|")
    for per_token, unit in ((True, "inter-token"), (False, "between chunks")):
        for name, g in (("alone", gaps(alone, per_token=per_token)),
                        ("during the long prefill", gaps(mixed, sent, first, per_token)),
                        ("whole mixed round", gaps(mixed, per_token=per_token))):
            print(f"| {unit} | {name} | {percentile(g, 50):.3f}s | {percentile(g, 99):.3f}s "
                  f"| {max(g):.3f}s | {len(g)} |")
    print(f"\nlong prompt: first token after {first - sent:.1f}s; p99 inter-token gap during "
          f"/ p50 alone = {percentile(during, 99) / percentile(base, 50):.2f} (target: <= 3)")


if __name__ == "__main__":
    main()
