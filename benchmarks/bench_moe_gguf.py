"""tiergen against llama.cpp on a DeepSeek-V3-shaped or GLM-4.5-Air-shaped (--shape) Q4_0 GGUF
whose routed experts (over 10 GB) do not fit the host budget: each engine runs in a memory cgroup of --host-memory (page
cache included), with the file's pages evicted every 0.2 s as ``bench_scale.py`` does.

tiergen keeps attention, shared experts and the dense layer resident and reads the routed
experts from disk only when routed (``Policy(experts="disk")``, packed Q4_0), keeping those
read in its expert cache (half of what the budget leaves; also run without it); llama.cpp maps
the file (``use_mmap``), with its default repacking of Q4_0 weights into anonymous memory
and without it (``--no-repack``). Reported: decode tokens/s of one prompt, bytes read per
decode step, minor page faults per step (memory touched for the first time, or a mapped
file's pages), and for tiergen the bytes of the experts its tokens routed to and its cache's
hits. The file (random weights, a placeholder vocabulary, llama.cpp's deepseek2 or glm4moe
layout) is built once in --dir; DeepSeek's attention's k_b and v_b are Q8_0, or float32 with
--kb-type F32.

    python benchmarks/bench_moe_gguf.py [--shape deepseek-v3|glm-4.5-air]
        [--dir /var/tmp/tiergen-v3-gguf] [--host-memory 4G]
        [--prompt-len 16] [--gen-len 16] [--repeat 3] [--engines tiergen llamacpp-no-repack]
        [--kb-type Q8_0|F32] [--llamacpp-python .peers/llamacpp-venv/bin/python]

With --repeat N every engine runs N times, the engines in turns (this machine's speed drifts
between runs; turns see the same drift), and the table gives each one's median run by step
time, then the ratio of each turn and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_scale import prompts, read_bytes, rss_peak  # noqa: E402

@dataclass(frozen=True)
class Shape:
    """A model's architecture at this machine's size: one dense layer, then MoE layers whose
    routed experts (Q4_0) are over 10 GB; a 32,000-token placeholder vocabulary."""

    arch: str  # llama.cpp's architecture
    hidden: int
    layers: int
    heads: int
    dense: int  # the dense layer's intermediate size
    expert: int  # a routed expert's intermediate size
    experts: int
    used: int
    shared: int
    scale: float  # routed_scaling_factor
    groups: tuple[int, int] = (1, 1)  # (n_group, topk_group)
    kv_heads: int = 0  # grouped attention (GLM, MiniMax): its K/V heads, head size, rotary part
    head_dim: int = 0
    rotary: int = 0
    qk_norm: str = ""  # "head": q and k normalised per head (GLM-4.5); "all": over all heads
    vocab: int = 32000

    @property
    def grouped(self) -> bool:
        return self.arch != "deepseek2"


SHAPES = {
    # DeepSeek-V3: 11 MoE layers of 192 experts of 4.9 MB, 6 chosen of 8 groups' best 4, two
    # shared experts; latent attention (Q_RANK, KV_RANK, NOPE, ROPE, V below)
    "deepseek-v3": Shape("deepseek2", hidden=2048, layers=12, heads=16, dense=5632, expert=1408,
                         experts=192, used=6, shared=2, scale=2.5, groups=(8, 4)),
    # GLM-4.5-Air's own widths (hidden 4096, 96 heads of 128 with 8 K/V heads, half of each
    # head rotating, q/k/v biases, 128 experts of 1408 choosing 8, one shared): 10 MoE layers
    # of 8.7 MB experts. (The file has no multi-token-prediction layer.)
    "glm-4.5-air": Shape("glm4moe", hidden=4096, layers=11, heads=96, dense=10944, expert=1408,
                         experts=128, used=8, shared=1, scale=1.0, kv_heads=8, head_dim=128,
                         rotary=64),
    # for --resident-batch, in three layers (4-6 GB): GLM-4.5 (hidden 5120, 96 heads of 128
    # with 8 K/V heads normalised per head, half rotating, 160 experts of 1536 choosing 8, one
    # shared) and MiniMax-M2 (hidden 3072, 48 heads of 128 with 8 K/V heads normalised over
    # all heads, 64 channels rotating, 256 experts of 1536 choosing 8; no shared expert and no
    # dense layer)
    "glm-4.5": Shape("glm4moe", hidden=5120, layers=3, heads=96, dense=12288, expert=1536,
                     experts=160, used=8, shared=1, scale=2.5, kv_heads=8, head_dim=128,
                     rotary=64, qk_norm="head"),
    "minimax-m2": Shape("minimax-m2", hidden=3072, layers=3, heads=48, dense=0, expert=1536,
                        experts=256, used=8, shared=0, scale=1.0, kv_heads=8, head_dim=128,
                        rotary=64, qk_norm="all"),
}
Q_RANK, KV_RANK, NOPE, ROPE, V = 768, 512, 128, 64, 128


Q4, Q8 = "Q4_0", "Q8_0"


def file_name(shape: str = "deepseek-v3", kb_type: str = Q8) -> str:
    """The file of ``shape``, for DeepSeek-V3 whose attention's k_b and v_b are ``kb_type``
    (Q8_0 by default, as those who quantise these models keep them: the absorbed attention
    multiplies them at every token; or F32), the rest Q4_0."""
    if shape != "deepseek-v3":
        return f"{shape}-q4_0.gguf"
    return f"model-kb-{kb_type.lower()}.gguf"


def attention_tensors(m: Shape, b: str, kb_type: str) -> list[tuple[str, tuple[int, ...], str | None]]:
    H = m.hidden
    if m.grouped:
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        biases = m.arch == "glm4moe"
        out = [(b + "attn_q.weight", (q, H), Q4), (b + "attn_q.bias", (q,), None),
               (b + "attn_k.weight", (kv, H), Q4), (b + "attn_k.bias", (kv,), None),
               (b + "attn_v.weight", (kv, H), Q4), (b + "attn_v.bias", (kv,), None),
               (b + "attn_output.weight", (H, q), Q4)]
        out = [t for t in out if biases or not t[0].endswith("bias")]
        if m.qk_norm:
            per = m.qk_norm == "head"
            out += [(b + "attn_q_norm.weight", (m.head_dim if per else q,), None),
                    (b + "attn_k_norm.weight", (m.head_dim if per else kv,), None)]
        norm = "post_attention_norm" if m.arch == "glm4moe" else "ffn_norm"
        return out + [(b + f"{norm}.weight", (H,), None)]
    kb = None if kb_type == "F32" else kb_type
    return [(b + "attn_q_a.weight", (Q_RANK, H), Q4), (b + "attn_q_a_norm.weight", (Q_RANK,), None),
            (b + "attn_q_b.weight", (m.heads * (NOPE + ROPE), Q_RANK), Q4),
            (b + "attn_kv_a_mqa.weight", (KV_RANK + ROPE, H), Q4),
            (b + "attn_kv_a_norm.weight", (KV_RANK,), None),
            (b + "attn_k_b.weight", (m.heads, KV_RANK, NOPE), kb),
            (b + "attn_v_b.weight", (m.heads, V, KV_RANK), kb),
            (b + "attn_output.weight", (H, m.heads * V), Q4),
            (b + "ffn_norm.weight", (H,), None)]


def tensors(m: Shape, kb_type: str = Q8) -> list[tuple[str, tuple[int, ...], str | None]]:
    """(GGUF name, torch shape, block type or None for float32) in file order."""
    H = m.hidden
    out = [("token_embd.weight", (m.vocab, H), Q4)]
    for j in range(m.layers):
        b = f"blk.{j}."
        out += [(b + "attn_norm.weight", (H,), None), *attention_tensors(m, b, kb_type)]
        if j == 0 and m.dense:
            out += [(b + "ffn_gate.weight", (m.dense, H), Q4),
                    (b + "ffn_up.weight", (m.dense, H), Q4),
                    (b + "ffn_down.weight", (H, m.dense), Q4)]
            continue
        s, E = m.shared * m.expert, m.experts
        out += [(b + "ffn_gate_inp.weight", (E, H), None),
                (b + "exp_probs_b.bias", (E,), None),
                (b + "ffn_gate_exps.weight", (E, m.expert, H), Q4),
                (b + "ffn_up_exps.weight", (E, m.expert, H), Q4),
                (b + "ffn_down_exps.weight", (E, H, m.expert), Q4)]
        if s:
            out += [(b + "ffn_gate_shexp.weight", (s, H), Q4),
                    (b + "ffn_up_shexp.weight", (s, H), Q4),
                    (b + "ffn_down_shexp.weight", (H, s), Q4)]
    return out + [("output_norm.weight", (H,), None), ("output.weight", (m.vocab, H), Q4)]


def random_q4_0(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 blocks (as bytes) whose values have a std of about 1/sqrt(row length)."""
    blocks = int(np.prod(shape)) // 32
    out = np.empty((blocks, 18), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, blocks) / (4.6 * shape[-1] ** 0.5)).astype(np.float16)
    out[:, :2] = scale.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = np.frombuffer(rng.bytes(blocks * 16), dtype=np.uint8).reshape(-1, 16)
    return out.reshape(*shape[:-1], shape[-1] // 32 * 18)


def random_q8_0(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random Q8_0 blocks (as bytes), values of a std of about 1/sqrt(row length)."""
    blocks = int(np.prod(shape)) // 32
    out = np.empty((blocks, 34), dtype=np.uint8)
    scale = (rng.uniform(0.5, 1.5, blocks) / (73 * shape[-1] ** 0.5)).astype(np.float16)
    out[:, :2] = scale.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = rng.integers(-127, 128, (blocks, 32), dtype=np.int8).view(np.uint8)
    return out.reshape(*shape[:-1], shape[-1] // 32 * 34)


def build(path: Path, m: Shape, kb_type: str = Q8) -> Path:
    """Write the GGUF once (under a temporary name, renamed when complete)."""
    if path.exists():
        return path
    import gguf
    from tqdm import tqdm

    from scale_model import _write_vocab

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), m.arch)
    w.add_context_length(4096)
    w.add_embedding_length(m.hidden)
    w.add_block_count(m.layers)
    w.add_feed_forward_length(m.dense or m.expert)
    w.add_head_count(m.heads)
    if m.grouped:
        w.add_head_count_kv(m.kv_heads)
        w.add_key_length(m.head_dim)
        w.add_value_length(m.head_dim)
        w.add_rope_dimension_count(m.rotary)
    else:
        w.add_head_count_kv(1)  # as llama.cpp's converter: MLA as one latent KV head
        w.add_key_length(KV_RANK + ROPE)
        w.add_value_length(KV_RANK)
        w.add_key_length_mla(NOPE + ROPE)
        w.add_value_length_mla(V)
        w.add_rope_dimension_count(ROPE)
        w.add_q_lora_rank(Q_RANK)
        w.add_kv_lora_rank(KV_RANK)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(m.vocab)
    w.add_expert_feed_forward_length(m.expert)
    w.add_expert_count(m.experts)
    w.add_expert_used_count(m.used)
    if m.arch != "minimax-m2":  # (MiniMax-M2: no dense layer, no shared expert, renormalised)
        w.add_leading_dense_block_count(1)
        w.add_expert_shared_count(m.shared)
        w.add_expert_weights_scale(m.scale)
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if m.groups[0] > 1:
        w.add_expert_group_count(m.groups[0])
        w.add_expert_group_used_count(m.groups[1])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    _write_vocab(w, m.vocab)
    for name, shape, qtype in tensors(m, kb_type):
        if qtype:
            t = gguf.GGMLQuantizationType[qtype]
            nbytes = gguf.quant_shape_to_byte_shape(shape, t)
            w.add_tensor_info(name, nbytes, np.uint8, int(np.prod(nbytes)), raw_dtype=t)
        else:
            w.add_tensor_info(name, shape, np.float32, 4 * int(np.prod(shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape, qtype in tqdm(tensors(m, kb_type), desc="writing the GGUF", unit="tensor"):
        if qtype:
            data = (random_q4_0 if qtype == Q4 else random_q8_0)(shape, rng)
        elif name.endswith("norm.weight"):
            data = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            data = (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
        w.write_tensor_data(data)
    w.close()
    os.rename(tmp, path)
    return path


def expert_nbytes(m: Shape) -> int:
    return 3 * m.expert * m.hidden // 32 * 18


def child_tiergen(a: argparse.Namespace) -> dict:
    import tiergen  # noqa: F401  (the CPU guard first)
    from tiergen import LLM, Policy, SamplingParams

    from bench_moe_disk import count_routed  # (here: llama.cpp's child has no torch)

    t = time.perf_counter()
    policy = Policy(experts="disk", offload_dir=str(Path(a.dir) / "offload"),
                    expert_cache=0 if a.child == "tiergen-no-cache" else None)
    llm = LLM(a.gguf, policy=policy, host_memory=a.host_memory)
    load = time.perf_counter() - t
    routed = count_routed(expert_nbytes(SHAPES[a.shape]))
    # bytes read and routed from the first decode step on (the prompt's step is the first
    # call of forward_block)
    marks, forward = [], llm.executor.forward_block

    def marking(*args, **kwargs):
        marks.append((read_bytes(), routed[0], minor_faults()))
        return forward(*args, **kwargs)

    llm.executor.forward_block = marking
    out = llm.generate(prompts(1, a.prompt_len, SHAPES[a.shape].vocab),
                       SamplingParams(max_tokens=a.gen_len, temperature=0, ignore_eos=True))
    steps = a.gen_len - 1
    read = (read_bytes() - marks[1][0]) / steps
    routed_per_step = (routed[0] - marks[1][1]) / steps
    faults = (minor_faults() - marks[1][2]) / steps
    step_s = llm.last_stats.decode_seconds / steps
    cache = llm.executor.weights.expert_cache
    return dict(load_s=load, step_s=step_s, read_per_step=read, routed_per_step=routed_per_step,
                faults_per_step=faults, rss=rss_peak(), tokens=out[0].token_ids, cache_gb=cache.capacity / 1e9,
                hit_rate=cache.hits / max(cache.hits + cache.misses, 1))


def child_llamacpp(a: argparse.Namespace) -> dict:
    import llama_cpp
    import llama_cpp.llama_cpp as api

    if a.child == "llamacpp-no-repack":  # llama.cpp's --no-repack: weights stay in the map
        defaults = api.llama_model_default_params

        def no_repack():
            params = defaults()
            params.use_extra_bufts = False
            return params

        api.llama_model_default_params = no_repack
    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=a.prompt_len + a.gen_len + 8,
                          n_threads=os.cpu_count(), n_batch=512, use_mmap=True, verbose=False,
                          logits_all=True)  # (without it, 0.3.36 leaves scores at zero)
    load = time.perf_counter() - t
    llm.eval(prompts(1, a.prompt_len, SHAPES[a.shape].vocab)[0])
    tokens = [int(llm.scores[llm.n_tokens - 1].argmax())]
    before, faults, t = read_bytes(), minor_faults(), time.perf_counter()
    for _ in range(a.gen_len - 1):
        llm.eval([tokens[-1]])
        tokens.append(int(llm.scores[llm.n_tokens - 1].argmax()))
    steps = a.gen_len - 1
    return dict(load_s=load, step_s=(time.perf_counter() - t) / steps,
                read_per_step=(read_bytes() - before) / steps,
                faults_per_step=(minor_faults() - faults) / steps, rss=rss_peak(), tokens=tokens)


def minor_faults() -> int:
    """Page faults of this process served without reading storage: memory first touched,
    or a file's pages mapped from the page cache."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def in_cgroup(limit: str) -> str | None:
    """A memory cgroup (v1 or v2) limited to ``limit`` for the children, or None where this
    machine gives none."""
    from tiergen.offload.policy import parse_size

    for root, name in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"),
                       ("/sys/fs/cgroup", "memory.max")):
        group = Path(root) / "tiergen-bench"
        try:
            group.mkdir(exist_ok=True)
            (group / name).write_text(str(parse_size(limit)))
            return str(group)
        except OSError:
            continue
    return None


def run(a: argparse.Namespace, engine: str, group: str | None) -> dict:
    from bench_plan import PageCacheEvictor

    python = a.llamacpp_python if engine.startswith("llamacpp") else sys.executable
    cmd = [python, str(HERE / "bench_moe_gguf.py"), "--child", engine, "--dir", a.dir,
           "--host-memory", a.host_memory, "--prompt-len", str(a.prompt_len),
           "--gen-len", str(a.gen_len), "--kb-type", a.kb_type, "--shape", a.shape]

    def enter_group() -> None:
        if group:
            Path(group, "cgroup.procs").write_text(str(os.getpid()))

    with PageCacheEvictor(Path(a.dir), period=0.2):
        done = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=enter_group,
                              env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    if done.returncode:
        tail = done.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


ENGINES = ("tiergen", "tiergen-no-cache", "llamacpp", "llamacpp-no-repack")


def median_run(results: list[dict]) -> dict:
    """The run of median step time (a failure, if any run failed)."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    ranked = sorted(results, key=lambda r: r["step_s"])
    return ranked[(len(ranked) - 1) // 2] | {
        "step_times": [round(r["step_s"], 4) for r in results],
        "reads": [round(r["read_per_step"] / 1e6, 1) for r in results]}


def resident(a: argparse.Namespace) -> None:
    """The file's experts resident in both engines: ``tiergen bench --against llama.cpp`` at
    a.resident_batch prompts (of 128 tokens and 64 new by default), a.repeat turns."""
    cmd = [sys.executable, "-m", "tiergen.cli", "bench", "--model", a.gguf, "--batch",
           str(a.resident_batch), "--against", "llama.cpp", "--turns", str(max(a.repeat, 1))]
    if a.prompt_len != 16 or a.gen_len != 16:  # (this script's defaults are the disk run's)
        cmd += ["--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len)]
    subprocess.run(cmd, check=True, cwd=HERE.parent)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="deepseek-v3", choices=SHAPES)
    p.add_argument("--dir", default="/var/tmp/tiergen-v3-gguf")
    p.add_argument("--host-memory", default="4G")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--resident-batch", type=int, help="instead: experts resident, a batch of "
                   "this many prompts, through `tiergen bench --against llama.cpp`")
    p.add_argument("--kb-type", default=Q8, choices=(Q8, "F32"),
                   help="the type of the attention's k_b and v_b in the file")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--llamacpp-python", default=".peers/llamacpp-venv/bin/python")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.dir = str(Path(a.dir).resolve())
    a.gguf = str(Path(a.dir) / file_name(a.shape, a.kb_type))
    if a.child:
        fn = child_llamacpp if a.child.startswith("llamacpp") else child_tiergen
        print(json.dumps(fn(a)))
        return
    from bench_scale import machine

    m = SHAPES[a.shape]
    build(Path(a.gguf), m, a.kb_type)
    if a.resident_batch:
        return resident(a)
    group = in_cgroup(a.host_memory)
    experts = (m.layers - 1) * m.experts * expert_nbytes(m)
    print(f"{machine()}; {a.shape}-shaped {Path(a.gguf).stat().st_size / 1e9:.1f} GB Q4_0 GGUF, "
          f"{experts / 1e9:.1f} GB of routed experts; host budget {a.host_memory} "
          f"({'memory cgroup' if group else 'no cgroup: page cache evicted only'}); one prompt "
          f"of {a.prompt_len} tokens, {a.gen_len} new; page cache evicted every 0.2 s")
    # a first run, not reported: whatever tiergen converts into its offload directory
    # (nothing, for this file: the experts are read from it) is written once
    first = run(a, "tiergen", group)
    if "error" in first:
        print(f"tiergen failed: {first['error']}")
    # llama.cpp by default copies Q4_0 weights into its repacked CPU layout (anonymous memory,
    # so the whole model must fit the budget); --no-repack multiplies them in the map
    runs: dict[str, list[dict]] = {e: [] for e in a.engines}
    for turn in range(a.repeat):  # the order alternating, so that neither always goes first
        for e in a.engines[::-1] if turn % 2 else a.engines:
            runs[e].append(run(a, e, group))
    results = {e: median_run(r) for e, r in runs.items()}
    print("| engine | decode tok/s | s per step | GB read per step | GB routed per step | "
          "expert cache | minor faults per step | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|")
    for engine, r in results.items():
        if "error" in r:
            print(f"| {engine} | failed: {r['error']} | | | | | | |")
            continue
        routed = f"{r['routed_per_step'] / 1e9:.3f}" if "routed_per_step" in r else "-"
        cache = (f"{r['cache_gb']:.2f} GB, {100 * r['hit_rate']:.0f} % hits in the run"
                 if "cache_gb" in r else "-")
        print(f"| {engine} | {1 / r['step_s']:.2f} | {r['step_s']:.3f} | "
              f"{r['read_per_step'] / 1e9:.3f} | {routed} | {cache} | "
              f"{r['faults_per_step']:,.0f} | {r['rss'] / 1e9:.2f} |")
    if a.repeat > 1:
        for engine, r in results.items():
            if "step_times" in r:
                print(f"{engine}: s per step in each run {r['step_times']}, MB read per step "
                      f"{r['reads']}")
    for ours in ("tiergen", "tiergen-no-cache"):
        for peer in ("llamacpp", "llamacpp-no-repack"):
            if all(e in results and "error" not in results[e] for e in (ours, peer)):
                print(f"{ours} / {peer} decode: "
                      f"{results[peer]['step_s'] / results[ours]['step_s']:.2f}x")
                turns = [p["step_s"] / o["step_s"] for o, p in zip(runs[ours], runs[peer])
                         if "error" not in o and "error" not in p]
                if len(turns) > 1:
                    print(f"  turn by turn: {', '.join(f'{r:.2f}x' for r in turns)}; median "
                          f"{statistics.median(turns):.2f}x")


if __name__ == "__main__":
    main()
