"""Does DeepSeek Sparse Attention pay on a long context? One decode step of a DeepSeek-V3.2-
shaped attention layer (128 heads, a 512 + 64 latent, 64 indexer heads of 128, top 2,048;
random weights, the cache filled with random rows) over contexts of 2k, 8k and 32k tokens at
batch 1 and 8: sparse attention against the same layer's dense latent attention (the V3 path,
the same weights without the indexer), in turns, float32 on the CPU with the cache in host
RAM.

    python benchmarks/bench_sparse_attention.py [--contexts 2048,8192,32768] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from tiergen.bench import cpu_description
from tiergen.cache.kv import LatentKVView
from tiergen.cache.step import StepMeta
from tiergen.config import MLAConfig, ModelConfig, MoEConfig
from tiergen.models.deepseek_v2 import DeepseekV2

MLA = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                v_head_dim=128, index_heads=64, index_head_dim=128, index_topk=2048)


def model(sparse: bool) -> DeepseekV2:
    # one dense-MLP layer (the MLP is not what differs); V3.2's widths otherwise
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=256, dense_layers=[0],
                    scoring="sigmoid", router_bias=True, topk_method="noaux_tc")
    cfg = ModelConfig("DeepseekV32ForCausalLM" if sparse else "DeepseekV3ForCausalLM",
                      vocab_size=1024, hidden_size=7168, intermediate_size=256, num_layers=1,
                      num_heads=128, num_kv_heads=128, head_dim=192, max_position=163840,
                      moe=moe, mla=MLA if sparse else replace(MLA, index_heads=0,
                                                              index_head_dim=0, index_topk=0))
    return DeepseekV2(cfg)


def weights(m: DeepseekV2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=g) * s[-1] ** -0.5 if len(s) > 1
                else torch.ones(s)) for n, s in m.fused_specs(0).items()}


def step(m: DeepseekV2, w: dict, cache: torch.Tensor, batch: int, context: int) -> float:
    """Seconds of one decode step of the attention (and the small MLP) over ``context``."""
    valid = torch.zeros(batch, cache.shape[3], dtype=torch.bool)
    valid[:, :context + 1] = True
    meta = StepMeta.build(valid, context, 1)
    shared = m.prepare(meta, torch.float32)
    h = torch.randn(batch, 1, m.cfg.hidden_size)
    view = LatentKVView(cache, MLA.kv_lora_rank)
    t = time.perf_counter()
    m.layer(0, w, h, meta, view, shared)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    print(cpu_description(), f"threads={torch.get_num_threads()}")
    sparse, dense = model(True), model(False)
    w_sparse = weights(sparse)
    w_dense = {n: t for n, t in w_sparse.items() if not n.startswith("index_")}
    print("| batch | context | sparse ms | dense (V3) ms | dense / sparse |")
    print("|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            width = sparse.cfg.kv_layout()[2]
            cache = torch.randn(1, batch, 1, context + 1, width)
            # the dense path's cache: the same rows without their indexer key, contiguous
            latent = cache[..., :-MLA.index_head_dim].contiguous()
            times = {"sparse": [], "dense": []}
            for _ in range(args.turns):  # in turns
                times["sparse"].append(step(sparse, w_sparse, cache, batch, context))
                times["dense"].append(step(dense, w_dense, latent, batch, context))
            s, d = min(times["sparse"]), min(times["dense"])
            print(f"| {batch} | {context} | {1e3 * s:.1f} | {1e3 * d:.1f} | {d / s:.2f}x |")
            del cache, latent


if __name__ == "__main__":
    main()
