"""Model families, looked up by the architecture name of the checkpoint."""

from tiergen.config import ModelConfig
from tiergen.models.base import ModelFamily
from tiergen.models.gemma3 import Gemma3
from tiergen.models.llama import Llama

FAMILIES = {
    "Gemma3ForCausalLM": Gemma3,
    "LlamaForCausalLM": Llama,
    "MistralForCausalLM": Llama,
    "Qwen2ForCausalLM": Llama,
    "Qwen3ForCausalLM": Llama,
}


def build_model(cfg: ModelConfig) -> ModelFamily:
    return FAMILIES[cfg.architecture](cfg)
