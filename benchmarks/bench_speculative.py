"""Speculative decoding with prompt lookup against plain decoding, and against llama.cpp with
and without its prompt lookup (llama-cpp-python's ``LlamaPromptLookupDecoding``), on the
packaged SmolLM2 GGUF at batch 1: a rewriting job whose answer copies much of its prompt.

Each engine answers the same chat prompts greedily (the same token ids), in a fresh process,
in turns with --repeat; reported are decode tokens/s (generated tokens over the time after
the first token), tiergen's proposals kept, and whether each engine's speculative answers
equal its plain ones.

    python benchmarks/bench_speculative.py [--draft-tokens 2 4 8 auto] [--repeat 3] [--no-llamacpp]

With --offloaded the target is SmolLM2 as a float32 checkpoint (its GGUF dequantised) with
every weight on disk, streamed each step, and the proposals come from a draft model, its
own Q4_1 GGUF, resident (no llama.cpp peer: it has no weights on disk to stream).

    python benchmarks/bench_speculative.py --offloaded [--draft-tokens 4 8 16 auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LLAMA_PYTHON = ROOT / ".peers" / "llamacpp-venv" / "bin" / "python"
MAX_TOKENS = 160
TEXTS = [
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to increase the funds for children's books, to open the "
    "reading room on Sundays, and to hire two more librarians before the end of the year.",
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + "
    "item.price * item.count\n    return result\n\n\ndef average(items):\n    return "
    "total(items) / len(items)\n",
]
ASKS = ["Rewrite the text below exactly as it is, but in the past tense where it is not "
        "already:\n\n", "Rename the variable `result` to `acc` in this code and print the whole "
        "code again:\n\n"]

CHILD = r'''
import json, sys, time
engine, draft, ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
draft = draft if draft == "auto" else int(draft)
G, path, offloaded = int(sys.argv[4]), sys.argv[5], sys.argv[6] == "1"
out = []
if engine == "tiergen":
    import tempfile
    from tiergen import LLM, Policy, SamplingParams
    if offloaded:
        spec = {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": draft}
        disk = Policy(weights=(0, 0), offload_dir=tempfile.mkdtemp(prefix="bench-spec-"))
        llm = LLM("smollm2", packed=False, dtype="float32", policy=disk,
                  speculative_config=spec if draft else None)
    else:
        spec = {"method": "ngram", "num_speculative_tokens": draft}
        llm = LLM("smollm2", speculative_config=spec if draft else None)
    params = SamplingParams(max_tokens=G, temperature=0)
    llm.generate([ids[0]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for p in ids:
        r = llm.generate([p], params)[0]
        s = llm.last_stats
        out.append({"tokens": r.token_ids, "decode_s": s.decode_seconds,
                    "kept": s.accepted_tokens, "proposed": s.proposed_tokens})
else:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    llm = llama_cpp.Llama(path, n_ctx=2048, n_threads=2, verbose=False,
                          draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None)
    llm.create_completion(ids[0], max_tokens=4, temperature=0)
    for p in ids:
        t0 = time.perf_counter()
        first = None
        tokens = []
        for piece in llm.create_completion(p, max_tokens=G, temperature=0, stream=True):
            if first is None:
                first = time.perf_counter()
            tokens.append(piece["choices"][0]["text"])
        out.append({"tokens": tokens, "decode_s": time.perf_counter() - first,
                    "kept": None, "proposed": None})
print(json.dumps(out))
'''


def prompts() -> list[list[int]]:
    from tiergen import LLM

    llm = LLM("smollm2")
    return [llm.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": ask + text}]))
            for ask, text in zip(ASKS, TEXTS)]


def run(engine: str, draft: int, ids: list[list[int]], offloaded: bool) -> list[dict]:
    python = sys.executable if engine == "tiergen" else str(LLAMA_PYTHON)
    from tiergen.weights import _packaged_file

    out = subprocess.run([python, "-c", CHILD, engine, str(draft), json.dumps(ids), str(MAX_TOKENS),
                          str(_packaged_file("smollm2")), str(int(offloaded))],
                         check=True, capture_output=True, text=True, cwd=ROOT,
                         env=os.environ | {"PYTHONPATH": str(ROOT)}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-tokens", nargs="+", type=lambda v: v if v == "auto" else int(v),
                    default=[4], help='proposals a step, each a run ("auto": tiergen chooses)')
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--offloaded", action="store_true",
                    help="a float target with its weights on disk, drafted by its Q4_1 GGUF")
    args = ap.parse_args()
    ids = prompts()
    engines = ["tiergen"] + ([] if args.no_llamacpp or args.offloaded or not LLAMA_PYTHON.exists()
                             else ["llama.cpp"])
    configs = [(e, d) for e in engines for d in [0, *args.draft_tokens]
               if e == "tiergen" or d != "auto"]
    results: dict[tuple[str, int], list[list[dict]]] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for c in configs:
            results[c].append(run(*c, ids, args.offloaded))
    print("| engine | draft tokens | decode tok/s (median) | vs its plain decode | proposals kept "
          "| same answers as plain |\n|---|---|---|---|---|---|")
    rate = {}
    for (engine, draft), turns in results.items():
        rates = [sum(len(r["tokens"]) - 1 for r in t) / sum(r["decode_s"] for r in t) for t in turns]
        rate[engine, draft] = statistics.median(rates)
        kept = (f"{sum(r['kept'] for r in turns[0])} of {sum(r['proposed'] for r in turns[0])}"
                if engine == "tiergen" and draft else "-")
        same = ("yes" if [r["tokens"] for r in turns[0]] == [r["tokens"] for r in results[engine, 0][0]]
                else "no") if draft else "-"
        print(f"| {engine} | {draft or 'off'} | {rate[engine, draft]:.1f} | "
              f"{rate[engine, draft] / rate[engine, 0]:.2f}x | {kept} | {same} |")
    if "llama.cpp" in engines:
        best = max(v for (e, _), v in rate.items() if e == "llama.cpp")
        ours = max(v for (e, _), v in rate.items() if e == "tiergen")
        print(f"\ntiergen's best against llama.cpp's best: {ours / best:.2f}x")
    from tiergen.bench import cpu_description

    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}, {', '.join(cpu['simd'])}")


if __name__ == "__main__":
    main()
