"""Per-step metadata shared by every layer of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepMeta:
    """Where this step's tokens sit in the batch's padded timeline.

    Prompts are left-padded to one length, so every row writes its new K/V at the same
    cache slots ``[start, start + T)``; ``positions`` count from each row's first real
    token and drive RoPE. A step attends to the slots before its end: a decode step (T = 1)
    to the whole preallocated cache instead (static shapes: no per-step copy of a growing
    slice), its unwritten slots masked out.

    Example: prompts of 3 and 1 tokens in a cache of 5 slots, prefill (start=0, T=3),
    then one decode step (start=3, T=1)::

        valid (B, 5)    = [[1, 1, 1, 0, 0],      [[1, 1, 1, 1, 0],
                           [0, 0, 1, 0, 0]]       [0, 0, 1, 1, 0]]
        positions (B,T) = [[0, 1, 2],            [[3],
                           [0, 0, 0]]             [1]]
        mask            = (B, 1, 3, 3): causal   (B, 1, 1, 5): valid slots up to 3
                          & valid keys, each
                          query always seeing itself so that padding rows stay finite;
                          None when no row is padded (then plain causal).
    """

    start: int
    positions: torch.Tensor  # (B, T) int64
    mask: torch.Tensor | None  # (B, 1, T, keys) bool, True = attend
    valid: torch.Tensor  # (B, capacity) bool: which timeline slots hold real tokens
    # what the layers derive from the above once per step and share (a ring's mask)
    derived: dict = field(default_factory=dict, compare=False, repr=False)
    checks: bool = False  # a speculative step's: T new tokens a row, each decode's arithmetic

    @property
    def end(self) -> int:
        return self.start + self.positions.shape[1]

    def to(self, device: torch.device) -> StepMeta:
        mask = None if self.mask is None else self.mask.to(device)
        return StepMeta(self.start, self.positions.to(device), mask, self.valid.to(device),
                        checks=self.checks)

    @staticmethod
    def build(valid: torch.Tensor, start: int, num_tokens: int) -> StepMeta:
        """Metadata for tokens at slots [start, start+num_tokens) given slot validity (B, capacity)."""
        end = start + num_tokens
        if num_tokens == 1 and start > 0:  # a decode step (the same as below, in fewer steps)
            positions = (valid[:, :end].sum(-1, keepdim=True) - 1).clamp(min=0)
            mask = valid.clone()
            mask[:, end:] = False
            mask[:, start] = True
            return StepMeta(start, positions, mask[:, None, None], valid)
        positions = (valid[:, :end].cumsum(-1) - 1).clamp(min=0)[:, start:end]
        keys = valid[:, :end]
        if start == 0 and bool(keys.all()):
            return StepMeta(start, positions, None, valid)
        q_slots = torch.arange(start, end, device=valid.device)[:, None]
        k_slots = torch.arange(keys.shape[1], device=valid.device)[None, :]
        mask = (k_slots <= q_slots)[None] & keys[:, None, :]
        mask |= k_slots == q_slots
        return StepMeta(start, positions, mask[:, None], valid)
