"""tiergen against transformers `generate` on SmolLM2-135M, same machine, same run.

Prompt of 128 tokens, 64 new tokens, greedy, batch sizes 1/8/32, float32 and bfloat16.
tiergen runs with ``compile=True`` (batch-1 CPU matmuls compiled; the warm-up call compiles).
Reports generated tokens per second (prefill included), time to first token, peak memory
and the ratio, and writes a plot of tokens/s against batch size.

    python benchmarks/bench_generate.py [--batches 1 8 32] [--dtypes float32 bfloat16]
    python benchmarks/bench_generate.py --checkpoint safetensors --batches 32 --dtypes bfloat16

``--checkpoint safetensors``: both engines load the same weights as a Hugging Face checkpoint
in bfloat16 (the GGUF dequantised and saved once by transformers into tiergen's cache), so
tiergen runs its float path (``quantize=None``) rather than its packed integer path.

Each (engine, dtype, batch) runs in a fresh process so that peak memory is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen.offload.memory import resident_set  # peak RSS of this process alone (VmHWM)

from plot import throughput_plot

PROMPT_LEN, NEW_TOKENS = 128, 64
HERE = Path(__file__).resolve().parent


def prompts(batch: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab - 100, (batch, PROMPT_LEN), generator=g).tolist()


def run_tiergen(dtype: str, batch: int, gguf: str) -> dict:
    from tiergen import LLM, SamplingParams

    llm = LLM(gguf, dtype=dtype, compile=True)  # compiled batch-1 matmuls (warm-up compiles)
    ps = prompts(batch, llm.config.vocab_size)

    def gen(n: int) -> float:
        t = time.perf_counter()
        llm.generate(ps, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t

    gen(4)  # warm-up
    ttft = gen(1)
    return {"seconds": gen(NEW_TOKENS), "ttft": ttft}


def run_transformers(dtype: str, batch: int, gguf: str) -> dict:
    import torch
    import transformers

    path = Path(gguf)  # transformers reads the same GGUF, dequantised, or the same checkpoint
    extra = {} if path.is_dir() else {"gguf_file": path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path if path.is_dir() else path.parent, dtype=getattr(torch, dtype), **extra)
    model.eval()
    ids = torch.tensor(prompts(batch, model.config.vocab_size))
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    gen(4)
    ttft = gen(1)
    return {"seconds": gen(NEW_TOKENS), "ttft": ttft}


def safetensors_checkpoint(gguf: str) -> str:
    """The GGUF's weights as a bfloat16 Hugging Face checkpoint, converted once."""
    import torch
    import transformers

    from tiergen.weights import cache_dir

    out = cache_dir() / "bench" / (Path(gguf).stem + "-bf16")
    if not (out / "config.json").exists():
        path = Path(gguf)
        read = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.bfloat16)
        config = read.config
        config.__dict__.pop("quantization_config", None)  # (a GGUF-read model will not save)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(read.state_dict())
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return str(out)


def weight_read_bound(gguf: str) -> dict:
    """Batch-1 decode bound: weight bytes read per token over measured streaming bandwidth."""
    import torch

    from tiergen import LLM

    llm = LLM(gguf, dtype="float32")
    ex = llm.executor
    per_token = sum(t.nbytes for w in ex.weights.resident for t in w.values()) + ex.globals["lm_head"].nbytes
    a = torch.randn(8192, 8192)
    x = torch.randn(8192)
    for _ in range(3):
        a @ x
    t = time.perf_counter()
    for _ in range(10):
        a @ x
    bandwidth = 10 * a.nbytes / (time.perf_counter() - t)
    return {"bytes_per_token_f32": per_token, "gemv_bandwidth": bandwidth,
            "bound_tok_s_f32": bandwidth / per_token}


def child(args: argparse.Namespace) -> None:
    fn = {"tiergen": run_tiergen, "transformers": run_transformers}[args.engine]
    result = fn(args.dtype, args.batch, args.path)
    result["peak_rss_mb"] = resident_set()[1] / 2**20
    result["tok_s"] = args.batch * NEW_TOKENS / result["seconds"]
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--checkpoint", choices=["gguf", "safetensors"], default="gguf")
    p.add_argument("--plot", default=str(HERE.parent / "docs" / "bench_generate.png"))
    p.add_argument("--child", nargs=4, metavar=("ENGINE", "DTYPE", "BATCH", "PATH"))
    args = p.parse_args()
    if args.child:
        engine, dtype, batch, path = args.child
        child(argparse.Namespace(engine=engine, dtype=dtype, batch=int(batch), path=path))
        return

    from tiergen.weights import _packaged_file

    gguf = str(_packaged_file("smollm2"))
    model = gguf if args.checkpoint == "gguf" else safetensors_checkpoint(gguf)
    rows = []
    for dtype in args.dtypes:
        for batch in args.batches:
            for engine in ("tiergen", "transformers"):
                out = subprocess.run([sys.executable, __file__, "--child", engine, dtype,
                                      str(batch), model], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{engine} {dtype} batch {batch} failed:\n{out.stderr}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append({"engine": engine, "dtype": dtype, "batch": batch, **r})
                print(f"{engine:12s} {dtype:8s} batch {batch:3d}: {r['tok_s']:7.1f} tok/s  "
                      f"ttft {r['ttft']:.3f}s  peak {r['peak_rss_mb']:.0f} MB", flush=True)
    bound = weight_read_bound(str(gguf))
    report(rows, bound, args)


def report(rows: list[dict], bound: dict, args: argparse.Namespace) -> None:
    def get(engine: str, dtype: str, batch: int) -> dict:
        return next(r for r in rows if (r["engine"], r["dtype"], r["batch"]) == (engine, dtype, batch))

    print("\n| dtype | batch | tiergen tok/s | transformers tok/s | ratio | tiergen TTFT s | "
          "transformers TTFT s | tiergen peak MB | transformers peak MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for b in args.batches:
            t, h = get("tiergen", dtype, b), get("transformers", dtype, b)
            print(f"| {dtype} | {b} | {t['tok_s']:.1f} | {h['tok_s']:.1f} | "
                  f"{t['tok_s'] / h['tok_s']:.2f}x | {t['ttft']:.3f} | {h['ttft']:.3f} | "
                  f"{t['peak_rss_mb']:.0f} | {h['peak_rss_mb']:.0f} |")
    print("\nAgainst transformers' faster dtype at each batch size:")
    for b in args.batches:
        best_t = max(get("tiergen", d, b)["tok_s"] for d in args.dtypes)
        best_h = max(get("transformers", d, b)["tok_s"] for d in args.dtypes)
        print(f"- batch {b}: tiergen {best_t:.1f} / transformers {best_h:.1f} = {best_t / best_h:.2f}x")
    print(f"\nBatch-1 bound (float32): {bound['bytes_per_token_f32'] / 1e6:.0f} MB of weights per "
          f"token at {bound['gemv_bandwidth'] / 1e9:.1f} GB/s GEMV streaming = "
          f"{bound['bound_tok_s_f32']:.1f} tok/s")
    if "float32" in args.dtypes and 1 in args.batches:
        t1 = get("tiergen", "float32", 1)["tok_s"]
        print(f"tiergen float32 batch 1 reaches {100 * t1 / bound['bound_tok_s_f32']:.0f}% of it "
              "(prefill of 128 tokens included)")
    print(json.dumps({"rows": rows, "bound": bound}))

    throughput_plot(
        args.plot, args.batches,
        {f"{engine} {dtype}": ([get(engine, dtype, b)["tok_s"] for b in args.batches],
                               "-" if engine == "tiergen" else "--")
         for engine in ("tiergen", "transformers") for dtype in args.dtypes},
        "batch size", f"SmolLM2-135M, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, 2 CPU cores")

if __name__ == "__main__":
    main()
