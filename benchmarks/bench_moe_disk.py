"""Routed experts read from disk only when routed: a DeepSeek-V3-shaped model (random
bfloat16 weights, over 10 GB of routed experts) under a host budget far below its size, the
routed experts on disk (``Policy(experts="disk")``).

The other weights (1 GB) are resident, mapped from the checkpoint's files; the routed experts
are read from those files expert by expert, and every file under --dir is evicted from the
page cache every 0.2 s (pages mapped into the process stay: the resident weights). The host
cache of experts is off (``--expert-cache 0``) unless asked for: this measures the reads.
Reported per decode step: the bytes read from storage (``/proc/self/io``) against the bytes
of the experts its tokens routed to (each layer's distinct chosen experts times an expert's
bytes, recorded from the router), and the seconds per step. The checkpoint is built once in --dir.

    python benchmarks/bench_moe_disk.py [--dir /var/tmp/tiergen-v3] [--host-memory 4G]
        [--batch 1,8] [--prompt-len 16] [--gen-len 16] [--expert-cache 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_scale import machine, read_bytes  # noqa: E402

# DeepSeek-V3's architecture at a size this machine's disk holds: 11 MoE layers of 64
# experts of 17.3 MB (12.2 GB of routed experts), 6 chosen of 8 groups' best 4.
CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=32000,
    hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408, num_hidden_layers=12,
    first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")


def build(directory: Path) -> Path:
    """The checkpoint, one safetensors file per layer (written once; a complete one has its
    index)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return directory
    from tiergen.config import from_hf_config
    from tiergen.models import build_model

    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(from_hf_config(CONFIG))
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    parts = [("globals", model.global_specs())] + [
        (f"layer{j}", model.layer_specs(j)) for j in range(CONFIG["num_hidden_layers"])]
    for part, specs in tqdm(parts, desc="building random checkpoint", unit="part"):
        tensors = {}
        for name, shape in specs.items():
            if name.endswith("e_score_correction_bias"):
                t = torch.randn(shape, generator=gen) * 0.1
            elif len(shape) == 1:
                t = torch.ones(shape)
            else:
                t = torch.randn(shape, generator=gen) * 0.02
            tensors[name] = t.to(torch.bfloat16)
        save_file(tensors, directory / f"{part}.safetensors", metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, f"{part}.safetensors")
    (directory / "config.json").write_text(json.dumps(CONFIG))
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def count_routed(expert_bytes: int) -> list[int]:
    """A counter ([bytes]) that the router, from now on, adds each MoE layer call's distinct
    chosen experts to, at ``expert_bytes`` each."""
    import tiergen.models.moe as moe

    routed, route, one_token = [0], moe.route, moe.moe_row

    def counting(cfg, x, gate, *biases):
        ids, weights = route(cfg, x, gate, *biases)
        routed[0] += len(set(ids.flatten().tolist())) * expert_bytes
        return ids, weights

    def counting_one(*args):  # (one token's routing and experts in one call)
        done = one_token(*args)
        if done is not None:
            routed[0] += len(set(done[1].flatten().tolist())) * expert_bytes
        return done

    moe.route, moe.moe_row = counting, counting_one
    return routed


def child(a: argparse.Namespace) -> dict:
    import tiergen  # noqa: F401  (the CPU guard first)
    from tiergen import LLM, Policy, SamplingParams

    policy = Policy(experts="disk", offload_dir=str(Path(a.dir) / "offload"),
                    expert_cache=a.expert_cache)
    llm = LLM(Path(a.dir) / "model", dtype="bfloat16", policy=policy, host_memory=a.host_memory)
    cfg = llm.config
    expert_bytes = 3 * cfg.hidden_size * cfg.moe.intermediate_size * 2
    routed = count_routed(expert_bytes)
    import random

    rng = random.Random(0)
    ids = [[rng.randrange(2, cfg.vocab_size) for _ in range(a.prompt_len)]
           for _ in range(int(a.batch))]
    # the prompt step alone, then the whole run: the decode steps are the difference
    marks = []
    for new in (1, a.gen_len):
        routed[0], before = 0, read_bytes()
        llm.generate(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        marks.append((read_bytes() - before, routed[0], llm.last_stats.decode_seconds))
    (read1, routed1, _), (read, routed_all, decode_s) = marks
    steps = a.gen_len - 1
    return dict(batch=int(a.batch), read_per_step=(read - read1) / steps,
                routed_per_step=(routed_all - routed1) / steps,
                step_s=decode_s / steps, expert_bytes=expert_bytes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/var/tmp/tiergen-v3")
    p.add_argument("--host-memory", default="4G")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--expert-cache", default="0")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    from bench_plan import PageCacheEvictor

    a.dir = str(Path(a.dir).resolve())
    directory = build(Path(a.dir) / "model")
    files = sorted(directory.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"{machine()}; checkpoint "
          f"{size / 1e9:.1f} GB bfloat16; host budget {a.host_memory}; prompts of "
          f"{a.prompt_len} tokens, {a.gen_len} new; page cache evicted")
    print("| batch | GB read per decode step | GB of routed experts per step | ratio | "
          "s per step |")
    print("|---|---|---|---|---|")
    for batch in a.batch.split(","):
        cmd = [sys.executable, __file__, "--child", "--dir", a.dir, "--host-memory",
               a.host_memory, "--batch", batch, "--prompt-len", str(a.prompt_len),
               "--gen-len", str(a.gen_len), "--expert-cache", a.expert_cache]
        with PageCacheEvictor(Path(a.dir), period=0.2):
            done = subprocess.run(cmd, capture_output=True, text=True,
                                  env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
        if done.returncode:
            print(f"| {batch} | failed: {done.stderr.strip().splitlines()[-1]} | | | |")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {r['batch']} | {r['read_per_step'] / 1e9:.3f} | "
              f"{r['routed_per_step'] / 1e9:.3f} | "
              f"{r['read_per_step'] / max(r['routed_per_step'], 1):.2f} | {r['step_s']:.2f} |")


if __name__ == "__main__":
    main()
