"""Model hyper-parameters as plain data, parsed and validated in one place.

Two sources fill a :class:`ModelConfig`: a Hugging Face ``config.json`` (:func:`from_hf_config`)
and GGUF metadata (``tiergen.weights.gguf_map.config_from_gguf``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tiergen.errors import TiergenError

SUPPORTED_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "Gemma3ForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "GlmMoeDsaForCausalLM",
    "GptOssForCausalLM",
    "KimiLinearForCausalLM",
    "LlamaForCausalLM",
    "MiniMaxM2ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
)

# Checkpoints of an image-and-text model whose text model tiergen runs (the vision tower is not
# loaded; its tensors' names: weights.safetensors.RENAMES): the text model's architecture
TEXT_MODELS = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}


def text_model(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json of the text model inside an image-and-text checkpoint (its
    ``text_config``, under the text model's architecture); any other config unchanged."""
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in TEXT_MODELS:
        return cfg
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise TiergenError(f"config.json of {archs[0]} has no text_config object")
    # (the wrapper ties the head; its eos is the text model's when that names none)
    return text | {"architectures": [TEXT_MODELS[archs[0]]],
                   "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
                   "eos_token_id": text.get("eos_token_id") or cfg.get("eos_token_id")}


@dataclass
class RopeConfig:
    """How rotary frequencies are made: ``kind`` is "default", "linear", "llama3" or "yarn"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None
    # YaRN (DeepSeek-V2): the ramp between interpolated and extrapolated frequencies, and the
    # magnitude corrections of cos/sin (mscale / mscale_all_dim) and of the softmax scale.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # Each rotated pair adjacent, (2i, 2i + 1), where Hugging Face splits the head in halves
    # (i, i + D/2): Q/K rows as llama.cpp's converter permutes Llama's, multiplied as stored.
    pairs: bool = False


@dataclass
class MoEConfig:
    """Routed experts replacing the dense MLP (Mixtral, Qwen2/3-MoE, DeepSeekMoE).

    Each token's router picks ``top_k`` of ``num_experts`` SwiGLU experts; their outputs are
    mixed by the router weights. Shared experts (always on) are one SwiGLU MLP of
    ``shared_intermediate_size``, optionally gated by a sigmoid (Qwen2-MoE).

    DeepSeek-V3 scores experts with a sigmoid and chooses them by score plus a learned bias
    (``router_bias``: the checkpoint's ``e_score_correction_bias``), first keeping the
    ``topk_groups`` groups whose two best biased scores sum highest ("noaux_tc"); the mixing
    weights are the unbiased scores.

    gpt-oss's router has a bias in its logits, mixes by a softmax over the chosen experts'
    logits ("topk_softmax"), and its experts have biases and a clamped SwiGLU
    (``expert_act`` "clamped_swiglu": (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate
    clamped from above at ``swiglu_limit``; gate and up rows alternate as gpt-oss stores them,
    or follow each other as llama.cpp's GGUF files store them).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True  # renormalise the chosen weights to sum to 1 (Mixtral)
    shared_intermediate_size: int = 0  # 0: no shared experts
    shared_gate: bool = False
    dense_layers: list[int] = field(default_factory=list)  # layers that keep a dense MLP
    router_float32: bool = False  # DeepSeek scores experts in float32
    scoring: str = "softmax"  # or "sigmoid" (DeepSeek-V3), "topk_softmax" (gpt-oss)
    router_bias: bool = False  # a per-expert bias added to the scores only to choose experts
    router_logit_bias: bool = False  # the router's linear layer has a bias (gpt-oss)
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    expert_act: str = "silu"  # or "clamped_swiglu" (gpt-oss)
    gate_up_interleaved: bool = False  # gate and up rows alternate (gpt-oss's own checkpoints)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    topk_method: str = "greedy"  # or "group_limited_greedy" (DeepSeek-V2), "noaux_tc" (V3)
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # the routed experts this rank holds under tensor parallelism, [first, stop); None: all
    experts: tuple[int, int] | None = None

    @property
    def local_experts(self) -> range:
        return range(*self.experts) if self.experts else range(self.num_experts)


@dataclass
class MLAConfig:
    """DeepSeek-V2 multi-head latent attention: queries optionally through a low-rank
    bottleneck, keys and values from a shared latent of ``kv_lora_rank`` plus one RoPE key
    of ``qk_rope_head_dim`` per token (all the cache holds)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotation pairs are adjacent elements (DeepSeek's layout)
    kv_b_split: bool = False  # kv_b stored as k_b and v_b, per head (llama.cpp's GGUF)
    # DeepSeek Sparse Attention (V3.2, GLM-5): a "lightning indexer" of index_heads heads of
    # index_head_dim scores every cached token (its key, index_head_dim numbers per token,
    # cached beside the latent), and each query attends to its index_topk best only.
    # 0 heads: dense latent attention.
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_rope_interleave: bool = False  # the indexer's RoPE pairs adjacent (GLM-5), else halves
    # GLM-5: the layers that reuse the choice of the last layer before them that made one
    index_shared: list[bool] | None = None
    rotary: bool = True  # Kimi-Linear: the k_pe and q_pe parts are not rotated at all

    def shares_choice(self, layer: int) -> bool:
        return bool(self.index_shared and self.index_shared[layer])


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet (Qwen3-Next) and Kimi Delta Attention (Kimi-Linear): the layers of
    layer type "linear_attention" keep, per sequence, a state of fixed size instead of a KV
    cache: the short causal convolution's last ``conv_kernel - 1`` inputs (``conv_dim``
    channels each) and the delta rule's matrix (key_head_dim x value_head_dim) per value
    head, float32."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Qwen3-Next projects q, k, v, z (and b, a) grouped by key head, Qwen3.5 each apart;
    # llama.cpp's qwen3next files q, k, v and z apart, b and a still grouped in one
    grouped: bool = True
    ba_grouped: bool = True
    # llama.cpp's Qwen3.5 files order value heads tiled (value head s reads key head
    # s % key_heads), not grouped (s // (value_heads / key_heads))
    tiled: bool = False
    # Kimi Delta Attention: the state decays per key channel (from a low-rank forget gate),
    # not per head, and a low-rank gate (through a sigmoid) scales the output
    per_channel: bool = False

    @property
    def conv_dim(self) -> int:
        """The convolution's channels: q, k and v side by side."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    @property
    def state_numel(self) -> int:
        """Numbers a sequence's state holds in one layer: the convolution's, then the
        delta rule's."""
        return (self.conv_dim * (self.conv_kernel - 1)
                + self.value_heads * self.key_head_dim * self.value_head_dim)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    # MiniMax-M2: the q and k norms each over all heads together (the whole projection)
    qk_norm_across_heads: bool = False
    # the first rotary_dim numbers of each head rotate, the rest pass through (partial
    # rotary: GLM-4.5, MiniMax-M2); None: the whole head
    rotary_dim: int | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax
    sliding_window: int | None = None
    # Per-layer attention kinds ("sliding_attention" / "full_attention"); None: every layer
    # uses sliding_window (if any). Gemma 3 interleaves the two.
    layer_types: list[str] | None = None
    rope_local: RopeConfig | None = None  # RoPE of sliding layers, where it differs (Gemma 3)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is its -0.5 power (Gemma)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    linear: LinearAttentionConfig | None = None  # Qwen3-Next's linear-attention layers

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise TiergenError(
                f"unsupported architecture {self.architecture!r}; tiergen supports "
                + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise TiergenError(f"model config: {name} must be a positive integer, "
                                   f"got {getattr(self, name)!r}")
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        if (not isinstance(self.rotary_dim, int) or self.rotary_dim <= 0 or self.rotary_dim % 2
                or self.rotary_dim > self.head_dim):
            raise TiergenError(f"model config: the rotary dimension ({self.rotary_dim!r}, from "
                               "rotary_dim or partial_rotary_factor) must be an even number of "
                               f"a head's {self.head_dim} numbers")
        if self.num_heads % self.num_kv_heads:
            raise TiergenError(f"model config: num_attention_heads ({self.num_heads}) must be a "
                               f"multiple of num_key_value_heads ({self.num_kv_heads})")
        for rope in (self.rope, self.rope_local or self.rope):
            if rope.kind not in ("default", "linear", "llama3", "yarn"):
                raise TiergenError(f"model config: unsupported rope_type {rope.kind!r} "
                                   "(supported: default, linear, llama3, yarn)")
            if rope.kind == "yarn" and not rope.original_max_position:
                raise TiergenError("model config: yarn rope_scaling needs "
                                   "original_max_position_embeddings")
        if self.moe is not None:
            m = self.moe
            if not 0 < m.top_k <= m.num_experts:
                raise TiergenError(f"model config: num_experts_per_tok ({m.top_k}) must be between "
                                   f"1 and the number of experts ({m.num_experts})")
            if m.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
                raise TiergenError(f"model config: unsupported topk_method {m.topk_method!r} "
                                   "(supported: greedy, group_limited_greedy, noaux_tc)")
            if m.topk_method != "greedy" and (
                    m.num_experts % m.num_groups or not 0 < m.topk_groups <= m.num_groups):
                raise TiergenError(f"model config: n_group ({m.num_groups}) must divide the "
                                   f"{m.num_experts} experts and topk_group ({m.topk_groups}) "
                                   "must be between 1 and n_group")
            if m.topk_method == "noaux_tc" and m.num_experts < 2 * m.num_groups:
                raise TiergenError(f"model config: n_group ({m.num_groups}) leaves fewer than "
                                   f"two of the {m.num_experts} experts per group; a group "
                                   "is scored by its best two")
        if self.mla is not None and self.mla.index_heads:
            m = self.mla
            if not m.q_lora_rank or not 0 < m.index_topk or not (
                    m.qk_rope_head_dim <= m.index_head_dim and m.index_head_dim % 2 == 0):
                raise TiergenError(
                    "model config: sparse attention needs q_lora_rank, a positive index_topk "
                    f"(got {m.index_topk!r}) and an even index_head_dim of at least "
                    f"qk_rope_head_dim ({m.index_head_dim!r} < {m.qk_rope_head_dim!r}?)")
            if m.index_shared is not None and (len(m.index_shared) != self.num_layers
                                               or m.index_shared[0]):
                raise TiergenError("model config: indexer_types must name every layer, the "
                                   "first one 'full' (a 'shared' layer reuses the choice of "
                                   "the last 'full' one before it)")
        act = _ACTIVATIONS.get(self.architecture, "silu")
        if self.hidden_act != act:
            raise TiergenError(f"model config: {self.architecture} with hidden activation "
                               f"{self.hidden_act!r} is not supported (tiergen runs {act!r})")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window <= 0):
            raise TiergenError("model config: sliding_window must be a positive integer or null, "
                               f"got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise TiergenError(f"model config: layer_types names {len(self.layer_types)} "
                                   f"layers, but the model has {self.num_layers}")
            kinds = {"sliding_attention", "full_attention"} | (
                {"linear_attention"} if self.linear is not None else set())
            bad = sorted(set(self.layer_types) - kinds)
            if bad:
                raise TiergenError(f"model config: unsupported layer type {bad[0]!r} "
                                   f"(supported: {', '.join(sorted(kinds))})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise TiergenError("model config: layer_types has sliding_attention layers but "
                                   "sliding_window is not set")
        if self.attn_logit_softcapping is not None:
            raise TiergenError("model config: attention logit softcapping "
                               f"(attn_logit_softcapping={self.attn_logit_softcapping}) is not "
                               "supported")
        for name in ("query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise TiergenError(f"model config: {name} must be positive, got {value!r}")

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + generated) the model takes: unlimited when every layer
        has a sliding window (each keeps a ring of its window, and RoPE has no table to run
        out of), else max_position_embeddings."""
        if all(self.window(i) for i in range(self.num_layers)):
            return UNLIMITED_CONTEXT
        return self.max_position

    def kv_layout(self) -> tuple[int, int, int]:
        """What the cache keeps per token and layer: (parts, heads, width). Keys and values
        (2, num_kv_heads, head_dim); MLA one latent row (1, 1, kv_lora_rank + qk_rope_head_dim)."""
        if self.mla is not None:  # (with the indexer's key of sparse attention after it)
            m = self.mla
            return 1, 1, m.kv_lora_rank + m.qk_rope_head_dim + m.index_head_dim
        return 2, self.num_kv_heads, self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Cache bytes one token adds over all layers (before a sliding window caps a layer)."""
        parts, heads, width = self.kv_layout()
        return parts * heads * width * itemsize * self.num_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def keeps_states(self) -> bool:
        """Whether any layer keeps a linear-attention state (see :meth:`keeps_state`)."""
        return self.linear is not None and any(map(self.keeps_state, range(self.num_layers)))

    def keeps_state(self, layer: int) -> bool:
        """Whether a layer keeps a linear-attention state (one fixed-size row per sequence,
        ``LinearAttentionConfig.state_numel`` float32 numbers) instead of a KV cache."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None for full attention."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def span(self, layers: range) -> ModelConfig:
        """The config of a run of consecutive layers numbered from 0 (a pipeline stage's
        share): what each layer's cache and weights need, nothing of the others."""
        moe = self.moe and replace(self.moe, dense_layers=[
            j - layers.start for j in self.moe.dense_layers if j in layers])
        mla = self.mla
        if mla is not None and mla.index_shared is not None:
            if mla.index_shared[layers.start]:
                raise TiergenError(
                    f"layer {layers.start} reuses the sparse-attention choice of a layer "
                    "before it, so a pipeline stage cannot begin there; choose another "
                    "number of pipeline_parallel stages")
            mla = replace(mla, index_shared=mla.index_shared[layers.start:layers.stop])
        return replace(self, num_layers=len(layers), moe=moe, mla=mla, layer_types=None
                       if self.layer_types is None else self.layer_types[layers.start:layers.stop])

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE settings of a layer: sliding layers may have their own (Gemma 3)."""
        if self.rope_local is not None and self.window(layer):
            return self.rope_local
        return self.rope


UNLIMITED_CONTEXT = 2**62

# Architectures whose MLP is not SwiGLU: the activation their configs must name.
_ACTIVATIONS = {"Gemma3ForCausalLM": "gelu_pytorch_tanh"}


def as_id_list(value: Any) -> list[int]:
    """Token ids given as None, one id or a list of them, as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_hf(cfg: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    # transformers 5 keeps RoPE settings in rope_parameters; older files use rope_theta
    # and rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    return _rope(params, float(cfg.get("rope_theta", default_theta)))


def _rope(params: dict[str, Any], default_theta: float) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    def opt(name: str) -> float | None:
        return None if params.get(name) is None else float(params[name])

    return RopeConfig(
        theta=float(params.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=params.get("original_max_position_embeddings"),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _gemma3_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 fields of a ModelConfig: per-layer-type RoPE, the layer pattern, scales."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        # transformers 5: one RoPE dict per layer type
        rope = _rope(params.get("full_attention") or {}, float(cfg.get("rope_theta", 1e6)))
        local = _rope(params.get("sliding_attention") or {},
                      float(cfg.get("rope_local_base_freq", 1e4)))
    else:  # older files: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq
        rope = _rope_from_hf(cfg, default_theta=1e6)
        local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 1e4)))
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # every pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(cfg["num_hidden_layers"])]
    if cfg.get("use_bidirectional_attention"):
        raise TiergenError("model config: Gemma 3 with use_bidirectional_attention (an "
                           "embedding model) is not supported")
    return dict(
        rope=rope, rope_local=local, layer_types=list(layer_types),
        sliding_window=cfg.get("sliding_window", 4096),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qk_norm=True,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )


FP8_BLOCK = 128  # values of an FP8 checkpoint's scale block along a row


def fp8_block_rows(quantization_config: dict) -> int:
    """The rows of a scale block of an FP8 ``quantization_config`` tiergen reads, or a
    TiergenError saying why not."""
    fmt = quantization_config.get("fmt", "e4m3")
    block = quantization_config.get("weight_block_size")
    if fmt != "e4m3" or not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise TiergenError(f"config.json: FP8 checkpoints in format {fmt!r} with block size "
                           f"{block!r} are not supported (tiergen reads e4m3 with "
                           "weight_block_size [rows, 128], as DeepSeek-V3 and Kimi K2 ship)")
    if int(block[1]) != FP8_BLOCK:
        raise TiergenError(f"config.json: FP8 blocks of {block[1]} columns are not supported "
                           f"(tiergen reads blocks of {FP8_BLOCK} columns)")
    return int(block[0])


def _quant_method(cfg: dict[str, Any]) -> str | None:
    quant = cfg.get("quantization_config")
    return quant.get("quant_method") if isinstance(quant, dict) else None


def _moe_from_hf(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE (and MLA) fields of a ModelConfig for the mixture-of-experts architectures."""
    layers = cfg["num_hidden_layers"]
    if arch == "GptOssForCausalLM":
        moe = MoEConfig(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["intermediate_size"], norm_topk_prob=False,
                        scoring="topk_softmax", router_logit_bias=True, expert_bias=True,
                        expert_act="clamped_swiglu",
                        # the MXFP4 checkpoint's experts are given with gate and up apart
                        gate_up_interleaved=_quant_method(cfg) != "mxfp4",
                        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
        return dict(moe=moe)
    if arch == "MixtralForCausalLM":
        moe = MoEConfig(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["intermediate_size"])
        return dict(moe=moe)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
                "Qwen3_5MoeForCausalLM"):
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        moe = MoEConfig(
            num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", arch != "Qwen2MoeForCausalLM")),
            shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if arch != "Qwen3MoeForCausalLM" else 0,
            shared_gate=arch != "Qwen3MoeForCausalLM",
            dense_layers=[i for i in range(layers) if i in only or (i + 1) % step])
        return dict(moe=moe)
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" and arch in SIGMOID_ROUTED:
        raise TiergenError(f"model config: {arch} with scoring_func {cfg['scoring_func']!r} is "
                           "not supported (only sigmoid)")
    if arch == "MiniMaxM2ForCausalLM":  # sigmoid scores with a bias to choose by, no groups
        moe = MoEConfig(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["intermediate_size"], router_float32=True,
                        scoring="sigmoid", router_bias=bool(cfg.get("use_routing_bias", True)))
        return dict(moe=moe)
    # DeepseekV2ForCausalLM, DeepseekV3ForCausalLM (Kimi K2 too) and GLM-4.5's families, which
    # route as V3 does (GLM-4.7-Flash's attention is V3's latent attention too)
    v3 = arch != "DeepseekV2ForCausalLM"
    if cfg.get("attention_bias") and arch != "Glm4MoeForCausalLM":
        raise TiergenError(f"model config: {arch} with attention_bias is not supported")
    if not v3 and cfg.get("topk_method") == "noaux_tc":
        raise TiergenError("model config: DeepSeek-V2 with topk_method 'noaux_tc' is not "
                           "supported (DeepseekV3ForCausalLM routes that way)")
    moe = MoEConfig(
        num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        # transformers' V3 always routes this way, whatever topk_method says
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if v3 else False,
        shared_intermediate_size=cfg["moe_intermediate_size"] * int(cfg.get("n_shared_experts") or 0),
        dense_layers=[i for i, t in enumerate(cfg["mlp_layer_types"]) if t == "dense"]
        if cfg.get("mlp_layer_types") else
        list(range(min(int(cfg.get("first_k_dense_replace") or 0), layers))),
        router_float32=True, scoring="sigmoid" if v3 else "softmax", router_bias=v3,
        topk_method="noaux_tc" if v3 else cfg.get("topk_method") or "greedy",
        num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))
    if arch == "Glm4MoeForCausalLM":
        return dict(moe=moe)
    mla = MLAConfig(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                    qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
                    rotary=arch != "KimiLinearForCausalLM")
    if arch in INDEXED_ATTENTION:
        mla = replace(mla, **_indexer_from_hf(arch, cfg))
    return dict(moe=moe, mla=mla, head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])


def _indexer_from_hf(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MLAConfig fields of DeepSeek Sparse Attention's indexer."""
    kinds = cfg.get("layer_types")
    if kinds is not None and set(kinds) - {"indexed_attention"}:
        raise TiergenError(f"model config: {arch} with layer type "
                           f"{sorted(set(kinds) - {'indexed_attention'})[0]!r} is not "
                           "supported (only indexed_attention)")
    shared = cfg.get("indexer_types")
    if shared is not None:
        if set(shared) - {"full", "shared"}:
            raise TiergenError(f"model config: indexer_types may hold 'full' and 'shared', "
                               f"got {sorted(set(shared) - {'full', 'shared'})[0]!r}")
        shared = [t == "shared" for t in shared]
    return dict(index_heads=int(cfg["index_n_heads"]), index_head_dim=int(cfg["index_head_dim"]),
                index_topk=int(cfg["index_topk"]), index_shared=shared,
                index_rope_interleave=arch == "GlmMoeDsaForCausalLM")


# The mixtures of experts whose routers score with a sigmoid (and nothing else tiergen runs)
SIGMOID_ROUTED = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "Glm4MoeForCausalLM",
                  "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "MiniMaxM2ForCausalLM",
                  "KimiLinearForCausalLM")
INDEXED_ATTENTION = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "DeepseekV2ForCausalLM",
                     "GptOssForCausalLM",
                     *SIGMOID_ROUTED)


def _rotary_dim(arch: str, cfg: dict[str, Any], head_dim: int) -> int:
    """How many numbers of a head rotate: MiniMax-M2's rotary_dim, else partial_rotary_factor
    of the head (in rope_parameters, or beside it in older files; GLM-4.5 defaults to half)."""
    if cfg.get("rotary_dim") is not None:
        return cfg["rotary_dim"]
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    factor = params.get("partial_rotary_factor", cfg.get(
        "partial_rotary_factor", 0.5 if arch == "Glm4MoeForCausalLM" else 1.0))
    return int(head_dim * float(factor))


def _minimax_m2(cfg: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-M2's q/k norms: each over its whole projection (all heads together)."""
    kind = cfg.get("qk_norm_type", "per_layer")
    if kind != "per_layer":
        raise TiergenError(f"model config: MiniMax-M2 with qk_norm_type {kind!r} is not "
                           "supported (only per_layer: each norm over all heads together)")
    norm = bool(cfg.get("use_qk_norm", True))
    return dict(qk_norm=norm, qk_norm_across_heads=norm)


LINEAR_ATTENTION = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                    "KimiLinearForCausalLM")

# Kimi-Linear's config.json names DeepSeek-V3's fields its own way
_KIMI_NAMES = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
               "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group",
               "num_shared_experts": "n_shared_experts",
               "model_max_length": "max_position_embeddings"}


def _kimi_linear(cfg: dict[str, Any]) -> dict[str, Any]:
    """Kimi-Linear's config.json in DeepSeek-V3's names, with its layer types (from
    ``linear_attn_config`` as released: 1-based "full_attn_layers" and "kda_layers")."""
    cfg = cfg | {v: cfg[k] for k, v in _KIMI_NAMES.items() if cfg.get(k) is not None}
    if cfg.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise TiergenError("model config: Kimi-Linear with moe_router_activation_func "
                           f"{cfg['moe_router_activation_func']!r} is not supported (only sigmoid)")
    linear = cfg.get("linear_attn_config") or {}
    layers = cfg["num_hidden_layers"]
    if cfg.get("layer_types") is None:
        full = set(linear.get("full_attn_layers") or
                   [i + 1 for i in range(layers) if i and i % 4 == 0])
        cfg["layer_types"] = ["full_attention" if i + 1 in full else "linear_attention"
                              for i in range(layers)]
    if cfg.get("mlp_layer_types") is None:
        dense = int(cfg.get("first_k_dense_replace", 1))
        cfg["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(layers)]
    return cfg | {"linear_head_dim": linear.get("head_dim", cfg.get("linear_head_dim", 128)),
                  "linear_num_heads": linear.get("num_heads", cfg.get("linear_num_heads", 32)),
                  "linear_conv_kernel_dim": linear.get("short_conv_kernel_size",
                                                       cfg.get("linear_conv_kernel_dim", 4))}


def _qwen3_next(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's and Qwen3.5's linear-attention layers and per-head q/k norms, and
    Kimi-Linear's (whose attention layers are DeepSeek-V3's latent attention, not rotated)."""
    if cfg.get("attention_bias"):
        raise TiergenError(f"model config: {arch} with attention_bias is not supported")
    layers = cfg["num_hidden_layers"]
    if arch == "KimiLinearForCausalLM":
        heads, dim = int(cfg["linear_num_heads"]), int(cfg["linear_head_dim"])
        linear = LinearAttentionConfig(heads, heads, dim, dim, int(cfg["linear_conv_kernel_dim"]),
                                       grouped=False, ba_grouped=False, per_channel=True)
        return dict(layer_types=list(cfg["layer_types"]), linear=linear)
    kinds = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0
        else "linear_attention" for i in range(layers)]
    linear = LinearAttentionConfig(
        key_heads=int(cfg["linear_num_key_heads"]), value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        grouped=arch == "Qwen3NextForCausalLM", ba_grouped=arch == "Qwen3NextForCausalLM")
    if linear.value_heads % linear.key_heads:
        raise TiergenError("model config: linear_num_value_heads must be a multiple of "
                           "linear_num_key_heads")
    return dict(layer_types=list(kinds), linear=linear, qk_norm=True)


def _qwen_layer_types(arch: str, cfg: dict[str, Any]) -> list[str] | None:
    """Which layers of a Qwen model with use_sliding_window slide, as transformers decides:
    an explicit layer_types; else Qwen2/Qwen3 slide from layer max_window_layers on, Qwen2-MoE
    every other layer below it, and Qwen3-MoE every layer."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    layers, limit = cfg["num_hidden_layers"], int(cfg.get("max_window_layers", 28))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        sliding = [i >= limit for i in range(layers)]
    elif arch == "Qwen2MoeForCausalLM":
        sliding = [bool((i + 1) % 2) and i < limit for i in range(layers)]
    else:
        return None
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the dict of a Hugging Face ``config.json``."""
    cfg = text_model(cfg)
    archs = cfg.get("architectures") or []
    if not archs:
        raise TiergenError("config.json names no architecture ('architectures' is missing); "
                           "tiergen supports " + ", ".join(SUPPORTED_ARCHITECTURES))
    arch = archs[0]
    if arch == "KimiLinearForCausalLM":
        cfg = _kimi_linear(cfg)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise TiergenError(f"unsupported architecture {arch!r}; tiergen supports "
                           + ", ".join(SUPPORTED_ARCHITECTURES + tuple(TEXT_MODELS)))
    quant = cfg.get("quantization_config")
    method = _quant_method(cfg) or ("unknown" if isinstance(quant, dict) else quant)
    mxfp4 = method == "mxfp4" and arch == "GptOssForCausalLM"  # gpt-oss's own experts
    if quant and method != "fp8" and not mxfp4:  # as plain tensors they would be wrong
        raise TiergenError(f"config.json: checkpoints quantised with {method!r} are not "
                           "supported (FP8 block-quantised ones, and gpt-oss's MXFP4 ones, "
                           "are); load an unquantised checkpoint (tiergen quantises it with "
                           "--quantize) or a GGUF file")
    if quant and not mxfp4:
        fp8_block_rows(quant)  # refused here if its format is not one tiergen reads
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            window = None
        fields: dict[str, Any] = dict(layer_types=_qwen_layer_types(arch, cfg)) \
            if arch.startswith("Qwen") and window else {}
        fields |= dict(
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            attention_sinks=arch == "GptOssForCausalLM",
            sliding_window=window,
            hidden_act=cfg.get("hidden_act") or "silu",
        )
        if arch == "Gemma3ForCausalLM":
            fields |= _gemma3_from_hf(cfg)
        if arch == "GptOssForCausalLM":  # sliding and full layers as layer_types says
            fields["layer_types"] = list(cfg.get("layer_types") or [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(cfg["num_hidden_layers"])])
        if arch == "Glm4MoeForCausalLM":
            fields["qk_norm"] = bool(cfg.get("use_qk_norm", False))
        if arch == "MiniMaxM2ForCausalLM":
            fields |= _minimax_m2(cfg)
        if arch in LINEAR_ATTENTION:
            fields |= _qwen3_next(arch, cfg)
        if arch in MOE_ARCHITECTURES:
            fields |= _moe_from_hf(arch, cfg)
        head_dim = fields.pop("head_dim", None) or cfg.get("head_dim") or hidden // heads
        if "mla" not in fields:
            fields["rotary_dim"] = _rotary_dim(arch, cfg, head_dim)
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            # (Qwen3.5's mixtures of experts have no dense MLP, nor its size)
            intermediate_size=cfg["moe_intermediate_size"] if arch == "Qwen3_5MoeForCausalLM"
            and "intermediate_size" not in cfg else cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position=cfg.get("max_position_embeddings", 2048),
            qkv_bias=bias or arch == "Qwen2ForCausalLM"
            or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))),
            o_bias=bias and arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
                                         "Glm4MoeForCausalLM"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=as_id_list(cfg.get("eos_token_id")),
            **fields,
        )
    except KeyError as e:
        raise TiergenError(f"config.json lacks the required field {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise TiergenError(f"config.json has a field of the wrong type or value ({e})") from None
