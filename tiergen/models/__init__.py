"""Model families, looked up by the architecture name of the checkpoint."""

from tiergen.config import ModelConfig
from tiergen.models.base import ModelFamily
from tiergen.models.deepseek_v2 import DeepseekV2
from tiergen.models.gemma3 import Gemma3
from tiergen.models.kimi_linear import KimiLinear
from tiergen.models.llama import Llama
from tiergen.models.qwen3_next import Qwen3Next

FAMILIES = {
    "DeepseekV2ForCausalLM": DeepseekV2,
    "DeepseekV3ForCausalLM": DeepseekV2,  # V3's differences are in its config (routing)
    "DeepseekV32ForCausalLM": DeepseekV2,  # V3 with sparse attention
    "GlmMoeDsaForCausalLM": DeepseekV2,  # V3.2's sparse attention, some layers sharing a choice
    "Gemma3ForCausalLM": Gemma3,
    "Glm4MoeForCausalLM": Llama,
    "Glm4MoeLiteForCausalLM": DeepseekV2,  # V3's latent attention and routing, GLM's sizes
    "GptOssForCausalLM": Llama,
    "KimiLinearForCausalLM": KimiLinear,
    "LlamaForCausalLM": Llama,
    "MiniMaxM2ForCausalLM": Llama,
    "MistralForCausalLM": Llama,
    "MixtralForCausalLM": Llama,
    "Qwen2ForCausalLM": Llama,
    "Qwen2MoeForCausalLM": Llama,
    "Qwen3ForCausalLM": Llama,
    "Qwen3MoeForCausalLM": Llama,
    "Qwen3NextForCausalLM": Qwen3Next,
    "Qwen3_5ForCausalLM": Qwen3Next,  # the same layers, projections apart
    "Qwen3_5MoeForCausalLM": Qwen3Next,
}


def build_model(cfg: ModelConfig) -> ModelFamily:
    return FAMILIES[cfg.architecture](cfg)
