"""How far each way of running a packed GGUF lands from tiergen's float path, the way
llama.cpp's ``perplexity --kl-divergence`` measures it: the KL divergence of each scored
position's next-token distribution from the float path's, and how often the top token agrees.

Same tokens for all (the packaged text tests/data/perplexity.txt, windows of --ctx tokens as
``tiergen perplexity`` cuts them, the second half of each scored), float32 activations between
layers. Rows:
- tiergen's integer path, 8-bit and 16-bit activations, fed in prompt chunks (--chunk rows per
  product: the tiles of the integer kernels) and token by token (one row per product, as a
  decode step: the row kernel);
- llama.cpp on the same file (llama-cpp-python from ../shared/peers/build_llamacpp.sh, its
  own process; one llama_decode per window).

    python benchmarks/bench_kld.py [--models smollm2 gemma3-270m] [--ctx 512] [--windows 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)
from tiergen import LLM, kernels
from tiergen.bench import cpu_description
from tiergen.perplexity import Perplexity, kl_stats, token_nll, tokenize, window_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packed import gguf_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA_PYTHON = ROOT / ".peers" / "llamacpp-venv" / "bin" / "python"
TEXT = ROOT / "tests" / "data" / "perplexity.txt"

# Writes, for each window of token ids (JSON on stdin), the log-probabilities of its scored
# positions to an .npy file each.
LLAMA_CPP = r'''
import json, sys
import numpy as np
import llama_cpp as L

path, out = sys.argv[1], sys.argv[2]
windows = json.load(sys.stdin)
ctx_len = len(windows[0])
first = ctx_len // 2
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = ctx_len, ctx_len, ctx_len, 2, 2
ctx = L.llama_init_from_model(model, cp)
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
b = L.llama_batch_init(ctx_len, 0, 1)
for w, window in enumerate(windows):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    b.n_tokens = len(window)
    for i, tok in enumerate(window):
        b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = tok, i, 1, 0
        b.logits[i] = first <= i < ctx_len - 1
    if L.llama_decode(ctx, b) != 0:
        raise RuntimeError("llama_decode failed")
    rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).astype(np.float64)
            for i in range(first, ctx_len - 1)]
    z = np.stack(rows)
    z -= z.max(1, keepdims=True)
    z -= np.log(np.exp(z).sum(1, keepdims=True))
    np.save(f"{out}/{w}.npy", z.astype(np.float32))
'''


def tiergen_run(model: str, ids: list[int], bos, ctx: int, windows: int, chunk: int,
                activations: str) -> list[torch.Tensor]:
    llm = LLM(model, dtype="float32", activations=activations, prefill_chunk_size=chunk)
    return [lp for _, lp in window_logprobs(llm, ids, ctx, windows, bos=bos)]


def llama_cpp_run(model: str, ids: list[int], bos, ctx: int, windows: int
                  ) -> list[torch.Tensor]:
    wins = []
    for w in range(windows):
        window = list(ids[w * ctx:(w + 1) * ctx])
        if bos is not None:
            window[0] = bos
        wins.append(window)
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([str(LLAMA_PYTHON), "-c", LLAMA_CPP, gguf_path(model), out],
                       input=json.dumps(wins), text=True, check=True, capture_output=True)
        return [torch.from_numpy(np.load(f"{out}/{w}.npy")) for w in range(windows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=32, help="prompt rows per product (<= 32)")
    ap.add_argument("--runs", default="int8,int16,int8-rows,int16-rows,llama.cpp",
                    help="which runs besides the float path: int8, int16 (prompt chunks), "
                         "int8-rows, int16-rows (token by token), llama.cpp")
    ap.add_argument("--int8-group", type=int, default=None, choices=[4, 8, 16],
                    help="values per scale of the int8 runs (default: tiergen's, 8)")
    args = ap.parse_args()
    if args.int8_group:  # the kernels take 4, 8 or 16; tiergen uses 8
        kernels.ACTIVATION_FORMATS["int8"] = (args.int8_group, False)
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}); {TEXT.name}, windows of {args.ctx}, "
          f"{args.windows} windows; int8: a scale per {kernels.ACTIVATION_FORMATS['int8'][0]}")
    print("| model | run | mean KLD | p99 KLD | max KLD | same top | perplexity |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        text = TEXT.read_text()
        ref_llm = LLM(model, dtype="float32", activations="float32")
        ids, bos = tokenize(ref_llm, text)
        ref = [lp for _, lp in window_logprobs(ref_llm, ids, args.ctx, args.windows, bos=bos)]
        del ref_llm
        targets = torch.cat([torch.tensor(ids[w * args.ctx + args.ctx // 2 + 1:(w + 1) * args.ctx])
                             for w in range(args.windows)])
        ref_all = torch.cat(ref)

        def row(name: str, got: list[torch.Tensor]) -> None:
            got_all = torch.cat(got)
            s = kl_stats(ref_all, got_all)
            ppl = Perplexity.of(token_nll(got_all, targets))
            print(f"| {model} | {name} | {s.mean:.5f} | {s.p99:.5f} | {s.max:.4f} | "
                  f"{100 * s.same_top:.1f} % | {ppl.value:.3f} |", flush=True)

        row("float path (reference)", ref)
        for name in args.runs.split(","):
            if name == "llama.cpp":
                if not LLAMA_PYTHON.exists():
                    sys.exit(f"{LLAMA_PYTHON} is missing: run ../shared/peers/build_llamacpp.sh")
                row("llama.cpp", llama_cpp_run(model, ids, bos, args.ctx, args.windows))
                continue
            activations, _, rows = name.partition("-")
            chunk = 1 if rows else args.chunk
            how = "token by token" if chunk == 1 else f"prompt chunks of {chunk}"
            row(f"{activations} activations, {how}",
                tiergen_run(model, ids, bos, args.ctx, args.windows, chunk, activations))


if __name__ == "__main__":
    main()
