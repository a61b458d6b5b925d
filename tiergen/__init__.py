"""tiergen: run large language models across device memory, host RAM and disk."""

from tiergen import _platform  # noqa: F401  (must run before torch executes a kernel)
from tiergen.engine.llm import LLM, GenerationResult, StreamEvent
from tiergen.engine.sampler import SamplingParams
from tiergen.engine.speculative import SpeculativeConfig
from tiergen.errors import TiergenError
from tiergen.offload.policy import Policy

__all__ = ["LLM", "GenerationResult", "Policy", "SamplingParams", "SpeculativeConfig", "StreamEvent", "TiergenError"]
__version__ = "0.1.0"
