"""The generation loop for one batch: prefill, then decode until every sequence has stopped."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tiergen.engine.executor import Executor
from tiergen.engine.sampler import Sampler, SamplingParams
from tiergen.engine.step import StepMeta
from tiergen.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Sequence:
    """One prompt's state while it generates."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of text already streamed
    finish_reason: str | None = None

    def append(self, token: int) -> None:
        self.token_ids.append(token)
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
        elif self.detok is not None:
            old_len = len(self.text)
            self.text += self.detok.push(token)
            for stop in self.params.stop:
                # Only the tail can hold a stop string that this token completed.
                at = self.text.find(stop, max(0, old_len - len(stop) + 1))
                if at >= 0:
                    self.text, self.finish_reason = self.text[:at], "stop"
                    return
        if self.finish_reason is None and len(self.token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and self.detok is not None:
            self.text += self.detok.finish()

    def take_delta(self) -> str:
        """Text not yet streamed, holding back a tail that might begin a stop string."""
        end = len(self.text)
        if self.finish_reason is None:
            for stop in self.params.stop:
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if self.text.endswith(stop[:n]):
                        end = min(end, len(self.text) - n)
                        break
        delta, self.emitted = self.text[self.emitted:end], max(self.emitted, end)
        return delta


@dataclass
class StepEvent:
    """What one decode step produced for one sequence."""

    seq: Sequence
    token_id: int
    delta: str


def make_sequences(prompts: list[list[int]], params: list[SamplingParams], eos_ids: list[int],
                   tokenizer: Tokenizer | None) -> list[Sequence]:
    eos = frozenset(eos_ids)
    return [Sequence(i, ids, p, eos, tokenizer and IncrementalDetokenizer(tokenizer, ids))
            for i, (ids, p) in enumerate(zip(prompts, params))]


def run_batch(executor: Executor, seqs: list[Sequence]) -> Iterator[StepEvent]:
    """Generate for a batch of sequences, yielding each new token as it is produced.

    Prompts are left-padded to one length; finished sequences are dropped from the batch
    once enough of them have stopped to make the cache copy worth it.
    """
    device = executor.device
    longest = max(len(s.prompt_ids) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    valid = torch.zeros(len(seqs), longest + max(s.params.max_tokens for s in seqs), dtype=torch.bool)
    for row, s in enumerate(seqs):
        ids[row, longest - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
        valid[row, longest - len(s.prompt_ids):longest] = True
    ids, valid = ids.to(device), valid.to(device)
    cache = executor.new_cache(len(seqs), valid.shape[1])
    sampler = Sampler([s.params for s in seqs], [s.prompt_ids for s in seqs],
                      executor.cfg.vocab_size, device)
    live = list(seqs)
    start, num_tokens = 0, longest
    while True:
        logits = executor.forward(ids, StepMeta.build(valid, start, num_tokens), cache)
        tokens = sampler(logits)
        for s, token in zip(live, tokens.tolist()):
            if s.finish_reason is None:
                s.append(token)
                yield StepEvent(s, token, s.take_delta())
        start += num_tokens
        num_tokens = 1
        valid[:, start] = True
        done = [s.finish_reason is not None for s in live]
        if all(done):
            return
        if sum(done) * 4 >= len(live):
            rows = [r for r, d in enumerate(done) if not d]
            live = [live[r] for r in rows]
            rows_t = torch.tensor(rows, device=device)
            cache.keep_rows(rows_t)
            sampler.keep_rows(rows)
            valid, tokens = valid[rows_t], tokens[rows_t]
        ids = tokens[:, None]
