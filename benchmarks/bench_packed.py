"""Packed weights against llama.cpp on the same GGUF files, same machine, same run.

128-token prompts, 64 greedy new tokens (EOS ignored), batch 1 and 32, 2 threads. tiergen runs
through ``tiergen bench --json`` with its packed matrices on the integer path (the default),
on the float path (``--exact``), and with them decoded to float32 at load (``--dequantize``); llama.cpp through llama-cpp-python's low-level API
(one sequence id per row, a KV cache split per sequence, prompts fed 512 tokens per
``llama_decode``). Every (engine, model, batch) runs in a fresh process, so peak RSS is its
own; with --repeat N each runs N times, the engines in turns, and the table gives each one's
median run (this machine's speed drifts within minutes).

    ../shared/peers/build_llamacpp.sh          # once: llama.cpp's binding in .peers/llamacpp-venv
    python benchmarks/bench_packed.py [--models smollm2 gemma3-270m] [--batches 1 32] [--transformers] [--repeat 3]
    python benchmarks/bench_packed.py --batches 32 --transformers --tiergen int8 --repeat 5

--tiergen names the tiergen runs to make (default: all three). With --repeat, each tiergen run's
ratio to the faster peer is also taken turn by turn (the peers of its own turn), and the median
of those ratios printed beside the turns': on a machine whose speed swings within minutes, the
ratio of medians can pair a fast turn with a slow one. Decode is also taken against llama.cpp's
decode turn by turn.

With --transformers, transformers ``generate`` runs on the same files too (dequantised at
load, the faster of float32 and native bfloat16), and the table gives each tiergen run's
total against the faster peer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from tiergen.bench import LLAMA_CPP_HELP, llama_cpp_python, peer_runner, prompt_ids
from tiergen.weights.gguf import GGUFFile

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT_LEN, NEW_TOKENS = 128, 64

TIERGEN_RUNS = {"int8": ("tiergen packed, int8", []),  # (name, `tiergen bench` flags)
                "exact": ("tiergen packed, --exact", ["--exact"]),
                "float32": ("tiergen float32", ["--dequantize"])}


def gguf_path(model: str) -> str:
    """A packaged model's GGUF by its short name, or a GGUF file's path."""
    from tiergen.weights import _packaged_file

    return model if model.endswith(".gguf") else str(_packaged_file(model))


def run_tiergen(model: str, batch: int, extra: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "tiergen.cli", "bench", "--model", model,
                          "--batch", str(batch), "--prompt-len", str(PROMPT_LEN), "--gen-len",
                          str(NEW_TOKENS), "--dtype", "float32", "--json", *extra],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    info = json.loads(out)
    return {**info["runs"][0], "cpu": info["cpu"], "simd": info["simd"]}


def run_llama_cpp(model: str, batch: int, prompt_len: int = PROMPT_LEN,
                  gen_len: int = NEW_TOKENS) -> dict:
    """llama.cpp on the prompts `tiergen bench` gives tiergen (``tiergen bench --against``'s
    peer), 2 threads."""
    path = gguf_path(model)
    runner = peer_runner("llama.cpp", path)
    if isinstance(runner, str):
        sys.exit(runner)
    vocab = len(GGUFFile(Path(path)).metadata["tokenizer.ggml.tokens"])
    return runner(prompt_ids(batch, prompt_len, vocab), gen_len, 2)


def run_transformers(model: str, batch: int) -> dict:
    """transformers ``generate`` on the same GGUF (dequantised at load), in float32 and, where
    this CPU has native bfloat16, in bfloat16 too: the faster of the two."""
    from tiergen._platform import cpu_has_fast_bfloat16

    best = None
    for dtype in ["float32"] + (["bfloat16"] if cpu_has_fast_bfloat16() else []):
        out = subprocess.run([sys.executable, str(HERE / "bench_generate.py"), "--child",
                              "transformers", dtype, str(batch), gguf_path(model)],
                             check=True, capture_output=True, text=True, cwd=HERE).stdout
        r = json.loads(out.strip().splitlines()[-1])
        r = {"total_tok_s": r["tok_s"], "decode_tok_s": None, "peak_rss_mb": r["peak_rss_mb"],
             "dtype": dtype}
        if best is None or r["total_tok_s"] > best["total_tok_s"]:
            best = r
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--transformers", action="store_true",
                    help="transformers generate on the same files too (its faster dtype)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each engine, in turns; the table gives each one's median")
    ap.add_argument("--tiergen", nargs="+", choices=list(TIERGEN_RUNS), default=list(TIERGEN_RUNS),
                    help="which tiergen runs to make")
    args = ap.parse_args()
    if llama_cpp_python() is None:
        sys.exit(LLAMA_CPP_HELP)
    rows, cpu = [], None
    for model in args.models:
        for batch in args.batches:
            engines = {TIERGEN_RUNS[t][0]: (lambda flags=TIERGEN_RUNS[t][1]:
                                            run_tiergen(model, batch, flags))
                       for t in args.tiergen}
            engines["llama.cpp"] = lambda: run_llama_cpp(model, batch)
            if args.transformers:
                engines["transformers"] = lambda: run_transformers(model, batch)
            tries: dict[str, list[dict]] = {}
            for _ in range(args.repeat):  # in turns, so that every engine sees the same drift
                for name, run in engines.items():
                    tries.setdefault(name, []).append(run())
            # each engine's median run by total tokens/s
            runs = {name: sorted(t, key=lambda r: r["total_tok_s"])[len(t) // 2]
                    for name, t in tries.items()}
            first = runs[TIERGEN_RUNS[args.tiergen[0]][0]]
            cpu = f"{first['cpu']} [{' '.join(first['simd'])}]"
            rows.append((model, batch, runs))
            print(f"{model} batch {batch}: {json.dumps(runs)}", flush=True)
            peers = [max(r["total_tok_s"] for r in turn)  # the faster peer of each turn
                     for turn in zip(*(t for n, t in tries.items() if not n.startswith("tiergen")))]
            for name, t in tries.items():
                if args.repeat > 1 and name.startswith("tiergen"):
                    turns = [r["total_tok_s"] / peer for r, peer in zip(t, peers)]
                    print(f"{model} batch {batch}, {name} against the faster peer of its turn: "
                          f"median {statistics.median(turns):.2f}x, turns "
                          + ", ".join(f"{r:.2f}x" for r in turns), flush=True)
                    decode = [r["decode_tok_s"] / peer["decode_tok_s"]
                              for r, peer in zip(t, tries["llama.cpp"])]
                    print(f"{model} batch {batch}, {name} decode against llama.cpp's of its "
                          f"turn: median {statistics.median(decode):.2f}x, turns "
                          + ", ".join(f"{r:.2f}x" for r in decode), flush=True)
    print(f"\nCPU: {cpu}\n")
    print("| model | batch | engine | decode tok/s | total tok/s | peak RSS | vs llama.cpp "
          "(decode / total) | total vs the faster peer |")
    print("|---|---|---|---|---|---|---|---|")
    for model, batch, runs in rows:
        peer = runs["llama.cpp"]
        fastest = max(r["total_tok_s"] for name, r in runs.items() if not name.startswith("tiergen"))
        for name, r in runs.items():
            decode = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:.1f}"
            ratio = "-" if not name.startswith("tiergen") else (
                f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}x / "
                f"{r['total_tok_s'] / peer['total_tok_s']:.2f}x")
            label = f"{name} ({r['dtype']})" if "dtype" in r else name
            vs = f"{r['total_tok_s'] / fastest:.2f}x" if name.startswith("tiergen") else "-"
            print(f"| {model} | {batch} | {label} | {decode} | {r['total_tok_s']:.1f} "
                  f"| {r['peak_rss_mb']:.0f} MB | {ratio} | {vs} |")


if __name__ == "__main__":
    main()
