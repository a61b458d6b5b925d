"""Tiny random models built with transformers' own config classes, saved as checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=256, rms_norm_eps=1e-5)

# name -> (config class, extra config fields)
CASES: dict[str, tuple[str, dict]] = {
    "llama-mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                           tie_word_embeddings=True)),
    "llama-mqa-headdim": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1,
                                              head_dim=24, attention_bias=True)),
    # llama3 scaling with an original context of 16, so test prompts run past it.
    "llama3-rope": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0,
                                                             factor=8.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0,
                                                             original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=None)),
    # a window of 8: prompts and generation run far past it (rolling cache)
    "mistral-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=8)),
    # Gemma 3: local layers (windows 4 and 8) interleaved with global ones, each with its own
    # RoPE base; query_pre_attn_scalar differs from head_dim, so the attention scale matters.
    "gemma3-window4": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=100000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=1000.0)))),
    "gemma3-window8-linear": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        sliding_window=8, sliding_window_pattern=2, final_logit_softcapping=5.0,
        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0,
                                                 rope_theta=1000000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0)))),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2)),
    # YaRN on a Llama-family model: its ramp of frequencies and the factor on cos and sin
    "qwen2-yarn": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                       rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                            factor=4.0,
                                                            original_max_position_embeddings=16))),
    # use_sliding_window: layer 0 attends to everything, layers 1 and 2 to a window of 8
    "qwen2-window": ("Qwen2Config", dict(num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2, use_sliding_window=True,
                                         sliding_window=8, max_window_layers=1)),
    # Mixture of experts: 4 experts, 2 per token (Mixtral: softmax over the chosen two).
    "mixtral": ("MixtralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      num_local_experts=4, num_experts_per_tok=2)),
    # shared expert with its sigmoid gate; layer 0 dense (mlp_only_layers); biased q/k/v
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=48,
                                         shared_expert_intermediate_size=80,
                                         mlp_only_layers=[0])),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         num_experts=6, num_experts_per_tok=3,
                                         moe_intermediate_size=32, norm_topk_prob=True)),
    # DeepSeek-V2 with q_lora_rank (V2) and without (V2-Lite); 3 layers with the first dense,
    # group-limited routing, shared experts, YaRN with mscale corrections, a routed scale.
    "deepseek-v2": ("DeepseekV2Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=24,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=16, mscale=1.0,
                             mscale_all_dim=0.707, beta_fast=32, beta_slow=1))),
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, topk_method="greedy")),
    # DeepSeek-V3 (Kimi K2's architecture): sigmoid routing with a learned bias (randomised in
    # build), groups scored by their best two, normalised and scaled weights; rope in halves.
    "deepseek-v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=24,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=False)),
    # gpt-oss: attention sinks, sliding (window 8) and full layers, q/k/v/o biases, YaRN, a
    # router with a bias and a softmax over the chosen experts, clamped SwiGLU experts with
    # biases (a low limit, so that the clamps act).
    "gpt-oss": ("GptOssConfig", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=8,
        swiglu_limit=1.0,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                             beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=16))),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  tie_word_embeddings=True)),
    # GLM-4.5: half of each head rotates, q/k/v biases, per-head q/k norms, the first layer
    # dense, DeepSeek-V3's sigmoid routing over groups with shared experts and a scale.
    "glm4-moe": ("Glm4MoeConfig", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, moe_intermediate_size=24, first_k_dense_replace=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5)),
    # GLM-4.7-Flash: DeepSeek-V3's latent attention and routing under GLM's names
    "glm4-moe-lite": ("Glm4MoeLiteConfig", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
        routed_scaling_factor=1.5)),
    # DeepSeek-V3.2: V3 with sparse attention, each query over the 8 rows its indexer (32
    # heads of 16) scores best: prompts and generation run several times past 8. (With few
    # heads, scores tie at 0 where all heads' products are negative, and transformers'
    # topk breaks ties in no defined order: see test_moe's test of tied choices.)
    "deepseek-v32": ("DeepseekV32Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=24,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        index_topk=8, index_head_dim=16, index_n_heads=32)),
    # GLM-5: V3.2's sparse attention with the indexer's RoPE in pairs, and a layer that
    # reuses the choice of the layer before it
    "glm-moe-dsa": ("GlmMoeDsaConfig", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=24,
        first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=32,
        indexer_types=["full", "shared", "full"])),
    # Qwen3-Next: three Gated DeltaNet layers (2 key heads shared by 4 value heads, a
    # convolution of 4) and a gated attention layer (a quarter of each head rotating); experts
    # with a gated shared one, layer 1 dense.
    "qwen3-next": ("Qwen3NextConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32, mlp_only_layers=[1])),
    # Qwen3.5 (text): Qwen3-Next's layers with each in-projection apart; dense, and with
    # experts (no dense MLP: no intermediate_size)
    "qwen3.5": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4)),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=32)),
    # Kimi-Linear: KDA layers (0 and 2) and latent attention without rotation (1 and 3); layer
    # 0's MLP dense, the others DeepSeek-V3's experts with a shared one
    "kimi-linear": ("KimiLinearConfig", dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=24,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=8,
        linear_num_heads=4, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "full_attention"])),
    # MiniMax-M2: a quarter of each head rotates, q and k each normalised over all heads
    # together, sigmoid routing with a bias and no shared expert
    "minimax-m2": ("MiniMaxM2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=8,
        num_local_experts=6, num_experts_per_tok=2, intermediate_size=40,
        bos_token_id=None, eos_token_id=None)),
}


def build(case: str, directory: Path, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Create the random model for ``case`` (its config fields changed by ``overrides``), save
    it to ``directory`` and return it (float32)."""
    cls_name, extra = CASES[case]
    config = getattr(transformers, cls_name)(**(BASE | extra | overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; widen them so greedy tokens are well separated.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.std() == 0:  # norms: ones -> something non-trivial
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros: choosing would ignore it
                b.normal_(0, 0.3)
    model.eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    return model
