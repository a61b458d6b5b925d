"""Long-prompt prefill: tiergen (chunked) against transformers and llama.cpp, same machine, same
run.

One prompt of each length, one new token. tiergen runs with its defaults (``dtype="auto"``:
packed weights keep float32 between the products, whose activations are integers);
transformers in this CPU's faster dtype (bfloat16 where it is native, else float32).
SmolLM2-135M-Instruct (context 8,192) at 1k, 4k and 8k (8,000) tokens; Gemma 3 270M (context
32,768) at 4k, 8k, 16k and 32k (32,000). Reports prefill tokens/s and the growth of peak
resident memory over the loaded model, each (engine, model, length) in a fresh process,
--repeat times in turns (the table gives each engine's median run). llama.cpp (where
``../shared/peers/build_llamacpp.sh`` has built it) reads the same GGUF with 2 threads, 512
tokens per ``llama_decode``.

    python benchmarks/bench_prefill.py [--models smollm2 gemma3-270m] [--chunk auto] [--repeat 3]
"""


import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen.bench import LLAMA_CPP_HELP, llama_cpp_python
from tiergen.offload.memory import resident_set, reset_peak_resident_set

from bench_packed import run_llama_cpp


LENGTHS = {"smollm2": [1024, 4096, 8000], "gemma3-270m": [4096, 8192, 16384, 32000]}


def child(engine: str, length: int, chunk: int | str, gguf: str, dtype: str) -> dict:
    import torch

    from tiergen import TiergenError

    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(0))
    if engine == "tiergen":
        from tiergen import LLM, SamplingParams

        llm = LLM(gguf, prefill_chunk_size=chunk)  # dtype: tiergen's own choice
        llm.generate([[5] * 16], SamplingParams(max_tokens=1))  # warm-up

        def run() -> None:
            llm.generate([ids[0].tolist()], SamplingParams(max_tokens=1))
    else:
        import transformers

        path = Path(gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=getattr(torch, dtype)).eval()
        with torch.inference_mode():
            model.generate(input_ids=ids[:, :16], max_new_tokens=1, do_sample=False, pad_token_id=0)

        def run() -> None:
            with torch.inference_mode():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                               do_sample=False, pad_token_id=0)
    before = resident_set()[0]
    reset_peak_resident_set()
    t = time.perf_counter()
    try:
        run()
    except TiergenError as e:
        return {"refused": str(e)}
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "tok_s": length / seconds,
            "peak_growth_mb": (resident_set()[1] - before) / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    p.add_argument("--lengths", type=int, nargs="+", help="instead of each model's own list")
    p.add_argument("--chunk", default="auto",
                   help="tiergen's prefill chunk (default: its own, for the CPU)")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs of each engine, in turns; the table gives each one's median")
    p.add_argument("--child", nargs=5)
    args = p.parse_args()
    if args.child:
        engine, length, chunk, gguf, dtype = args.child
        print(json.dumps(child(engine, int(length), chunk if chunk == "auto" else int(chunk),
                               gguf, dtype)))
        return
    from tiergen._platform import cpu_has_fast_bfloat16
    from tiergen.bench import cpu_description
    from tiergen.weights import _packaged_file

    dtype = "bfloat16" if cpu_has_fast_bfloat16() else "float32"
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']} ({' '.join(cpu['simd'])}); dtype {dtype}", flush=True)
    peers = ["transformers"] + (["llama.cpp"] if llama_cpp_python() else [])
    if len(peers) == 1:
        print(f"(llama.cpp left out: {LLAMA_CPP_HELP})")
    table = ["| model | prompt tokens | tiergen tok/s | " + " | ".join(f"{e} tok/s" for e in peers)
             + " | vs the faster peer | tiergen peak growth MB | transformers peak growth MB |",
             "|---" * (6 + len(peers)) + "|"]
    for model in args.models:
        gguf = str(_packaged_file(model))
        for length in args.lengths or LENGTHS[model]:
            runs: dict[str, list[dict]] = {}
            for turn in range(args.repeat):  # engines take turns, so they see the same drift
                for engine in ("tiergen", *peers):
                    if engine == "llama.cpp":  # one prompt, fed 512 tokens per llama_decode
                        r = run_llama_cpp(gguf, 1, length, 1)
                        r["tok_s"] = length * r["total_tok_s"]  # (prompt and its new token)
                    else:
                        out = subprocess.run([sys.executable, __file__, "--child", engine,
                                              str(length), str(args.chunk), gguf, dtype],
                                             capture_output=True, text=True)
                        if out.returncode:
                            sys.exit(f"{engine} {model} {length} failed:\n{out.stderr[-3000:]}")
                        r = json.loads(out.stdout.strip().splitlines()[-1])
                    runs.setdefault(engine, []).append(r)
                    print(engine, model, length, r, flush=True)
            # each engine's median run by tokens/s
            rows = {e: sorted(rs, key=lambda r: r.get("tok_s", 0))[len(rs) // 2]
                    for e, rs in runs.items()}
            t, h = rows["tiergen"], rows["transformers"]
            peer_cells = " | ".join(f"{rows[e]['tok_s']:.0f}" for e in peers)
            if "refused" in t:
                table.append(f"| {model} | {length} | refused | {peer_cells} | - | - | "
                             f"{h['peak_growth_mb']:.0f} |")
                continue
            best = max(rows[e]["tok_s"] for e in peers)
            table.append(f"| {model} | {length} | {t['tok_s']:.0f} | {peer_cells} | "
                         f"{t['tok_s'] / best:.2f}x | {t['peak_growth_mb']:.0f} | "
                         f"{h['peak_growth_mb']:.0f} |")
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
