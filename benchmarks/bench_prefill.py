"""Long-prompt prefill: tiergen (chunked) against transformers, same machine, same run.

SmolLM2-135M-Instruct (the packaged GGUF, bfloat16), one prompt of 1k, 4k, 8k (8,000) and 16k tokens,
one new token. Reports prefill tokens/s and the growth of peak resident memory over the loaded
model, each (engine, length) in a fresh process. SmolLM2's context is 8,192 tokens: tiergen
refuses 16k (the model was not trained for it); transformers runs it anyway, and the row shows
what that costs.

    python benchmarks/bench_prefill.py [--lengths 1024 4096 8192 16384] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen.offload.memory import resident_set, reset_peak_resident_set


def child(engine: str, length: int, chunk: int, gguf: str) -> dict:
    import torch

    from tiergen import TiergenError

    ids = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(0))
    if engine == "tiergen":
        from tiergen import LLM, SamplingParams

        llm = LLM(gguf, dtype="bfloat16", prefill_chunk_size=chunk)
        llm.generate([[5] * 16], SamplingParams(max_tokens=1))  # warm-up

        def run() -> None:
            llm.generate([ids[0].tolist()], SamplingParams(max_tokens=1))
    else:
        import transformers

        path = Path(gguf)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.bfloat16).eval()
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
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8000, 16384])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--child", nargs=4)
    args = p.parse_args()
    if args.child:
        engine, length, chunk, gguf = args.child
        print(json.dumps(child(engine, int(length), int(chunk), gguf)))
        return
    from tiergen.weights import _packaged_file

    gguf = str(_packaged_file("smollm2"))
    rows = {}
    for length in args.lengths:
        for engine in ("tiergen", "transformers"):
            out = subprocess.run([sys.executable, __file__, "--child", engine, str(length),
                                  str(args.chunk), gguf], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{engine} {length} failed:\n{out.stderr[-3000:]}")
            rows[engine, length] = r = json.loads(out.stdout.strip().splitlines()[-1])
            print(engine, length, r, flush=True)
    print("\n| prompt tokens | tiergen tok/s | transformers tok/s | ratio | tiergen peak growth MB "
          "| transformers peak growth MB | memory ratio |\n|---|---|---|---|---|---|---|")
    for length in args.lengths:
        t, h = rows["tiergen", length], rows["transformers", length]
        if "refused" in t:
            print(f"| {length} | refused (context 8192) | {h['tok_s']:.0f} | - | - | "
                  f"{h['peak_growth_mb']:.0f} | - |")
            continue
        print(f"| {length} | {t['tok_s']:.0f} | {h['tok_s']:.0f} | {t['tok_s'] / h['tok_s']:.2f}x | "
              f"{t['peak_growth_mb']:.0f} | {h['peak_growth_mb']:.0f} | "
              f"{h['peak_growth_mb'] / max(t['peak_growth_mb'], 1e-9):.1f}x lower |")


if __name__ == "__main__":
    main()
