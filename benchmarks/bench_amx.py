"""torch's bfloat16 matmul with oneDNN free to use AMX (tiergen's choice where its probe says
the tiles work) against oneDNN capped at AVX512_CORE_BF16, each in a fresh process, since
oneDNN reads its ceiling once.

    python benchmarks/bench_amx.py [--threads N]
    python benchmarks/bench_amx.py --attention   # a prompt's attention: amx.c, torch
    python benchmarks/bench_amx.py --attention-against HEAD~1   # this tree's amx.c against
                                                 # a revision's, built side by side
    python benchmarks/bench_amx.py --packed-against HEAD~1   # amx.c's packed product: this
                                                 # tree's against a revision's
    python benchmarks/bench_amx.py --amx-prompt-against 128 [--model gemma3-270m]
                                                 # prompts of 16-96 tokens with
                                                 # kernels.AMX_PROMPT and with 128
    python benchmarks/bench_amx.py --prompt      # one 4,096-token prompt: tiergen's tiles,
                                                 # oneDNN's, none
    python benchmarks/bench_amx.py --kld         # KL divergence from the float path, off and on
    python benchmarks/bench_amx.py --packed      # a Q4_1 matrix on the tiles: amx.c, oneDNN
    python benchmarks/bench_amx.py --experts     # a MoE prompt, experts on the tiles or not
    python benchmarks/bench_amx.py --rounding    # to bfloat16: tiergen's C against torch's
    python benchmarks/bench_amx.py --dense       # a bfloat16 matrix as stored: amx.c, oneDNN
    python benchmarks/bench_amx.py --panels      # amx.c's packed product alone, by rows
    python benchmarks/bench_amx.py --glu         # a prompt's act(gate) * up into bfloat16
    python benchmarks/bench_amx.py --mlp         # gate, up and act(gate) * up in one pass
                                                 # (kernels.amx_glu) or two calls

Shapes: a square 2048 product, and SmolLM2's MLP and a Llama-8B-shaped MLP at a prompt chunk
of 512 tokens. --prompt and --kld turn tiergen's prompts on AMX off by raising
``kernels.AMX_PROMPT`` past any prompt; --prompt's "onednn" turn decodes each matrix to float32,
rounds it to bfloat16 and lets torch's matmul (oneDNN) multiply on the tiles instead of amx.c.
--experts builds random mixture-of-experts Q4_0 GGUFs once (in --dir; hidden 1024, 4 layers,
each but the first of 32 experts of 512): Qwen3-MoE-shaped (4 experts a token) and
Qwen2-MoE-shaped (the same and a shared expert of 2,048), and times one 2,048-token prompt in
prompt chunks of --chunk with tiergen's choice of the tiles for their experts
(moe.routed_on_tiles: the shared ones; the routed ones where an expert takes a quarter of the
tokens), with all the experts on the tiles, and with none, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import tiergen  # noqa: F401  (first: its probe decides oneDNN's ceiling)
from tiergen.weights.quant import GGMLType
from tiergen._platform import ONEDNN_CAP, amx_usable
from tiergen.bench import cpu_description

SHAPES = [(2048, 2048, 2048), (512, 576, 1536), (512, 4096, 14336)]

CHILD = r"""
import json, sys, time
import tiergen, torch
torch.set_num_threads(int(sys.argv[1]))
out = []
for m, k, n in json.loads(sys.argv[2]):
    a, b = torch.randn(m, k).bfloat16(), torch.randn(k, n).bfloat16()
    a @ b
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < 1.0:
        a @ b
        runs += 1
    out.append(2 * m * k * n * runs / (time.perf_counter() - start) / 1e12)
print(json.dumps(out))
"""


def rates(threads: int, cap: str | None) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if cap:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), json.dumps(SHAPES)],
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def attention() -> None:
    """A prompt's attention in bfloat16, SmolLM2's heads (9 query heads, 3 K/V heads of 64) and
    Gemma 3 270M's (4, 1 of 256): amx.c's tiles (``kernels.amx_attention``) against torch's
    flash attention, for one 4,096-token prompt in one call and for its last chunk of 1,024
    queries over the 4,096 keys (torch: the two flash passes tiergen ran before, see
    ``cache.attention._chunk_attention``); and Gemma's sliding window of 512 over a chunk of
    1,024 (its first; a later one over the 512 keys before it and its own), against torch's
    masked path, which tiergen's ring took before."""
    import torch
    import torch.nn.functional as F

    from tiergen import kernels
    from tiergen.cache.attention import _chunk_attention

    if not kernels.amx_engine():
        sys.exit("amx.c's tiles do not work here")
    for name, (H, KVH, D) in {"SmolLM2": (9, 3, 64), "Gemma 3 270M": (4, 1, 256)}.items():
        q = torch.randn(1, H, 4096, D, dtype=torch.bfloat16)
        k, v = (torch.randn(1, KVH, 4096, D, dtype=torch.bfloat16) for _ in "kv")
        valid = torch.ones(1, 4096, dtype=torch.bool)
        tail = q[:, :, -1024:]
        best = best_in_turns({
            "prompt, tiles": lambda: kernels.amx_attention(q, k, v),
            "prompt, torch": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=True),
            "last chunk, tiles": lambda: kernels.amx_attention(tail, k, v),
            "last chunk, torch": lambda: _chunk_attention(tail, k, v, None, valid),
        }, turns=5, warm=True)
        report(name, best, ("prompt", "last chunk"))
    q = torch.randn(1, 4, 1024, 256, dtype=torch.bfloat16)
    runs = {}
    for case, S in {"first chunk": 1024, "later chunk": 1536}.items():
        k, v = (torch.randn(1, 1, S, 256, dtype=torch.bfloat16) for _ in "kv")
        place, key = torch.arange(1024)[:, None] + S - 1024, torch.arange(S)[None]
        band = (key <= place) & (key > place - 512)
        runs[f"window, {case}, tiles"] = lambda k=k, v=v: kernels.amx_attention(q, k, v, 512)
        runs[f"window, {case}, torch"] = lambda k=k, v=v, band=band: (
            F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=True))
    report("Gemma 3 270M", best_in_turns(runs, turns=5, warm=True),
           ("window, first chunk", "window, later chunk"))


def attention_against(rev: str, turns: int = 25) -> None:
    """tg_amx_attention of this tree against that of git revision ``rev`` (its amx.c, the
    other sources this tree's), both built side by side and called in alternation: the median
    of the turns' ratios, which a machine whose speed drifts within the minute leaves fair,
    and whether both give the same bits. SmolLM2's heads (9, 3 of 64) and Gemma 3 270M's (4, 1
    of 256), the last chunk of 1,024 queries of a 4,096-token prompt, and SmolLM2's first."""
    import ctypes
    import shutil
    import statistics
    import tempfile

    import torch

    from tiergen import kernels

    root = Path(kernels.__file__).parent
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for name, amx in (("tree", (root / "amx.c").read_text()),
                          (rev, subprocess.run(["git", "show", f"{rev}:tiergen/kernels/amx.c"],
                                               cwd=root, check=True, capture_output=True,
                                               text=True).stdout)):
            d = Path(tmp) / str(len(libs))
            shutil.copytree(root, d, ignore=shutil.ignore_patterns("__pycache__"))
            (d / "amx.c").write_text(amx)
            kernels._compile(d / "lib.so", sources=[d / s.name for s in kernels.SOURCES],
                             timeout=600)
            libs[name] = kernels.bind(ctypes.CDLL(str(d / "lib.so")))
        for H, KVH, D, S, T in ((9, 3, 64, 4096, 1024), (4, 1, 256, 4096, 1024),
                                (9, 3, 64, 1024, 1024)):
            q = torch.randn(1, H, T, D, dtype=torch.bfloat16)
            k, v = (torch.randn(1, KVH, S, D, dtype=torch.bfloat16) for _ in "kv")
            outs, times = {}, {name: [] for name in libs}
            for _ in range(turns):
                for name, lib in libs.items():
                    out = torch.empty(1, T, H, D).transpose(1, 2)
                    start = time.perf_counter()
                    assert lib.tg_amx_attention(
                        q.data_ptr(), 2, *q.stride()[:3], k.data_ptr(), v.data_ptr(), 2,
                        *k.stride()[:2], 1, H, KVH, T, S, D, 0, D**-0.5, out.data_ptr(),
                        *out.stride()[:3]) == 0
                    times[name].append(time.perf_counter() - start)
                    outs[name] = out
            ratio = statistics.median(b / a for a, b in zip(times["tree"], times[rev]))
            print(f"heads {H}/{KVH} of {D}, {T} queries over {S} keys: tree "
                  f"{min(times['tree']) * 1e3:.2f} ms, {rev} {min(times[rev]) * 1e3:.2f} ms "
                  f"(best of {turns}); tree {ratio:.3f}x (median of the turns' ratios); "
                  f"same bits: {torch.equal(outs['tree'], outs[rev])}")


def packed_against(rev: str, turns: int = 9) -> None:
    """tg_amx_linear (a packed matrix decoded into panels, multiplied on the tiles) of this
    tree against that of git revision ``rev`` (all its C sources), both built and called in
    alternation: the best of each, the median of the turns' ratios, and whether both give the
    same bits. SmolLM2's Q4_1 gate and up and down, Q4_K and Q6_K ones of a 1,024-wide model,
    a Q8_0 matrix; 32 rows (a short prompt, an expert's few tokens), 128 and 1,024 (a long prompt's
    chunk). Sixteen copies of each matrix, taken in turn, so that its blocks come from memory."""
    import tempfile

    import torch

    from bench_int8 import builds, in_turns, random_packed
    from tiergen import kernels

    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(rev, Path(tmp))
        for lib in libs.values():
            kernels.bind(lib)
        for name, n, k in (("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q4_K", 2048, 1024),
                           ("Q6_K", 1024, 2048), ("Q8_0", 3072, 576)):
            ws = [random_packed(getattr(GGMLType, name), n, k) for _ in range(16)]
            for m in (32, 128, 1024):
                x = torch.randn(m, k)
                outs = {}
                for key, lib in libs.items():
                    kernels._lib = lib
                    outs[key] = kernels.amx_linear(x, ws[0])
                kernels._lib = libs["this tree"]

                def run() -> float:
                    start = time.perf_counter()
                    for w in ws:
                        kernels.amx_linear(x, w)
                    return (time.perf_counter() - start) / len(ws) * 1e3

                best, ratio = in_turns(libs, run, turns if m < 1024 else 5, rev)
                print(f"{name} {n} x {k}, {m} rows: tree {best['this tree']:.3f} ms, {rev} "
                      f"{best[rev]:.3f} ms; tree {ratio:.2f}x (median of the turns' ratios); "
                      f"same bits: {torch.equal(outs['this tree'], outs[rev])}", flush=True)


def prompt_threshold(against: int, model: str, turns: int = 7) -> None:
    """Prompts of 16-96 tokens, one and a batch of 32 (``model``, one new token), with this
    tree's kernels.AMX_PROMPT and with ``against`` in its place, in turns in one process: the
    best of each and the median of the turns' ratios."""
    import statistics

    import torch

    from tiergen import LLM, SamplingParams, kernels

    llm = LLM(model)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ours, gen = kernels.AMX_PROMPT, torch.Generator().manual_seed(0)
    for batch, length in ((1, 16), (1, 32), (1, 64), (1, 96), (32, 16), (32, 32), (32, 64),
                          (32, 96)):
        ids = torch.randint(100, 40000, (batch, length), generator=gen).tolist()
        best, ratios = {ours: 1e9, against: 1e9}, []
        for turn in range(turns):
            took = {}
            for threshold in (ours, against) if turn % 2 else (against, ours):
                kernels.AMX_PROMPT = threshold
                start = time.perf_counter()
                llm.generate(ids, params)
                took[threshold] = time.perf_counter() - start
                best[threshold] = min(best[threshold], took[threshold])
            ratios.append(took[against] / took[ours])
        kernels.AMX_PROMPT = ours
        print(f"{batch} x {length} tokens: AMX_PROMPT {ours} {best[ours] * 1e3:.1f} ms, "
              f"{against} {best[against] * 1e3:.1f} ms; {ours} {statistics.median(ratios):.2f}x "
              f"(median of the turns' ratios)", flush=True)


def report(name: str, best: dict, cases: tuple[str, ...]) -> None:
    for case in cases:
        tiles, torch_ = best[f"{case}, tiles"], best[f"{case}, torch"]
        print(f"{name}, {case}: tiles {tiles * 1e3:.1f} ms, torch {torch_ * 1e3:.1f} ms, "
              f"{torch_ / tiles:.2f}x")


def best_in_turns(runs: dict, turns: int, calls: int = 1, warm: bool = False) -> dict:
    """Seconds a call of each of ``runs`` (name -> function) took at best, over ``turns``
    turns that time each in order, ``calls`` calls at a time (``warm``: one call before)."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(turns):
        for name, run in runs.items():
            if warm:
                run()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def packed() -> None:
    """One product of a prompt chunk (512 rows) by a Q4_1 matrix: amx.c (decoding into the
    tiles' layout, float32 sums out) against decoding to float32, rounding to bfloat16 and
    torch's matmul on the tiles, best of five each, in turns."""
    import torch
    import torch.nn.functional as F

    from bench_int8 import random_packed
    from tiergen import kernels

    def onednn(x, w):
        dense = kernels.dequantize_into(w, torch.empty(w.shape))
        return F.linear(x.bfloat16(), dense.bfloat16()).float()

    print("\n| m x k x n | amx.c ms | oneDNN ms | oneDNN's matmul alone ms | amx.c TFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for m, k, n in SHAPES[1:] + [(512, 1536, 576), (512, 576, 3072)]:
        w = random_packed(GGMLType.Q4_1, n, k)
        x = torch.randn(m, k)
        half, xb = w.dequantize().bfloat16(), x.bfloat16()
        runs = {"amx": lambda: kernels.amx_linear(x, w), "onednn": lambda: onednn(x, w),
                "matmul": lambda: F.linear(xb, half)}
        best = {name: t * 1e3 for name, t in best_in_turns(runs, 5, warm=True).items()}
        print(f"| {m} x {k} x {n} | {best['amx']:.2f} | {best['onednn']:.2f} | "
              f"{best['matmul']:.2f} | {2 * m * k * n / best['amx'] / 1e9:.2f} |")


def panels() -> None:
    """amx.c's packed product alone (tg_amx_linear into buffers made once), Q4_1 matrices of
    SmolLM2's MLP at 512 and 4,096 rows, best of five."""
    import torch

    from bench_int8 import random_packed
    from tiergen import kernels
    from tiergen.weights.packed import layout

    lib = kernels.library()
    for n, k in ((3072, 576), (576, 1536)):
        w = random_packed(GGMLType.Q4_1, n, k)
        (ggml_type, _, _, start, _), = layout(w.shape, w.parts)
        for m in (512, 4096):
            x, y = torch.randn(m, k).bfloat16(), torch.empty(m, n)
            run = {"amx": lambda: lib.tg_amx_linear(ggml_type, w.data.data_ptr() + start, n, k,
                                                    x.data_ptr(), m, y.data_ptr(), n)}
            print(f"{n} x {k}, {m} rows: {best_in_turns(run, 5, warm=True)['amx'] * 1e3:.2f} ms")


def glu() -> None:
    """act(gate) * up at 4,096 rows (SmolLM2's SiLU, Gemma 3's GELU): written rounded to
    bfloat16 against written in float32 and then rounded (kernels.to_bfloat16), best of
    twenty each, in turns."""
    import torch

    from tiergen import kernels

    for width, gelu in ((1536, False), (2048, True)):
        gu = torch.randn(4096, 2 * width)
        wide, half = torch.empty(4096, width), torch.empty(4096, width, dtype=torch.bfloat16)
        runs = {"rounded": lambda: kernels.glu(gu, gelu, half, bfloat16=True),
                "float32": lambda: kernels.to_bfloat16(kernels.glu(gu, gelu, wide), half)}
        best = {name: t * 1e3 for name, t in best_in_turns(runs, 20).items()}
        print(f"{width} wide, {'GELU' if gelu else 'SiLU'}: rounded as written "
              f"{best['rounded']:.2f} ms, float32 then rounded {best['float32']:.2f} ms")


def mlp() -> None:
    """kernels.amx_glu (gate and up on the tiles, act(gate) * up as they come out) against
    its two calls (rounded_linear's product, then glu), in turns: alone on SmolLM2's Q4_1 and
    Gemma 3's Q5_0 gate and up at 1,024 and 4,096 rows (best and median of fifteen), then in
    generate (amx_glu switched off for the other turns; median of seven turns' ratios): one
    4,096-token prompt and 32 prompts of 128, prefill only."""
    import statistics

    import torch

    from bench_int8 import random_packed
    from tiergen import LLM, SamplingParams, kernels
    from tiergen.weights.packed import cat_rows

    for name, ggml_type, width, k in (("SmolLM2", GGMLType.Q4_1, 1536, 576),
                                      ("Gemma 3", GGMLType.Q5_0, 2048, 640)):
        gate_up = cat_rows([random_packed(ggml_type, width, k), random_packed(ggml_type, width, k)])
        for rows in (1024, 4096):
            x = torch.randn(rows, k)
            runs = {"one pass": lambda: kernels.amx_glu(x, gate_up, False),
                    "two calls": lambda: kernels.glu(kernels.rounded_linear(x, gate_up), False,
                                                     bfloat16=True)}
            times: dict[str, list[float]] = {n: [] for n in runs}
            for _ in range(15):
                for n, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[n].append(time.perf_counter() - start)
            print(f"{name} gate and up, {rows} rows: " + ", ".join(
                f"{n} {min(t) * 1e3:.2f} ms (median {statistics.median(t) * 1e3:.2f})"
                for n, t in times.items()))
    one_pass = kernels.amx_glu
    for model in ("smollm2", "gemma3-270m"):
        llm = LLM(model)
        params = SamplingParams(max_tokens=1, temperature=0)
        for batch, length in ((1, 4096), (32, 128)):
            ids = torch.randint(100, 40000, (batch, length),
                                generator=torch.Generator().manual_seed(0)).tolist()
            llm.generate([ids[0][:300]], params)
            times = {"one pass": [], "two calls": []}
            for _ in range(7):
                for n, glu in (("one pass", one_pass), ("two calls", lambda *a: None)):
                    kernels.amx_glu = glu
                    start = time.perf_counter()
                    llm.generate(ids, params)
                    times[n].append(time.perf_counter() - start)
            kernels.amx_glu = one_pass
            ratio = statistics.median(b / a for a, b in zip(times["one pass"], times["two calls"]))
            print(f"{model}, {batch} x {length} prefill: " + ", ".join(
                f"{n} {batch * length / min(t):.0f} tok/s" for n, t in times.items())
                + f"; one pass {ratio:.3f}x (median of the turns' ratios)", flush=True)


def rounding() -> None:
    """A cache slice (2, 3, 3001, 64 of 4,100 slots) to bfloat16, float16 and float32:
    kernels.to_bfloat16 against Tensor.bfloat16(), best of twenty each, in turns."""
    import torch

    from tiergen import kernels

    for dtype in (torch.float16, torch.float32):
        t = torch.randn(2, 3, 4100, 64).to(dtype)[:, :, :3001]
        runs = {"tiergen": lambda: kernels.to_bfloat16(t), "torch": lambda: t.bfloat16()}
        best = {name: t * 1e3 for name, t in best_in_turns(runs, 20).items()}
        print(f"{dtype}: tiergen {best['tiergen']:.3f} ms, torch {best['torch']:.3f} ms")


def dense() -> None:
    """SmolLM2's matrices and LM head in bfloat16, as a checkpoint stores them, by rows:
    amx.c (kernels.dense_bfloat16_linear) against torch's F.linear (oneDNN on the tiles), best
    of five each, in turns."""
    import torch
    import torch.nn.functional as F

    from tiergen import kernels

    print("| rows | k x n | oneDNN us | amx.c us | ratio |")
    print("|---:|---|---:|---:|---:|")
    for m in (1, 8, 32, 64, 96, 128, 256, 512):
        for k, n in ((576, 960), (576, 3072), (1536, 576), (576, 49152)):
            x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
            runs = {"onednn": lambda: F.linear(x, w),
                    "amx": lambda: kernels.dense_bfloat16_linear(x, w)}
            best = {name: t * 1e6 for name, t in best_in_turns(runs, 5, calls=10).items()}
            print(f"| {m} | {k} x {n} | {best['onednn']:.0f} | {best['amx']:.0f} | "
                  f"{best['onednn'] / best['amx']:.2f}x |", flush=True)


def prompt(tiles: str) -> None:
    import torch

    from tiergen import LLM, SamplingParams, kernels

    if tiles == "off":
        kernels.AMX_PROMPT = 10**9
    elif tiles == "onednn":
        kernels.amx_linear = lambda x, w: None
    llm = LLM("smollm2")
    ids = torch.randint(100, 40000, (4096,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([ids[:600]], params)  # warm-up
    start = time.perf_counter()
    llm.generate([ids], params)
    print(f"tiles {tiles}: {4096 / (time.perf_counter() - start):.0f} tok/s")


MOE = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
           num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=32,
           num_experts_per_tok=4, moe_intermediate_size=512, max_position_embeddings=4096)
SHAPES_MOE = {"qwen3-moe": MOE, "qwen2-moe": MOE | dict(shared_expert_intermediate_size=2048)}


def moe_gguf(directory: Path, case: str) -> Path:
    """The random MoE Q4_0 GGUF of --experts shaped as ``case``, written once."""
    path = directory / f"{case}-q4_0.gguf"
    if not path.exists():
        import gguf

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from test_gguf_moe import write_moe_gguf
        from tiny_models import build

        hf = build(case, directory / case, **SHAPES_MOE[case])
        write_moe_gguf(hf, directory / case, case, path, gguf.GGMLQuantizationType.Q4_0)
    return path


def experts(path: str, tiles: str, chunk: int) -> None:
    import torch

    import tiergen.models.moe as moe
    from tiergen import LLM, SamplingParams

    if tiles == "none":
        moe._tokens_mlp = lambda mlp, x, tiles: mlp(x)
    elif tiles == "all":
        moe.routed_on_tiles = lambda cfg: True
    llm = LLM(path, prefill_chunk_size=chunk)
    ids = torch.randint(10, MOE["vocab_size"], (2048,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([ids[:300]], params)  # warm-up
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        llm.generate([ids], params)
        best = max(best, len(ids) / (time.perf_counter() - start))
    print(f"{Path(path).stem}, chunks of {chunk}, experts on the tiles: {tiles}: "
          f"{best:.0f} tok/s (best of two)")


def kld(model: str) -> None:
    """The first 1,024 tokens of tests/data/perplexity.txt, prompt chunks of 512."""
    from tiergen import LLM, kernels

    text = (Path(__file__).resolve().parent.parent / "tests" / "data" / "perplexity.txt").read_text()
    ref = LLM(model, activations="float32")
    ids = ref.encode(text)[:1024]
    f = ref.logits(ids).float().log_softmax(-1)
    del ref
    llm = LLM(model, activations="int8")
    for name, rows in (("int8 tiles", 10**9), ("AMX bfloat16", 128)):
        kernels.AMX_PROMPT = rows
        q = llm.logits(ids).float().log_softmax(-1)
        kl = (f.exp() * (f - q)).sum(-1)
        top = (f.argmax(-1) == q.argmax(-1)).float().mean()
        print(f"{model} {name}: mean KLD {kl.mean():.5f}, p99 {kl.quantile(0.99):.4f}, "
              f"same top token {100 * top:.1f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--attention-against", metavar="REV")
    ap.add_argument("--packed-against", metavar="REV")
    ap.add_argument("--prompt", action="store_true")
    ap.add_argument("--amx-prompt-against", type=int, metavar="TOKENS")
    ap.add_argument("--model", default="smollm2", help="with --amx-prompt-against")
    ap.add_argument("--kld", action="store_true")
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--experts", action="store_true")
    ap.add_argument("--rounding", action="store_true")
    ap.add_argument("--dense", action="store_true")
    ap.add_argument("--panels", action="store_true")
    ap.add_argument("--glu", action="store_true")
    ap.add_argument("--mlp", action="store_true")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/tiergen-amx-moe"))
    ap.add_argument("--child-prompt", choices=["on", "onednn", "off"], help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--child-experts", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_prompt:
        return prompt(args.child_prompt)
    if args.child_experts:
        return experts(*args.child_experts, args.chunk)
    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])}), {args.threads} threads; "
          f"AMX usable: {amx_usable()}")
    if args.attention:
        return attention()
    if args.attention_against:
        return attention_against(args.attention_against)
    if args.packed_against:
        return packed_against(args.packed_against)
    if args.amx_prompt_against:
        return prompt_threshold(args.amx_prompt_against, args.model)
    if args.prompt:  # each in a fresh process
        for mode in ("on", "onednn", "off"):
            subprocess.run([sys.executable, __file__, "--child-prompt", mode], check=True)
        return
    if args.packed:
        return packed()
    if args.rounding:
        return rounding()
    if args.dense:
        return dense()
    if args.panels:
        return panels()
    if args.glu:
        return glu()
    if args.mlp:
        return mlp()
    if args.experts:
        for case in SHAPES_MOE:
            path = moe_gguf(args.dir, case)
            for _ in range(2):
                for tiles in ("tiergen", "all", "none"):
                    subprocess.run([sys.executable, __file__, "--child-experts", str(path), tiles,
                                    "--chunk", str(args.chunk)], check=True)
        return
    if args.kld:
        for model in ("smollm2", "gemma3-270m"):
            kld(model)
        return
    capped, free = rates(args.threads, ONEDNN_CAP), rates(args.threads, None)
    print("\n| m x k x n | capped at AVX512_CORE_BF16 TFLOP/s | tiergen's choice TFLOP/s | ratio |")
    print("|---|---:|---:|---:|")
    for (m, k, n), c, f in zip(SHAPES, capped, free):
        print(f"| {m} x {k} x {n} | {c:.3f} | {f:.3f} | {f / c:.1f}x |")


if __name__ == "__main__":
    main()
