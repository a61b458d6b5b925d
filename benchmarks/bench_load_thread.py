"""The scheduler without HTTP, by the thread the model was loaded on, against LLM.generate.

Loads SmolLM2 on the main thread (``--load main``) or on a thread that ends before serving
(``--load thread``, what `tiergen serve` does), then runs 32 prompts of 128 random tokens, 64
greedy new tokens each, through the continuous-batching Scheduler (its own thread) and through
offline LLM.generate; prints generated tokens/s of each, best of --repeat.

    python benchmarks/bench_load_thread.py --load main
    python benchmarks/bench_load_thread.py --load thread
"""

from __future__ import annotations

import argparse
import threading
import time

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen._platform import on_short_lived_thread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", choices=["main", "thread"], required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()

    import torch

    from tiergen import LLM, SamplingParams
    from tiergen.bench import cpu_description
    from tiergen.engine.scheduler import Scheduler

    load = lambda: LLM(args.model, max_batch_size=64)  # noqa: E731
    llm = load() if args.load == "main" else on_short_lived_thread(load)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, llm.config.vocab_size - 100, (32, 128), generator=g).tolist()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    tokens = len(prompts) * params.max_tokens

    scheduler = Scheduler(llm).start()
    served = []
    try:
        for _ in range(args.repeat):
            done = threading.Semaphore(0)
            start = time.perf_counter()
            for prompt in prompts:
                scheduler.submit(prompt, params,
                                 on_event=lambda ev: ev.finish_reason and done.release())
            for _ in prompts:
                done.acquire()
            served.append(tokens / (time.perf_counter() - start))
    finally:
        scheduler.stop()
    offline = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        llm.generate(prompts, params)
        offline.append(tokens / (time.perf_counter() - start))
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']} ({' '.join(cpu['simd'])}); {args.model}, {llm.dtype}, "
          f"loaded on the {args.load} thread")
    print(f"scheduler {max(served):.1f} tok/s, LLM.generate {max(offline):.1f} tok/s, "
          f"ratio {max(served) / max(offline):.0%}")


if __name__ == "__main__":
    main()
