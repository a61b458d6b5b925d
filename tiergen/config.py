"""Model hyper-parameters as plain data, parsed and validated in one place.

Two sources fill a :class:`ModelConfig`: a Hugging Face ``config.json`` (:func:`from_hf_config`)
and GGUF metadata (``tiergen.weights.gguf_map.config_from_gguf``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiergen.errors import TiergenError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass
class RopeConfig:
    """How rotary frequencies are made: ``kind`` is "default", "linear" or "llama3"."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int | None = None


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
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

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
        if self.num_heads % self.num_kv_heads:
            raise TiergenError(f"model config: num_attention_heads ({self.num_heads}) must be a "
                               f"multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.rope.kind not in ("default", "linear", "llama3"):
            raise TiergenError(f"model config: unsupported rope_type {self.rope.kind!r} "
                               "(supported: default, linear, llama3)")

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + generated) the model takes."""
        return self.max_position

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer's attention, or None for full attention."""
        return self.sliding_window


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 keeps RoPE settings in rope_parameters; older files use rope_theta
    # and rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return RopeConfig(
        theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=params.get("original_max_position_embeddings"),
    )


def from_hf_config(cfg: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the dict of a Hugging Face ``config.json``."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise TiergenError("config.json names no architecture ('architectures' is missing); "
                           "tiergen supports " + ", ".join(SUPPORTED_ARCHITECTURES))
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise TiergenError(f"unsupported architecture {arch!r}; tiergen supports "
                           + ", ".join(SUPPORTED_ARCHITECTURES))
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
            window = None
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bias or arch == "Qwen2ForCausalLM",
            o_bias=bias and arch != "Qwen2ForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise TiergenError(f"config.json lacks the required field {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise TiergenError(f"config.json has a field of the wrong type or value ({e})") from None
