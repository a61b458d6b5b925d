"""Mixture of experts and latent attention on random models shaped like the real ones.

1. Mixtral-shaped (hidden 1024, 8 experts of 2048, top-2, 4 layers, bfloat16): tiergen with
   everything resident, with the routed experts in host RAM and with them on disk (only the
   chosen experts read), against transformers, at batch 1 and 32 (prompt 16, 32 new tokens).
2. DeepSeek-V2-Lite-shaped attention (hidden 2048, 16 heads, kv_lora_rank 512, RoPE key 64,
   nope 128, v 128, 2 layers): KV bytes per token, and decode throughput after a long prompt,
   absorbed MLA against the naive path that decompresses the cache every step.

    python benchmarks/bench_moe.py [--quick]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import tiergen  # noqa: F401  (first: the CPU guard must precede torch's first bfloat16 matmul)

import torch
import transformers

from tiergen import LLM, Policy, SamplingParams

DTYPE = torch.bfloat16


def random_model(config: transformers.PretrainedConfig, directory: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(directory)
    return directory


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab - 10, (n, length), generator=g).tolist()


def tiergen_rate(directory: Path, policy: Policy, ps: list[list[int]], new: int) -> float:
    llm = LLM(directory, dtype="bfloat16", policy=policy)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(ps[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    t = time.perf_counter()
    llm.generate(ps, params)
    return len(ps) * new / (time.perf_counter() - t)


def transformers_rate(directory: Path, ps: list[list[int]], new: int) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=DTYPE).eval()
    ids = torch.tensor(ps)
    hf.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return len(ps) * new / (time.perf_counter() - t)


def mixtral(work: Path, quick: bool) -> None:
    cfg = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2 if quick else 4,
        num_attention_heads=16, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096)
    directory = random_model(cfg, work / "mixtral")
    print("## Mixtral-shaped model (8 experts, top-2, hidden 1024), bfloat16, prompt 16, 32 new tokens\n")
    print("| batch | tiergen resident | experts in host RAM | experts on disk | transformers | resident / transformers |")
    print("|---|---|---|---|---|---|")
    new = 8 if quick else 32
    for batch in (1, 32):
        ps = prompts(batch, 16, cfg.vocab_size)
        rates = [tiergen_rate(directory, Policy(), ps, new),
                 tiergen_rate(directory, Policy(experts="host"), ps, new),
                 tiergen_rate(directory, Policy(experts="disk", offload_dir=work / "offload"), ps, new),
                 transformers_rate(directory, ps, new)]
        print(f"| {batch} | " + " | ".join(f"{r:.1f} tok/s" for r in rates)
              + f" | {rates[0] / rates[3]:.2f}x |", flush=True)


def deepseek(work: Path, quick: bool) -> None:
    cfg = transformers.DeepseekV2Config(
        vocab_size=32000, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=16384)
    directory = random_model(cfg, work / "deepseek")
    llm = LLM(directory, dtype="bfloat16")
    c = llm.config
    latent = c.kv_bytes_per_token(2) // c.num_layers
    naive = 2 * c.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) * 2  # k and v per head
    print("\n## DeepSeek-V2-Lite-shaped attention (16 heads, kv_lora_rank 512, RoPE 64), bfloat16\n")
    print(f"KV cache per token per layer: {latent} bytes (latent c_kv + k_pe) against "
          f"{naive} bytes for the same heads' decompressed keys and values "
          f"({naive / latent:.1f}x more).\n")
    print("| context | batch | absorbed decode | naive decode | absorbed / naive |")
    print("|---|---|---|---|---|")
    new = 8 if quick else 16
    for context in ((512,) if quick else (1024, 4096)):
        ps = prompts(4, context, cfg.vocab_size)
        rates = []
        for absorb in (True, False):
            llm.executor.model.absorb = absorb
            llm.generate(ps, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
            s = llm.last_stats
            rates.append(s.decode_tokens / s.decode_seconds)
        print(f"| {context} | 4 | {rates[0]:.1f} tok/s | {rates[1]:.1f} tok/s | "
              f"{rates[0] / rates[1]:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tiergen-bench-moe-"))
    try:
        mixtral(work, args.quick)
        deepseek(work, args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n(torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads)", file=sys.stderr)


if __name__ == "__main__":
    main()
