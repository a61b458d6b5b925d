"""GGUF files as a model source: metadata into a ModelConfig, llama.cpp tensor names into
Hugging Face names, and llama.cpp's Q/K row permutation (Llama, Mistral) and +1 on norm
weights (Gemma) undone."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch

from tiergen.config import LinearAttentionConfig, MLAConfig, ModelConfig, MoEConfig, RopeConfig
from tiergen.errors import TiergenError
from tiergen.weights.gguf import GGUFFile, GGUFTensorInfo
from tiergen.weights.mapped import page_out_unused
from tiergen.weights.moe_names import checkpoint_names
from tiergen.weights.packed import PACKED_TYPES, Packed, narrow, packed_like
from tiergen.weights.quant import FLOAT_TYPES, GGMLType, dequantize, tensor_nbytes

# general.architecture -> Hugging Face architecture
GGUF_ARCHITECTURES = {
    "deepseek2": "DeepseekV2ForCausalLM",  # DeepseekV3ForCausalLM with sigmoid gating
    "deepseek32": "DeepseekV32ForCausalLM",
    "glm-dsa": "GlmMoeDsaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
    "kimi-linear": "KimiLinearForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM when it has experts
    "minimax-m2": "MiniMaxM2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
}

# llama.cpp's converter permuted these architectures' Q/K rows so that each head's rotary
# pairs lie side by side; they are multiplied as stored and rotated in pairs (RopeConfig.pairs).
PERMUTED_QK = {"llama", "mistral"}
_PLAIN = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# DeepSeek's latent attention. Newer converters split kv_b into k_b (heads, rank, nope),
# transposed, and v_b (heads, v, rank): the absorbed attention's own matrices, kept as they
# are (flattened to (heads * rank, nope) and (heads * v, rank), packed where quantised).
DEEPSEEK2_LAYER_NAMES = LAYER_NAMES | {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
}
# ... and sparse attention's indexer (DeepSeek-V3.2, GLM-5)
DSA_LAYER_NAMES = DEEPSEEK2_LAYER_NAMES | {
    "indexer.attn_q_b": "self_attn.indexer.wq_b",
    "indexer.attn_k": "self_attn.indexer.wk",
    "indexer.k_norm": "self_attn.indexer.k_norm",
    "indexer.proj": "self_attn.indexer.weights_proj",
}
LATENT_ARCHITECTURES = ("deepseek2", "deepseek32", "glm-dsa", "kimi-linear")
SPARSE_ATTENTION = ("deepseek32", "glm-dsa")

# A MoE layer's tensors (GGUF name less "blk.N."), by the keys of their checkpoint names in
# tiergen.weights.moe_names (checkpoint_names); *_exps tensors stack the routed experts
# (E, out, in).
# Newer converters may fuse gate and up into one (E, 2I, H): two keys, its halves.
MOE_NAMES = {
    "ffn_gate_inp.weight": ("router",),
    "ffn_gate_inp.bias": ("router_logit_bias",),
    "exp_probs_b.bias": ("router_bias",),
    "ffn_gate_exps.weight": ("gate",),
    "ffn_up_exps.weight": ("up",),
    "ffn_down_exps.weight": ("down",),
    "ffn_gate_up_exps.weight": ("gate", "up"),
    "ffn_gate_exps.bias": ("gate_bias",),
    "ffn_up_exps.bias": ("up_bias",),
    "ffn_down_exps.bias": ("down_bias",),
    "ffn_gate_up_exps.bias": ("gate_bias", "up_bias"),
    "ffn_gate_shexp.weight": ("shared_gate",),
    "ffn_up_shexp.weight": ("shared_up",),
    "ffn_down_shexp.weight": ("shared_down",),
    "ffn_gate_inp_shexp.weight": ("shared_expert_gate",),
}

# llama.cpp always renormalises the chosen experts' weights for these (it has no key for it)
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "gpt-oss": False,
             "qwen3next": True, "qwen35moe": True}

# gpt-oss and GLM-4.5: the norm before the MLP; gpt-oss's attention sinks (a vector named
# without .weight)
GPT_OSS_LAYER_NAMES = LAYER_NAMES | {"post_attention_norm": "post_attention_layernorm"}
UNSUFFIXED = {"attn_sinks": "self_attn.sinks"}

# Qwen3-Next's and Qwen3.5's Gated DeltaNet layers, as llama.cpp's converter writes them:
# q, k, v in one (attn_qkv) and z (attn_gate) apart; b and a grouped by key head in one
# (ssm_ba, Qwen3-Next) or apart (Qwen3.5); A_log kept as -exp(A_log); the convolution
# (channels, kernel); every (1 + w) norm but the gated one stored as 1 + w
LINEAR_GGUF = ("qwen3next", "qwen35", "qwen35moe")
LINEAR_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
UNSUFFIXED |= {"ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias"}

# Kimi-Linear: DeepSeek's latent attention layers, and Kimi Delta Attention layers whose q, k
# and v each have a convolution (1, channels, 1, kernel) and whose low-rank forget and output
# gates are f_a, f_b and g_a, g_b; A_log kept as -exp(A_log). One key per layer of
# head_count_kv says which kind it is: 1 latent attention, 0 KDA.
KIMI_LAYER_NAMES = DEEPSEEK2_LAYER_NAMES | {
    "ssm_conv1d_q": "self_attn.q_conv1d", "ssm_conv1d_k": "self_attn.k_conv1d",
    "ssm_conv1d_v": "self_attn.v_conv1d", "ssm_f_a": "self_attn.f_a_proj",
    "ssm_f_b": "self_attn.f_b_proj", "ssm_g_a": "self_attn.g_a_proj",
    "ssm_g_b": "self_attn.g_b_proj", "ssm_beta": "self_attn.b_proj",
    "ssm_norm": "self_attn.o_norm",
}
KIMI_UNSUFFIXED = UNSUFFIXED | {"ssm_a": "self_attn.A_log", "ssm_dt": "self_attn.dt_bias"}
# the architectures whose ssm_a holds -exp(A_log)
NEGATED_A = (*LINEAR_GGUF, "kimi-linear")

# Gemma 3 has four norms per layer; its ffn_norm is the one before the MLP.
GEMMA3_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# llama.cpp stores Gemma's RMSNorm weights w as 1 + w (its norm multiplies by the weight).
NORM_PLUS_ONE = {"gemma3"}

# Gemma 3 facts llama.cpp keeps in code rather than in the file (llama-model.cpp).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0

_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+(?:\.\w+)?)\.(weight|bias)|blk\.(\d+)\.(\w+)")


def hf_name(gguf_name: str, arch: str | None = None) -> str | None:
    """Hugging Face name of a GGUF tensor, or None for tensors tiergen does not use (or that
    are not one checkpoint tensor: see :func:`hf_expert_names`)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    names = {"gemma3": GEMMA3_LAYER_NAMES, "deepseek2": DEEPSEEK2_LAYER_NAMES,
             "deepseek32": DSA_LAYER_NAMES, "glm-dsa": DSA_LAYER_NAMES,
             "gpt-oss": GPT_OSS_LAYER_NAMES, "glm4moe": GPT_OSS_LAYER_NAMES,
             "kimi-linear": KIMI_LAYER_NAMES,
             **dict.fromkeys(LINEAR_GGUF, LINEAR_LAYER_NAMES)}.get(arch, LAYER_NAMES)
    unsuffixed = KIMI_UNSUFFIXED if arch == "kimi-linear" else UNSUFFIXED
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(4):  # a tensor named without .weight or .bias
        return (f"model.layers.{m.group(4)}.{unsuffixed[m.group(5)]}"
                if m.group(5) in unsuffixed else None)
    if m and m.group(2) in unsuffixed:
        return f"model.layers.{m.group(1)}.{unsuffixed[m.group(2)]}"
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def hf_expert_names(gguf_name: str, names: dict[str, str], num_experts: int
                    ) -> dict[str, tuple[int | None, int | None]]:
    """Hugging Face names (``names``: tiergen.weights.moe_names.checkpoint_names) of a MoE tensor of
    a GGUF file: {name: (expert, half)}, one name per routed expert for a stacked *_exps
    tensor (expert None: the whole tensor), and per half of a fused gate and up (half None:
    not fused)."""
    m = _LAYER_RE.fullmatch(gguf_name)
    keys = MOE_NAMES.get(f"{m.group(2)}.{m.group(3)}", ()) if m and m.group(1) else ()
    out: dict[str, tuple[int | None, int | None]] = {}
    for half, key in enumerate(keys):
        if key not in names:
            return {}
        template = f"model.layers.{m.group(1)}." + names[key]
        part = half if len(keys) == 2 else None
        if "{e}" not in template:
            out[template] = (None, part)
        else:
            out |= {template.format(e=e): (e, part) for e in range(num_experts)}
    return out


def config_from_gguf(meta: dict, tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise TiergenError(f"unsupported GGUF architecture {arch!r}; tiergen supports "
                           + ", ".join(f"{k} ({v})" for k, v in GGUF_ARCHITECTURES.items()))

    def key(name: str, default: object = None) -> object:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise TiergenError(f"GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise TiergenError("GGUF metadata gives no vocabulary size; the file is incomplete")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    rope = RopeConfig(theta=float(key("rope.freq_base", 10000.0)))
    if scaling == "linear":
        rope.kind, rope.factor = "linear", float(key("rope.scaling.factor"))
    elif scaling == "yarn":
        # llama.cpp keeps DeepSeek's mscale_all_dim as 0.1 x it, and mscale equal to it
        log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
        mscale = None if log_mul is None else float(log_mul) / 0.1
        rope = RopeConfig(theta=rope.theta, kind="yarn", factor=float(key("rope.scaling.factor")),
                          original_max_position=int(key("rope.scaling.original_context_length")),
                          beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                          beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                          mscale=mscale, mscale_all_dim=mscale)
    rope.pairs = arch in PERMUTED_QK
    # GLM-4.5's multi-token-prediction layers come after the model's own: skipped
    layers = int(key("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    architecture, extra = GGUF_ARCHITECTURES[arch], {}  # MoE, MLA, gpt-oss fields
    if arch in ("glm4moe", "minimax-m2"):  # partial rotary, halves split (llama.cpp's NEOX)
        extra = dict(moe=_sigmoid_moe(meta, arch, layers),
                     rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)))
        if arch == "minimax-m2":
            extra |= dict(qk_norm_across_heads=True)
    elif arch in LATENT_ARCHITECTURES:
        extra = _deepseek2_from_gguf(meta, arch, layers, tensor_names)
        mla = extra["mla"]
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        kv_heads = heads  # llama.cpp writes one latent KV head
        if extra["moe"].scoring == "sigmoid" and arch == "deepseek2":
            architecture = "DeepseekV3ForCausalLM"
        if arch == "kimi-linear":
            extra |= _kimi_linear_from_gguf(meta, arch, layers, heads)
    elif meta.get(f"{arch}.expert_count"):
        extra = _moe_from_gguf(meta, arch, layers, tensor_names)
        if arch == "llama":
            architecture = "MixtralForCausalLM"
    if arch in LINEAR_GGUF:
        extra |= _linear_from_gguf(meta, arch, layers, head_dim)
    if arch == "gpt-oss":
        # sliding and full layers alternate, the first sliding; its YaRN does not truncate
        extra |= dict(attention_sinks=True, layer_types=[
            "full_attention" if j % 2 else "sliding_attention" for j in range(layers)])
        rope.truncate = False
    gemma3 = (_gemma3_from_gguf(meta, arch, layers, hidden, heads, head_dim)
              if arch == "gemma3" else {})
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        # (Qwen3.5's mixtures of experts have no dense MLP, nor its size)
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or
                              key("expert_feed_forward_length" if arch == "qwen35moe"
                                  else "feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads if not hasattr(kv_heads, "__len__") else kv_heads[0]),
        head_dim=head_dim,
        max_position=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names or arch in LINEAR_GGUF,
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
        eos_token_ids=sorted(set(eos)),
        **gemma3,
        **extra,
    )


def _deepseek2_from_gguf(meta: dict, arch: str, layers: int, tensor_names: set[str]) -> dict:
    """DeepSeek-V2/V3's experts and latent attention (V3: sigmoid gating)."""
    def get(name: str, default: object = None) -> object:
        return meta.get(f"{arch}.{name}", default)

    rope_dim = int(get("rope.dimension_count"))
    qk_dim = int(get("attention.key_length_mla") or get("attention.key_length"))
    moe = _deepseek_moe(meta, arch, layers)
    mla = MLAConfig(q_lora_rank=int(get("attention.q_lora_rank", 0)) or None,
                    kv_lora_rank=int(get("attention.kv_lora_rank")),
                    qk_nope_head_dim=qk_dim - rope_dim, qk_rope_head_dim=rope_dim,
                    v_head_dim=int(get("attention.value_length_mla")
                                   or get("attention.value_length")),
                    kv_b_split=any(n.endswith("attn_k_b.weight") for n in tensor_names),
                    rotary=arch != "kimi-linear")  # (Kimi-Linear's attention rotates nothing)
    if arch in SPARSE_ATTENTION:  # a layer without an indexer reuses a choice
        shared = [f"blk.{j}.indexer.proj.weight" not in tensor_names for j in range(layers)]
        mla = replace(mla, index_heads=int(get("attention.indexer.head_count")),
                      index_head_dim=int(get("attention.indexer.key_length")),
                      index_topk=int(get("attention.indexer.top_k")),
                      index_rope_interleave=arch == "glm-dsa",
                      index_shared=shared if any(shared) else None)
    return dict(moe=moe, mla=mla)


def _deepseek_moe(meta: dict, arch: str, layers: int) -> MoEConfig:
    """DeepSeek's routed and shared experts as llama.cpp keeps them (V3's sigmoid gating:
    expert_gating_func 2), which GLM-4.5 and MiniMax-M2 route as too."""
    def get(name: str, default: object = None) -> object:
        return meta.get(f"{arch}.{name}", default)

    v3 = int(get("expert_gating_func", 2 if arch == "kimi-linear" else 1)) == 2
    groups = int(get("expert_group_count", 1) or 1)
    size = int(get("expert_feed_forward_length"))
    return MoEConfig(
        num_experts=int(get("expert_count")), top_k=int(get("expert_used_count")),
        intermediate_size=size,
        # llama.cpp always renormalises MiniMax-M2's and Kimi-Linear's chosen weights
        norm_topk_prob=bool(get("expert_weights_norm", arch in ("minimax-m2", "kimi-linear"))),
        shared_intermediate_size=size * int(get("expert_shared_count", 0)),
        dense_layers=list(range(min(int(get("leading_dense_block_count", 0)), layers))),
        router_float32=True, scoring="sigmoid" if v3 else "softmax", router_bias=v3,
        topk_method="noaux_tc" if v3 and arch != "minimax-m2"
        else "group_limited_greedy" if groups > 1 else "greedy",
        num_groups=groups, topk_groups=int(get("expert_group_used_count", 1) or 1),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0))


def _sigmoid_moe(meta: dict, arch: str, layers: int) -> MoEConfig:
    """GLM-4.5's and MiniMax-M2's experts: DeepSeek-V3's routing, refused where the file
    says another."""
    gating = int(meta.get(f"{arch}.expert_gating_func", 2))
    if gating != 2:
        raise TiergenError(f"GGUF {arch}.expert_gating_func is {gating}; tiergen runs {arch} "
                           "with sigmoid gating (2) only")
    return _deepseek_moe(meta, arch, layers)


def _moe_from_gguf(meta: dict, arch: str, layers: int, tensor_names: set[str]) -> dict:
    """The routed experts of a GGUF model; a layer without a router keeps a dense MLP."""
    if arch not in NORM_TOPK:
        raise TiergenError(f"GGUF architecture {arch!r} with experts is not supported")
    experts = int(meta[f"{arch}.expert_count"])
    top_k = int(meta.get(f"{arch}.expert_used_count", 0))
    size = meta.get(f"{arch}.expert_feed_forward_length", meta.get(f"{arch}.feed_forward_length"))
    shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
    if arch == "gpt-oss":  # llama.cpp's swiglu_oai has gpt-oss's alpha and limit built in
        return dict(moe=MoEConfig(
            num_experts=experts, top_k=top_k, intermediate_size=int(size), norm_topk_prob=False,
            scoring="topk_softmax", router_logit_bias=True, expert_bias=True,
            expert_act="clamped_swiglu"))
    return dict(moe=MoEConfig(
        num_experts=experts, top_k=top_k, intermediate_size=int(size),
        norm_topk_prob=NORM_TOPK[arch], shared_intermediate_size=shared,
        shared_gate=any(f"blk.{j}.ffn_gate_inp_shexp.weight" in tensor_names
                        for j in range(layers)),
        dense_layers=[j for j in range(layers)
                      if f"blk.{j}.ffn_gate_inp.weight" not in tensor_names]))


def _linear_from_gguf(meta: dict, arch: str, layers: int, head_dim: int) -> dict:
    """Qwen3-Next's and Qwen3.5's Gated DeltaNet layers (ssm.* keys) and their attention
    layers' partial rotary: every ``full_attention_interval``-th layer attends."""
    def get(name: str) -> int:
        value = meta.get(f"{arch}.{name}")
        if value is None:
            raise TiergenError(f"GGUF metadata lacks {arch}.{name}; the file is incomplete")
        return int(value)

    value_heads, every = get("ssm.time_step_rank"), int(meta.get(f"{arch}.full_attention_interval", 4))
    linear = LinearAttentionConfig(
        key_heads=get("ssm.group_count"), value_heads=value_heads,
        key_head_dim=get("ssm.state_size"), value_head_dim=get("ssm.inner_size") // value_heads,
        conv_kernel=get("ssm.conv_kernel"), grouped=False, ba_grouped=arch == "qwen3next",
        tiled=arch != "qwen3next")
    return dict(linear=linear, rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
                layer_types=["full_attention" if (j + 1) % every == 0 else "linear_attention"
                             for j in range(layers)])


def _kimi_linear_from_gguf(meta: dict, arch: str, layers: int, heads: int) -> dict:
    """Kimi-Linear's layer kinds (head_count_kv per layer: 1 latent attention, 0 KDA) and its
    KDA layers, which llama.cpp gives as many heads as the attention's."""
    kinds = meta.get(f"{arch}.attention.head_count_kv")
    if not hasattr(kinds, "__len__") or len(kinds) < layers:
        raise TiergenError(f"GGUF {arch}.attention.head_count_kv must give each layer's kind "
                           "(1 attention, 0 linear attention); the file is incomplete")
    dim, kernel = meta.get(f"{arch}.kda.head_dim"), meta.get(f"{arch}.ssm.conv_kernel")
    if dim is None or kernel is None:
        raise TiergenError(f"GGUF metadata lacks {arch}.kda.head_dim or {arch}.ssm.conv_kernel; "
                           "the file is incomplete")
    linear = LinearAttentionConfig(heads, heads, int(dim), int(dim), int(kernel), grouped=False,
                                   ba_grouped=False, per_channel=True)
    return dict(linear=linear, layer_types=["full_attention" if int(k) else "linear_attention"
                                            for k in list(kinds)[:layers]])


def _gemma3_from_gguf(meta: dict, arch: str, layers: int, hidden: int, heads: int,
                      head_dim: int) -> dict:
    """Gemma 3 fields, with llama.cpp's defaults for what converters do not write."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if hasattr(pattern, "__len__"):  # one flag per layer: True for sliding layers
        kinds = [bool(x) for x in pattern]
    else:
        kinds = [bool((i + 1) % int(pattern)) for i in range(layers)]
    softcap = {name: (None if meta.get(f"{arch}.{name}") is None else float(meta[f"{arch}.{name}"]))
               for name in ("final_logit_softcapping", "attn_logit_softcapping")}
    return dict(
        layer_types=["sliding_attention" if k else "full_attention" for k in kinds],
        rope_local=RopeConfig(theta=float(meta.get(f"{arch}.rope.freq_base_swa",
                                                   GEMMA3_LOCAL_ROPE_BASE))),
        hidden_act="gelu_pytorch_tanh",
        # llama.cpp scales by head_dim**-0.5, except for the 27B (62 layers): hidden/heads.
        query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim),
        **softcap,
    )


class GGUFSource:
    """Tensors of a GGUF file under Hugging Face names. Matrices in a block type tiergen
    multiplies packed come back as :class:`Packed` views of the file (no copy, no
    dequantisation) unless ``packed`` is False; everything else is dequantised on read."""

    def __init__(self, path: Path, packed: bool = True) -> None:
        self.file = GGUFFile(path)
        self.config = config_from_gguf(self.file.metadata, set(self.file.tensors))
        self.packed = packed
        self._arch = self.file.metadata["general.architecture"]
        # Hugging Face name -> (GGUF tensor, routed expert of a stacked tensor, half of a
        # fused gate and up); None: all of it
        self._names: dict[str, tuple[str, int | None, int | None]] = {}
        if self.config.moe:
            moe_names = checkpoint_names(self.config)
        for g in self.file.tensors:
            if (hf := hf_name(g, self._arch)) is not None:
                self._names[hf] = (g, None, None)
            elif self.config.moe:
                self._names |= {n: (g, *where) for n, where in hf_expert_names(
                    g, moe_names, self.config.moe.num_experts).items()}
        unpacked = sorted({info.type_name for info in self.file.tensors.values()
                           if packed and len(info.shape) >= 2
                           and info.ggml_type not in PACKED_TYPES | FLOAT_TYPES})
        if unpacked:
            logging.getLogger("tiergen").warning(
                "tiergen: %s: matrices in %s have no packed kernel; they are decoded to float "
                "at load (more memory)", path.name, ", ".join(unpacked))

    def has(self, name: str) -> bool:
        return name in self._names

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape (torch order), by its Hugging Face name."""
        return {name: self._info(name)[1] for name in self._names}

    def _info(self, name: str) -> tuple[GGUFTensorInfo, tuple[int, ...], int]:
        """The GGUF tensor holding ``name``, ``name``'s shape, and the offset of its bytes
        in that tensor (a routed expert's slice of a stacked tensor)."""
        g, e, half = self._names[name]
        info = self.file.tensors[g]
        shape, offset = info.shape, 0
        if e is not None:
            shape, offset = shape[1:], e * (info.nbytes // info.shape[0])
        if half is not None:  # rows are whole blocks: a half is half the bytes
            offset += half * tensor_nbytes(info.ggml_type, math.prod(shape)) // 2
            shape = (shape[0] // 2, *shape[1:])
        return info, self._plain_shape(name, shape), offset

    @staticmethod
    def _plain_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """llama.cpp keeps Qwen2-MoE's shared-expert gate (1, H) as a vector; DeepSeek's
        k_b and v_b, a matrix per head, are taken as one of the heads' rows."""
        if name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            return (1, *shape)
        if name.endswith(("k_b_proj.weight", "v_b_proj.weight")):
            return (shape[0] * shape[1], shape[2])
        if name.endswith("conv1d.weight") and len(shape) == 2:  # (channels, kernel)
            return (shape[0], 1, shape[1])
        if name.endswith("conv1d.weight") and len(shape) == 4:  # Kimi's (1, channels, 1, kernel)
            return (shape[1], 1, shape[3])
        return shape

    def quantized_types(self) -> list[str]:
        """The block types of the file's matrices that are not float (F32, F16, BF16)."""
        return sorted({info.type_name for info in self.file.tensors.values()
                       if len(info.shape) >= 2 and info.ggml_type not in FLOAT_TYPES})

    def keeps_any_packed(self) -> bool:
        return any(self._keeps_packed(name) for name in self._names)

    def _keeps_packed(self, name: str) -> bool:
        info, shape, _ = self._info(name)
        return (self.packed and len(shape) == 2 and info.ggml_type in PACKED_TYPES
                and self._change(name) is None)

    def meta(self, name: str) -> Packed | None:
        """The layout :meth:`get` gives a packed tensor, without its data (None if it is
        not kept packed)."""
        if name not in self._names or not self._keeps_packed(name):
            return None
        info, shape, _ = self._info(name)
        return packed_like(shape, info.ggml_type)

    def _change(self, name: str) -> Callable | None:
        """How :meth:`get` changes the file's values (llama.cpp's conventions undone); None
        when it gives them as they are."""
        if self._arch in NORM_PLUS_ONE and name.endswith("norm.weight"):
            return lambda t: t - 1
        if (self._arch in LINEAR_GGUF and name.endswith("norm.weight")
                and not name.endswith("linear_attn.norm.weight")):
            return lambda t: t - 1
        if self._arch in NEGATED_A and name.endswith("A_log"):  # stored as -exp(A_log)
            return lambda t: (-t.float()).log()
        return None

    def locate(self, name: str) -> tuple[Path, int, torch.dtype | int, tuple[int, ...]] | None:
        """Where a tensor's bytes lie as :meth:`get` gives them: (file, offset, stored, shape),
        ``stored`` the GGML type of a tensor kept packed or the torch dtype of plain data;
        None when get() changes or decodes them."""
        if name not in self._names or self._change(name) is not None:
            return None
        info, shape, offset = self._info(name)
        stored = (info.ggml_type if self._keeps_packed(name) else
                  _PLAIN.get(info.ggml_type))
        return None if stored is None else (self.file.path, info.offset + offset, stored, shape)

    def get(self, name: str) -> torch.Tensor | Packed:
        if name not in self._names:
            raise TiergenError(f"the GGUF file has no tensor for {name!r}; it may be incomplete")
        info, shape, offset = self._info(name)
        raw = self.file.packed_bytes(info.name)
        if shape != info.shape:  # a routed expert's slice, or a vector kept as a matrix
            raw = raw[offset:offset + tensor_nbytes(info.ggml_type, math.prod(shape))]
        if self._keeps_packed(name):
            t = Packed(raw, shape, ((info.ggml_type, shape[0]),))
        elif shape == info.shape:
            t = self.file.read(info.name)
        else:
            t = dequantize(raw, info.ggml_type, shape)
        change = self._change(name)
        return t if change is None else change(t)

    def get_slice(self, name: str, dim: int, rows: range) -> torch.Tensor | Packed:
        """Rows or columns ``rows`` of :meth:`get`'s tensor (packed rows: a view of the
        mapped file)."""
        return narrow(self.get(name), dim, rows)

    def page_out_unused(self, live: Iterable[object]) -> int:
        """Hand back the file's pages that no tensor of ``live`` reads
        (:func:`tiergen.weights.mapped.page_out_unused`)."""
        return page_out_unused(self.file.data, live) if self.file.data is not None else 0
