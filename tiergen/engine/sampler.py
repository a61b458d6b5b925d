"""Sampling parameters and the sampler: logits and per-sequence settings in, token ids out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiergen.errors import TiergenError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per prompt.

    temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; ``seed`` makes
    sampling reproducible whatever else is in the batch.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def integer(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TiergenError(f"invalid sampling parameter: stop must be a string or a list of "
                               f"strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        checks = [
            (integer(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be a positive integer, got {self.max_tokens!r}"),
            (number(self.temperature) and self.temperature >= 0,
             f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}"),
            (number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (integer(self.top_k) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"),
            (number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}"),
            (self.seed is None or integer(self.seed), f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise TiergenError(f"invalid sampling parameter: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Holds the per-row state sampling needs (seeded generators, seen tokens) for a batch."""

    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], vocab_size: int,
                 device: torch.device) -> None:
        self.params = params
        self.vocab_size, self.device = vocab_size, device
        self.generators = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed)
                           for p in params]
        self.penalty = None
        if any(p.repetition_penalty != 1.0 for p in params):
            self.penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
            self.seen = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
            for row, ids in enumerate(prompts):
                self.seen[row, torch.tensor(ids, dtype=torch.long)] = True

    def keep_rows(self, rows: list[int]) -> None:
        self.params = [self.params[r] for r in rows]
        self.generators = [self.generators[r] for r in rows]
        if self.penalty is not None:
            self.penalty, self.seen = self.penalty[rows], self.seen[rows]

    def _penalty_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.penalty is not None:
            return self.penalty, self.seen
        rows = len(self.params)
        return (torch.ones(rows, 1, device=self.device),
                torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device))

    def extend(self, other: Sampler) -> None:
        """Append the rows of another batch's sampler (micro-batches merging)."""
        if self.penalty is not None or other.penalty is not None:
            (mine, my_seen), (theirs, their_seen) = self._penalty_rows(), other._penalty_rows()
            self.penalty, self.seen = torch.cat([mine, theirs]), torch.cat([my_seen, their_seen])
        self.params = self.params + other.params
        self.generators = self.generators + other.generators

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Pick one token per row from float32 logits (B, V)."""
        if self.penalty is not None:
            penalised = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
            logits = torch.where(self.seen, penalised, logits)
        tokens = logits.argmax(-1)
        for row, p in enumerate(self.params):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, self.generators[row])
        if self.penalty is not None:
            self.seen[torch.arange(len(tokens)), tokens] = True
        return tokens

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        logits = logits / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = logits.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs >= p.top_p  # keep the smallest set reaching top_p
            logits = logits.index_fill(0, order[drop], float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=gen)[0]
