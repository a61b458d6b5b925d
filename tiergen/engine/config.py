"""What an LLM is asked to load and how to run it: one record, checked once, and shipped
whole to the other parallel ranks, which load their share of the model from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiergen.devices import resolve_activations, resolve_device
from tiergen.engine.generate import default_prefill_chunk
from tiergen.engine.speculative import SpeculativeConfig
from tiergen.errors import TiergenError
from tiergen.offload.memory import Budgets
from tiergen.offload.policy import Policy
from tiergen.parallel.group import under_torchrun
from tiergen.weights import ModelFiles, open_model, quantized


def resolve_prefill_chunk(chunk: int | None | str, batch_invariant: bool, device_type: str
                          ) -> int | None:
    """An LLM's ``prefill_chunk_size``: as given, or for "auto" the default for the compute
    device's type (generate.default_prefill_chunk), and None (whole prompts) where batch
    invariant (see EngineConfig)."""
    if chunk != "auto":
        return chunk
    return None if batch_invariant else default_prefill_chunk(device_type)


@dataclass
class EngineConfig:
    """The arguments of :class:`~tiergen.engine.llm.LLM`, which documents each. They stay as
    given ("auto", None): each rank resolves the device, dtype and activations on its own
    machine. ``budgets``: ``device_memory`` and ``host_memory`` read once, as bytes.
    ``prefill_chunk_size`` ("auto") and ``share_prefixes`` (None) are resolved here: chunks
    of the device's default_prefill_chunk and shared prefixes, except batch invariant, where
    a prompt is computed whole, as it is alone (a chunk's or a shared prefix's boundaries
    would fall elsewhere in a padded row or one whose batch shares a prefix)."""

    model: str | Path | ModelFiles
    dtype: str | torch.dtype = "auto"
    device: str | None = None
    max_batch_size: int = 64
    policy: Policy | list[Policy] | None = None  # a list: one per parallel rank
    device_memory: int | str | None = None
    host_memory: int | str | None = None
    compile: bool = False
    prefill_chunk_size: int | None | str = "auto"
    packed: bool = True
    activations: str = "auto"
    batch_invariant: bool = False
    pipeline_parallel: int = 1
    tensor_parallel: int = 1
    parallel_timeout: float = 60.0
    quantize: str | None = None
    share_prefixes: bool | None = None
    speculative_config: SpeculativeConfig | dict | str | None = None
    budgets: Budgets = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Refuse what cannot work before anything loads or any rank starts."""
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise TiergenError("max_batch_size must be a positive integer, got "
                               f"{self.max_batch_size!r}")
        device = resolve_device(self.device)
        self.prefill_chunk_size = resolve_prefill_chunk(self.prefill_chunk_size,
                                                        self.batch_invariant, device.type)
        if self.share_prefixes is None:
            self.share_prefixes = not self.batch_invariant
        chunk = self.prefill_chunk_size
        if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
            raise TiergenError("prefill_chunk_size must be a positive integer (or None for the "
                               f"whole prompt at once), got {chunk!r}")
        self.budgets = Budgets.parse(self.device_memory, self.host_memory)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        resolve_activations(self.activations, device)
        if isinstance(self.policy, (list, tuple)):
            if not self.parallel:
                raise TiergenError("a list of policies is for pipeline_parallel or "
                                   "tensor_parallel > 1 (one per rank)")
            if len({(p.gpu_batch_size, p.num_gpu_batches) for p in self.policy}) > 1:
                raise TiergenError("the parallel ranks' policies must cut the batch alike: give "
                                   "them the same gpu_batch_size and num_gpu_batches")
        timeout = self.parallel_timeout
        if self.parallel and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise TiergenError(f"parallel_timeout must be a number of seconds > 0, got {timeout!r}")

    @property
    def parallel(self) -> bool:
        """Whether the model runs over several ranks (under torchrun, always)."""
        return self.pipeline_parallel != 1 or self.tensor_parallel != 1 or under_torchrun()

    def open(self) -> ModelFiles:
        """The model's config, tokenizer and tensors."""
        if isinstance(self.model, ModelFiles):
            return self.model if self.quantize is None else quantized(self.model, self.quantize)
        return open_model(self.model, self.packed, self.quantize)

    def policy_for(self, rank: int, ranks: int) -> Policy:
        """Rank ``rank``'s policy, of ``ranks`` in all (one process: rank 0 of 1)."""
        if not isinstance(self.policy, (list, tuple)):
            return self.policy or Policy()
        if len(self.policy) != ranks:
            raise TiergenError(f"got {len(self.policy)} policies for {ranks} parallel ranks; "
                               "give one per rank, or one for all")
        return self.policy[rank]
