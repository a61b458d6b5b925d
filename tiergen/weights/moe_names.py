"""Checkpoint names of a mixture-of-experts layer's tensors, by architecture: the Hugging
Face checkpoints' own, which GGUF files are mapped onto (``gguf_map``) and which the model
families fuse (``tiergen.models.moe.fuse_moe``)."""

from __future__ import annotations

from tiergen.config import ModelConfig

# Checkpoint names of a MoE MLP by architecture (layer prefix removed; {e}: expert index).
_QWEN = {"router": "mlp.gate.weight", "gate": "mlp.experts.{e}.gate_proj.weight",
         "up": "mlp.experts.{e}.up_proj.weight", "down": "mlp.experts.{e}.down_proj.weight"}
CHECKPOINT_NAMES: dict[str, dict[str, str]] = {
    "MixtralForCausalLM": {"router": "block_sparse_moe.gate.weight",
                           "gate": "block_sparse_moe.experts.{e}.w1.weight",
                           "up": "block_sparse_moe.experts.{e}.w3.weight",
                           "down": "block_sparse_moe.experts.{e}.w2.weight"},
    "Qwen2MoeForCausalLM": _QWEN | {"shared_gate": "mlp.shared_expert.gate_proj.weight",
                                    "shared_up": "mlp.shared_expert.up_proj.weight",
                                    "shared_down": "mlp.shared_expert.down_proj.weight",
                                    "shared_expert_gate": "mlp.shared_expert_gate.weight"},
    "Qwen3MoeForCausalLM": _QWEN,
    "DeepseekV2ForCausalLM": _QWEN | {"shared_gate": "mlp.shared_experts.gate_proj.weight",
                                      "shared_up": "mlp.shared_experts.up_proj.weight",
                                      "shared_down": "mlp.shared_experts.down_proj.weight"},
}
CHECKPOINT_NAMES["DeepseekV3ForCausalLM"] = CHECKPOINT_NAMES["DeepseekV2ForCausalLM"] | {
    "router_bias": "mlp.gate.e_score_correction_bias"}
CHECKPOINT_NAMES["Qwen3NextForCausalLM"] = CHECKPOINT_NAMES["Qwen2MoeForCausalLM"]
CHECKPOINT_NAMES["Qwen3_5MoeForCausalLM"] = CHECKPOINT_NAMES["Qwen2MoeForCausalLM"]
for _arch in ("Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV32ForCausalLM",
              "GlmMoeDsaForCausalLM"):
    CHECKPOINT_NAMES[_arch] = CHECKPOINT_NAMES["DeepseekV3ForCausalLM"]
CHECKPOINT_NAMES["MiniMaxM2ForCausalLM"] = CHECKPOINT_NAMES["MixtralForCausalLM"] | {
    "router_bias": "block_sparse_moe.e_score_correction_bias"}
CHECKPOINT_NAMES["KimiLinearForCausalLM"] = CHECKPOINT_NAMES["MixtralForCausalLM"] | {
    "router_bias": "block_sparse_moe.gate.e_score_correction_bias",
    "shared_gate": "block_sparse_moe.shared_experts.gate_proj.weight",
    "shared_up": "block_sparse_moe.shared_experts.up_proj.weight",
    "shared_down": "block_sparse_moe.shared_experts.down_proj.weight"}
# gpt-oss stores every expert in one tensor, transposed: gate_up (E, H, 2I) with gate and up
# in alternate columns (kept alternating: see models.moe.expert_mlp), down (E, I, H);
# "stacked" names it.
CHECKPOINT_NAMES["GptOssForCausalLM"] = {
    "stacked": "", "router": "mlp.router.weight", "router_logit_bias": "mlp.router.bias",
    "gate_up": "mlp.experts.gate_up_proj", "gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "down": "mlp.experts.down_proj", "down_bias": "mlp.experts.down_proj_bias"}
# ... and GGUF files expert by expert, gate and up apart (MoEConfig.gate_up_interleaved off)
SPLIT_GPT_OSS_NAMES = _QWEN | {
    "router": "mlp.router.weight", "router_logit_bias": "mlp.router.bias",
    "gate_bias": "mlp.experts.{e}.gate_proj.bias", "up_bias": "mlp.experts.{e}.up_proj.bias",
    "down_bias": "mlp.experts.{e}.down_proj.bias"}


def checkpoint_names(cfg: ModelConfig) -> dict[str, str]:
    """The checkpoint names of a MoE layer's tensors (keys as
    :func:`tiergen.models.moe.fuse_moe` reads them)."""
    if cfg.architecture == "GptOssForCausalLM" and not cfg.moe.gate_up_interleaved:
        return SPLIT_GPT_OSS_NAMES
    return CHECKPOINT_NAMES[cfg.architecture]
