"""``tiergen bench``: throughput of a model and policy on this machine, batch size by batch size.

The protocol: ``batch`` prompts of ``prompt_len`` token ids each, ``gen_len`` greedy new tokens
each (EOS ignored), one warm-up run, then one timed run per batch size. It reports tokens per
second of decode and of the whole run (prefill included), and the process's peak resident
memory, with the CPU model and its SIMD flags (numbers mean something only next to a peer
measured on the same machine).

With ``--against llama.cpp,transformers`` the same workload runs on those peers too, each in a
fresh process at its best (llama.cpp with as many threads as tiergen; transformers in float32
and, where the CPU has native bfloat16, in bfloat16, the faster kept, without tiergen imported,
so that its oneDNN may use AMX), tiergen and the peers in turns (``--turns``): each turn's
ratio is tiergen's against the peer of the same turn, and the table gives their median.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tiergen._platform import cpu_flags, cpu_model
from tiergen.engine.sampler import SamplingParams
from tiergen.errors import TiergenError

SIMD_FLAGS = ("sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512bw", "avx512_vnni",
              "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")
PEERS = ("llama.cpp", "transformers")
# where `tiergen bench --against llama.cpp` looks for llama.cpp's Python binding, after
# $TIERGEN_LLAMA_CPP_PYTHON and this interpreter: .peers/ here, or beside the package
LLAMA_CPP_VENV = Path(".peers") / "llamacpp-venv" / "bin" / "python"
_VENVS = (LLAMA_CPP_VENV, Path(__file__).resolve().parents[1] / LLAMA_CPP_VENV)
LLAMA_CPP_HELP = ("llama.cpp's Python binding (llama-cpp-python) was not found: install it "
                  "(`pip install llama-cpp-python`) here or into .peers/llamacpp-venv, or set "
                  "TIERGEN_LLAMA_CPP_PYTHON to a Python that has it")


def cpu_description() -> dict:
    """CPU model name and the SIMD flags that decide which kernels run fast."""
    flags = cpu_flags()
    return {"cpu": cpu_model(), "simd": [f for f in SIMD_FLAGS if f in flags]}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """The benchmark's prompts: the same token ids for tiergen and every peer."""
    return [[(17 + 31 * i + 7 * t) % (vocab - 1) + 1 for t in range(prompt_len)]
            for i in range(batch)]


def run(llm, batch: int, prompt_len: int, gen_len: int) -> dict:
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompt_ids(batch, prompt_len, llm.config.vocab_size), params)
    seconds = time.perf_counter() - started
    s = llm.last_stats
    return {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
            "total_tok_s": batch * gen_len / seconds,
            "decode_tok_s": s.decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
            "prefill_tok_s": s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
            "seconds": seconds, "peak_rss_mb": peak_rss_mb()}


# Each peer runs as a child: it reads {"path", "prompts", "gen_len", "threads"} on stdin and
# prints one JSON line of total_tok_s, decode_tok_s and peak_rss_mb (its VmHWM: ru_maxrss
# would keep the parent's, from before the exec).
_PEAK = r'''
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
'''

_LLAMA_CPP = _PEAK + r'''
import json, sys, time
import numpy as np
import llama_cpp as L

job = json.load(sys.stdin)
prompts, G, threads = job["prompts"], job["gen_len"], job["threads"]
batch, P = len(prompts), len(prompts[0])
L.llama_backend_init()
model = L.llama_model_load_from_file(job["path"].encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch = batch * (P + G) + 64, 512, 512
cp.n_seq_max, cp.n_threads, cp.n_threads_batch = batch, threads, threads
cp.kv_unified = False  # each sequence attends over its own cells, not all of the batch's
ctx = L.llama_init_from_model(model, cp)
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
b = L.llama_batch_init(512, 0, batch)

def decode(items):  # items: (token, pos, seq, wants_logits); returns {seq: next token}
    out = {}
    for start in range(0, len(items), 512):
        chunk = items[start:start + 512]
        b.n_tokens = len(chunk)
        for i, (tok, pos, seq, want) in enumerate(chunk):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, want
        if L.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        for i, (tok, pos, seq, want) in enumerate(chunk):
            if want:
                logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))
                out[seq] = int(logits.argmax())
    return out

t0 = time.perf_counter()
nxt = decode([(tok, t, s, t == P - 1) for s, p in enumerate(prompts) for t, tok in enumerate(p)])
t1 = time.perf_counter()
for step in range(G - 1):
    nxt = decode([(nxt[s], P + step, s, True) for s in range(batch)])
t2 = time.perf_counter()
print(json.dumps({"total_tok_s": batch * G / (t2 - t0),
                  "decode_tok_s": batch * (G - 1) / (t2 - t1) if G > 1 else None,
                  "peak_rss_mb": peak()}))
'''

_TRANSFORMERS = _PEAK + r'''
import json, sys, time
from pathlib import Path
import torch, transformers

job = json.load(sys.stdin)
torch.set_num_threads(job["threads"])
path = Path(job["path"])  # a checkpoint directory, or a GGUF file read dequantised
extra = {} if path.is_dir() else {"gguf_file": path.name}
model = transformers.AutoModelForCausalLM.from_pretrained(
    path if path.is_dir() else path.parent, dtype=getattr(torch, job["dtype"]), **extra).eval()
ids = torch.tensor(job["prompts"])
G = job["gen_len"]

def generate(n):
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t

generate(2)  # warm-up
first, total = generate(1), generate(G)
print(json.dumps({"total_tok_s": len(ids) * G / total,
                  "decode_tok_s": len(ids) * (G - 1) / (total - first) if G > 1 else None,
                  "peak_rss_mb": peak()}))
'''


def llama_cpp_python() -> str | None:
    """An interpreter that can import llama_cpp (only $TIERGEN_LLAMA_CPP_PYTHON where it is
    set), or None."""
    chosen = os.environ.get("TIERGEN_LLAMA_CPP_PYTHON")
    candidates = [chosen] if chosen else [sys.executable, *map(str, _VENVS)]
    for python in candidates:
        if python == sys.executable:
            import importlib.util
            if importlib.util.find_spec("llama_cpp") is not None:
                return python
        elif Path(python).exists():
            return python
    return None


def model_file(model: str) -> Path:
    """The file or directory a model name stands for (a packaged model's GGUF)."""
    from tiergen.weights import SHORT_NAMES, _packaged_file

    return _packaged_file(model) if model in SHORT_NAMES else Path(model)


def peer_runner(peer: str, model: str):
    """A function running the peer on (prompts, gen_len, threads) and returning its figures,
    or a sentence saying why the peer cannot run here."""
    path = model_file(model)
    if peer == "llama.cpp":
        python = llama_cpp_python()
        if python is None:
            return LLAMA_CPP_HELP
        if path.suffix != ".gguf":
            return f"llama.cpp runs GGUF files; {path} is not one"
        return lambda prompts, gen_len, threads: _child(
            python, _LLAMA_CPP, dict(path=str(path), prompts=prompts, gen_len=gen_len,
                                     threads=threads))
    if peer == "transformers":
        import importlib.util
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed here (`pip install transformers`)"
        from tiergen._platform import cpu_has_fast_bfloat16
        dtypes = ["float32"] + (["bfloat16"] if cpu_has_fast_bfloat16() else [])

        def best(prompts, gen_len, threads):
            runs = [{**_child(sys.executable, _TRANSFORMERS, dict(
                path=str(path), prompts=prompts, gen_len=gen_len, threads=threads, dtype=d)),
                "dtype": d} for d in dtypes]
            return max(runs, key=lambda r: r["total_tok_s"])
        return best
    raise TiergenError(f"--against: unknown peer {peer!r}; the peers are " + ", ".join(PEERS))


def _child(python: str, code: str, job: dict) -> dict:
    """Run a peer's child and read its figures; a failure names the peer's own error."""
    out = subprocess.run([python, "-c", code], input=json.dumps(job), capture_output=True,
                         text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        tail = "\n".join(out.stderr.strip().splitlines()[-5:])
        raise TiergenError(f"the peer's run failed ({python}):\n{tail}")
    return json.loads(lines[-1])


def against(llm, model: str, peers: list[str], batches: list[int], prompt_len: int,
            gen_len: int, turns: int, threads: int, say=print) -> dict:
    """tiergen (``llm``) and each peer that can run here on the same workload, in turns; the
    peers that cannot are named with how to get them. {batch: {engine: [run per turn]}}."""
    runners = {}
    for peer in peers:
        runner = peer_runner(peer, model)
        if isinstance(runner, str):
            say(f"{peer}: not run. {runner}")
        else:
            runners[peer] = runner
    results: dict[int, dict[str, list[dict]]] = {}
    for batch in batches:
        prompts = prompt_ids(batch, prompt_len, llm.config.vocab_size)
        runs: dict[str, list[dict]] = {"tiergen": []}
        for _ in range(turns):  # in turns, so that every engine sees the machine's drift
            runs["tiergen"].append(run(llm, batch, prompt_len, gen_len))
            for peer, runner in runners.items():
                runs.setdefault(peer, []).append(runner(prompts, gen_len, threads))
        results[batch] = runs
    return results


def ratio(mine: list[dict], theirs: list[dict], key: str) -> float | None:
    """The median over turns of tiergen's figure ``key`` against the peer's of the same turn."""
    pairs = [(m[key], t[key]) for m, t in zip(mine, theirs) if m.get(key) and t.get(key)]
    return statistics.median(a / b for a, b in pairs) if pairs else None


def median_run(runs: list[dict]) -> dict:
    """The run of median total throughput."""
    return sorted(runs, key=lambda r: r["total_tok_s"])[len(runs) // 2]


def table(results: dict[int, dict[str, list[dict]]], prompt_len: int, gen_len: int) -> str:
    """One markdown row per batch and engine: its median run, and for tiergen the median of
    each turn's ratio against every peer, decode and total."""
    peers = sorted({p for r in results.values() for p in r if p != "tiergen"})
    head = ["batch", "engine", "decode tok/s", "total tok/s", "peak RSS",
            *(f"vs {p} (decode / total)" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda x, spec=".1f": "-" if x is None else format(x, spec)  # noqa: E731
    for batch, runs in results.items():
        for engine, turns in runs.items():
            m = median_run(turns)
            name = engine + (f" ({m['dtype']})" if "dtype" in m else "")
            cells = [str(batch), name, fmt(m.get("decode_tok_s")), fmt(m["total_tok_s"]),
                     f"{m['peak_rss_mb']:.0f} MB"]
            for p in peers:
                cells.append("-" if engine != "tiergen" or p not in runs else
                             f"{fmt(ratio(turns, runs[p], 'decode_tok_s'), '.2f')}x / "
                             f"{fmt(ratio(turns, runs[p], 'total_tok_s'), '.2f')}x")
            lines.append("| " + " | ".join(cells) + " |")
    turns = max(len(t) for r in results.values() for t in r.values())
    lines.append(f"\n{prompt_len}-token prompts, {gen_len} greedy new tokens each; ratios: the "
                 f"median over {turns} turn(s) of tiergen against the peer of the same turn")
    return "\n".join(lines)
