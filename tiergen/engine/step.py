"""Per-step metadata shared by every layer of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepMeta:
    """Where this step's tokens sit in the batch's padded timeline.

    Prompts are left-padded to one length, so every row writes its new K/V at the same
    cache slots ``[start, start + T)``; ``positions`` count from each row's first real
    token and drive RoPE.

    Example: prompts of 3 and 1 tokens, prefill (start=0, T=3), then one decode step
    (start=3, T=1)::

        valid (B, S)    = [[1, 1, 1],        [[1, 1, 1, 1],
                           [0, 0, 1]]         [0, 0, 1, 1]]
        positions (B,T) = [[0, 1, 2],        [[3],
                           [0, 0, 0]]         [1]]
        mask (B,1,T,S)  = causal & valid keys, each query always seeing itself so that
                          padding rows stay finite; None when no row is padded
                          (then prefill is plain causal and decode unmasked).
    """

    start: int
    positions: torch.Tensor  # (B, T) int64
    mask: torch.Tensor | None  # (B, 1, T, start+T) bool, True = attend

    @property
    def end(self) -> int:
        return self.start + self.positions.shape[1]

    @staticmethod
    def build(valid: torch.Tensor, start: int, num_tokens: int) -> StepMeta:
        """Metadata for tokens at slots [start, start+num_tokens) given key validity (B, S)."""
        end = start + num_tokens
        valid = valid[:, :end]
        positions = (valid.cumsum(-1) - 1).clamp(min=0)[:, start:end]
        if bool(valid.all()) and (start == 0 or num_tokens == 1):
            return StepMeta(start, positions, None)
        q_slots = torch.arange(start, end, device=valid.device)[:, None]
        k_slots = torch.arange(end, device=valid.device)[None, :]
        mask = (k_slots <= q_slots)[None] & valid[:, None, :]
        mask |= k_slots == q_slots
        return StepMeta(start, positions, mask[:, None])
