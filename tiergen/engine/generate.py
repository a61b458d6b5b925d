"""The generation loop for one batch: prefill, then decode until every sequence has stopped."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiergen.engine.constraints import Constraint
from tiergen.engine.executor import Executor, MicroBatch, PositionLogits
from tiergen.engine.sampler import PositionLogprobs, Sampler, SamplingParams, position_logprobs
from tiergen.engine.speculative import DraftCache, Guesser, lookup
from tiergen.cache.step import StepMeta
from tiergen.config import ModelConfig
from tiergen.errors import TiergenError
from tiergen.kernels import amx_prompt
from tiergen.tokenizer import IncrementalDetokenizer, Tokenizer

DEFAULT_PREFILL_CHUNK = 512  # prompt tokens per prefill step (LLM's prefill_chunk_size)
# On a CPU: each chunk decodes every packed matrix again, and the chunk's activations stay in
# host RAM. One 4,096-token prompt ran 1.10x (SmolLM2) and 1.05-1.09x (Gemma 3) faster in
# chunks of 1,024 than of 512, for 32-41 MB more (docs/BENCHMARKS.md, "Prefill chunks after
# both"; Gemma 3 falls back past 1,024, its sliding window's double).
CPU_PREFILL_CHUNK = 1024
MIN_SHARED_PREFIX = 32  # prompt tokens in common below which a block computes them per row


def default_prefill_chunk(device_type: str) -> int:
    """The prompt tokens per prefill step an LLM takes by default on ``device_type``."""
    return CPU_PREFILL_CHUNK if device_type == "cpu" else DEFAULT_PREFILL_CHUNK


def prefill_chunk(chunk_size: int | None, tokens: int) -> int:
    """Tokens per prefill step over a prompt of ``tokens``: at most ``chunk_size`` (the
    LLM's prefill_chunk_size), or all of them at once when it is None."""
    return min(tokens, chunk_size or tokens)


def chunks(chunk_size: int | None, tokens: int) -> list[range]:
    """The positions of each prefill step over a prompt of ``tokens``, in order."""
    step = max(1, prefill_chunk(chunk_size, tokens))
    return [range(start, min(start + step, tokens)) for start in range(0, tokens, step)]


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
    tokenizer: Tokenizer | None = None
    # with params.logprobs: one entry per generated token; with params.prompt_logprobs: one
    # per prompt token, None for the first (nothing comes before it)
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    constraint: Constraint | None = None  # where its output stands in params' grammar
    guesser: Guesser | None = None  # what proposes its tokens (engine.speculative), if any

    def __post_init__(self) -> None:
        if self.params.compiled_grammar is not None:
            if self.tokenizer is None:
                raise TiergenError("constrained output (json_schema, regex, grammar) needs the "
                                   "model's tokenizer")
            self.constraint = Constraint(self.params.compiled_grammar, self.tokenizer)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def decoded(self, entry: PositionLogprobs) -> PositionLogprobs:
        """``entry`` with each token's text, where there is a tokenizer."""
        if self.tokenizer is not None:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.token_string(token)
        return entry

    def append(self, token: int, logprobs: PositionLogprobs | None = None) -> None:
        self.token_ids.append(token)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(self.decoded(logprobs))
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
        if self.finish_reason is None and self.constraint is not None:
            self.constraint.advance(token)
            if self.constraint.finished:
                self.finish_reason = "stop"
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
    logprobs: PositionLogprobs | None = None  # the token's, when its sequence asked


def make_sequences(prompts: list[list[int]], params: list[SamplingParams], eos_ids: list[int],
                   tokenizer: Tokenizer | None) -> list[Sequence]:
    eos = frozenset(eos_ids)
    return [Sequence(i, ids, p, eos, tokenizer and IncrementalDetokenizer(tokenizer, ids),
                     tokenizer=tokenizer)
            for i, (ids, p) in enumerate(zip(prompts, params))]


def capacity(seqs: list[Sequence]) -> int:
    """Cache slots a micro-batch needs: its longest prompt plus its largest max_tokens, twice
    that for speculative rows, whose proposals not kept leave up to as many holes (past them
    the rows decode a token a step)."""
    return max(len(s.prompt_ids) for s in seqs) + max(
        s.params.max_tokens * (2 if s.guesser else 1) for s in seqs)


def _windows(cfg: ModelConfig) -> list[int]:
    return [w for w in map(cfg.window, range(cfg.num_layers)) if w]


def _sharable(cfg: ModelConfig, seqs: list[Sequence], n: int) -> int:
    """``n`` leading tokens, short of every prompt's end (each row keeps a token of its own,
    whose logits give its first sample), or 0: under MIN_SHARED_PREFIX tokens, or where a
    sliding window would see the padding between a shared prefix and prompts of different
    lengths (a ring's window counts slots, and that padding would take slots inside it), or
    a linear-attention layer's convolution would (its window is its last inputs)."""
    n = min(n, min(len(s.prompt_ids) for s in seqs) - 1)
    windows = _windows(cfg)
    differ = len({len(s.prompt_ids) for s in seqs}) > 1
    if n < MIN_SHARED_PREFIX or differ and (
            (windows and capacity(seqs) > min(windows)) or cfg.keeps_states):
        return 0
    return n


def _on_amx(seqs: list[Sequence], activations: str) -> set[bool]:
    """Whether each of ``seqs``' prompts runs on AMX tiles (kernels.amx_prompt): a prefix is
    computed for, and serves, prompts of one kind only, so that a row's arithmetic is the
    same with and without it."""
    return {amx_prompt(len(s.prompt_ids), activations) for s in seqs}


def shared_length(executor: Executor, seqs: list[Sequence]) -> int:
    """How many leading prompt tokens ``seqs`` can compute once for all of them: their longest
    common prefix as :func:`_sharable` allows it; 0 also where the rows ask for different
    numbers of prompt log-probabilities, or only some prompts run on AMX tiles."""
    if (len(seqs) < 2 or len({s.params.prompt_logprobs for s in seqs} - {None}) > 1
            or len(_on_amx(seqs, executor.activations)) > 1):
        return 0
    return _sharable(executor.cfg, seqs, len(os.path.commonprefix([s.prompt_ids for s in seqs])))


class SharedPrefix:
    """Prompt tokens prefilled once as a single row into a cache of their own, for the rows of
    micro-batches that start with them to copy (:meth:`TieredKV.share_prefix`) instead of
    computing them; its first n tokens serve any rows that start with those. With
    ``logprobs`` it keeps the prompt log-probabilities of its tokens and the logits at its
    last one, which score the next prompt token of each row."""

    def __init__(self, executor: Executor, tokens: list[int], logprobs: int | None,
                 chunk_size: int | None, tokenizer: Tokenizer | None, prompt_length: int) -> None:
        """``prompt_length``: that of the prompts it is computed for, whose arithmetic it
        takes (:class:`MicroBatch`'s ``prompt_lengths``)."""
        self.tokens, self.length, self.logprobs = list(tokens), len(tokens), logprobs
        self.activations = executor.activations
        self.amx = amx_prompt(prompt_length, self.activations)
        self.seq = Sequence(-1, self.tokens, SamplingParams(max_tokens=1, prompt_logprobs=logprobs),
                            frozenset(), None, tokenizer=tokenizer)
        state = MicroBatchState(executor, [self.seq], chunk_size, prompt_length=prompt_length)
        try:
            while True:
                self.last = executor.forward_block([state.work()])[0]  # (1, vocab)
                if state.samples:
                    break
                for _ in state.apply(None):
                    pass
        except BaseException:
            state.cache.close()
            raise
        self.cache = state.cache

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes

    @classmethod
    def common(cls, executor: Executor, seqs: list[Sequence], length: int,
               chunk_size: int | None) -> SharedPrefix:
        """The first ``length`` tokens that every one of ``seqs`` starts with."""
        asked = {s.params.prompt_logprobs for s in seqs} - {None}
        return cls(executor, seqs[0].prompt_ids[:length], asked.pop() if asked else None,
                   chunk_size, seqs[0].tokenizer, len(seqs[0].prompt_ids))

    def serves(self, cfg: ModelConfig, seqs: list[Sequence]) -> int:
        """How many of its tokens ``seqs`` can take from it (as :func:`shared_length` counts
        for their own common prefix); 0 for none. Only all of them where a ring holds its
        last slots in place of its first, and only where it kept what the rows' prompt
        log-probabilities need."""
        if ({s.params.prompt_logprobs for s in seqs} - {None, self.logprobs}
                or _on_amx(seqs, self.activations) != {self.amx}):
            return 0
        common = min(len(os.path.commonprefix([self.tokens, s.prompt_ids])) for s in seqs)
        n = _sharable(cfg, seqs, common)
        if n == common < self.length and any(s.prompt_logprobs is not None for s in seqs):
            # it scored its own token after them, not the rows': they score the last one
            n = _sharable(cfg, seqs, n - 1)
        # a ring, or a linear-attention state, holds its last slots, not its first
        return 0 if (_windows(cfg) or cfg.keeps_states) and n < self.length else n

    def give_logprobs(self, seqs: list[Sequence], n: int) -> None:
        """Start the prompt log-probabilities of the rows that asked with those of its first
        ``n`` tokens and of the token after them."""
        rows = [s for s in seqs if s.prompt_logprobs is not None]
        if not rows:
            return
        if n < self.length:  # the token after them is one of its own: scored already
            for s in rows:
                s.prompt_logprobs = self.seq.prompt_logprobs[:n + 1]
            return
        following = torch.tensor([s.prompt_ids[n] for s in rows], device=self.last.device)
        entries = position_logprobs(self.last.expand(len(rows), -1), following,
                                    [self.logprobs] * len(rows))
        for s, entry in zip(rows, entries):
            s.prompt_logprobs = [*self.seq.prompt_logprobs, s.decoded(entry)]

    def spilled(self, spill_dir: Path) -> SharedPrefix:
        """This prefix with its cache moved to spill files under ``spill_dir`` (this one's
        closed)."""
        other = copy.copy(self)
        other.cache = self.cache.spilled(spill_dir)
        self.close()
        return other

    def close(self) -> None:
        self.cache.close()


class MicroBatchState:
    """The sequences of one micro-batch between steps: next input, slot validity, cache.

    With a :class:`SharedPrefix` of S tokens, every row's timeline opens with those S
    tokens, copied into its cache rather than computed, then the rest of its prompt,
    left-padded to the longest rest: positions count valid slots only, so the padding
    between the two changes nothing, and the first step starts at slot S."""

    def __init__(self, executor: Executor, seqs: list[Sequence],
                 chunk_size: int | None = None, key: int = 0,
                 shared: SharedPrefix | None = None, shared_tokens: int | None = None,
                 prompt_length: int | None = None) -> None:
        self.key = key  # the scheduler's name for it, the same on every rank
        # the length of the prompts whose arithmetic the rows take (a SharedPrefix's)
        self.prompt_length = prompt_length
        device = executor.device
        # the first shared_tokens (default: all) of ``shared``
        self.shared = n = 0 if shared is None else shared_tokens or shared.length
        longest = max(len(s.prompt_ids) for s in seqs)  # = n + the longest rest
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        self.slots = slots = capacity(seqs)
        valid = torch.zeros(len(seqs), slots, dtype=torch.bool)
        for row, s in enumerate(seqs):
            own = len(s.prompt_ids) - n
            ids[row, :n] = torch.tensor(s.prompt_ids[:n])
            ids[row, longest - own:] = torch.tensor(s.prompt_ids[n:])
            valid[row, :n] = True
            valid[row, longest - own:longest] = True
        self.executor = executor
        self.prompt, self.valid = ids.to(device), valid.to(device)
        # every slot's input token (the prompts, then each step's): what a draft model feeds
        self.timeline = torch.zeros(len(seqs), slots, dtype=torch.long, device=device)
        self.timeline[:, :longest] = self.prompt
        self.chunk = prefill_chunk(chunk_size, longest)
        self.cache = executor.new_cache(len(seqs), slots)
        if shared is not None:
            try:
                self.cache.share_prefix(shared.cache, n)
            except BaseException:
                self.cache.close()
                raise
            shared.give_logprobs(seqs, n)
        self.sampler = Sampler([s.params for s in seqs], [s.prompt_ids for s in seqs],
                               executor.cfg.vocab_size, device, [s.constraint for s in seqs])
        self.live = list(seqs)
        self.start, self.num_tokens = n, min(self.chunk, longest - n)
        self.ids = self.prompt[:, n:n + self.num_tokens]
        self.done = False
        self._logprobs: list[PositionLogprobs | None] | None = None  # of the tokens sampled last
        # a speculative step's proposals per row, and the logits it takes at every position
        self._drafts: list[list[int]] | None = None
        self._draft_logits: torch.Tensor | None = None
        self._draft_cache: DraftCache | None = None  # a draft model's, once it proposes
        # the last decode step: its proposals a row, when it began, and the guesser timing it
        self._last: tuple[int, float, Guesser] | None = None

    def close(self) -> None:
        """Free its cache (and a draft model's)."""
        self.cache.close()
        if self._draft_cache is not None:
            self._draft_cache.cache.close()
            self._draft_cache = None

    @property
    def decoding(self) -> bool:
        """Whether the prompts are in (each step now feeds one new token per row)."""
        return not self.done and self.start >= self.prompt.shape[1]

    def merged_shape(self, other: MicroBatchState) -> tuple[int, int]:
        """(rows, capacity) of this micro-batch once ``other`` has merged into it."""
        later = abs(self.start - other.start)
        behind = other if other.start <= self.start else self
        ahead = self if behind is other else other
        return len(self.live) + len(other.live), max(ahead.slots, behind.slots + later)

    def merge(self, other: MicroBatchState) -> None:
        """Take the sequences of ``other`` (both decoding) into this micro-batch.

        Rows are left-padded to one timeline, so the micro-batch that is behind (fewer
        slots used) is shifted later by the difference: its positions, counted from each
        row's first real token, do not change, and its new leading slots are padding.
        """
        rows, slots = self.merged_shape(other)
        end = max(self.start, other.start)
        shifts = [end - self.start, end - other.start]
        cache = self.executor.new_cache(rows, slots)
        try:
            cache.absorb([(self.cache, shifts[0]), (other.cache, shifts[1])])
        except BaseException:
            cache.close()
            raise
        valid = torch.zeros(rows, slots, dtype=torch.bool, device=self.valid.device)
        valid[:len(self.live), shifts[0]:shifts[0] + self.slots] = self.valid
        valid[len(self.live):, shifts[1]:shifts[1] + other.slots] = other.valid
        timeline = torch.zeros(rows, slots, dtype=torch.long, device=self.valid.device)
        timeline[:len(self.live), shifts[0]:shifts[0] + self.slots] = self.timeline
        timeline[len(self.live):, shifts[1]:shifts[1] + other.slots] = other.timeline
        self.close()  # a draft model's cache starts again from the merged timeline
        other.close()
        other.done = True
        self.cache, self.valid, self.slots, self.start = cache, valid, slots, end
        self.timeline = timeline
        self.ids = torch.cat([self.ids, other.ids])
        self.live = self.live + other.live
        self.sampler.extend(other.sampler)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the next step feeds (rows times chunk); 0 once decoding."""
        return 0 if self.decoding else len(self.live) * self.num_tokens

    def work(self, chunk: int | None = None) -> MicroBatch:
        """The next step's input; ``chunk`` shortens a prefill step (the rest follows)."""
        if self.decoding:
            self.timeline[:, self.start] = self.ids[:, 0]
            if drafts := self._propose():
                return self._checking(drafts)
        if chunk is not None and not self.decoding and chunk < self.num_tokens:
            self.num_tokens = chunk
            self.ids = self.prompt[:, self.start:self.start + chunk]
        prompts = None
        if self.prompt_length is not None and not self.decoding:
            prompts = torch.full((len(self.live),), self.prompt_length)
        return MicroBatch(self.ids, StepMeta.build(self.valid, self.start, self.num_tokens),
                          self.cache, self._prompt_positions(), prompts)

    def _prompt_positions(self) -> PositionLogits | None:
        """For a prompt step with rows that asked for prompt_logprobs: where their logits at
        every position go."""
        if self.decoding:
            return None
        rows = [r for r, s in enumerate(self.live) if s.prompt_logprobs is not None]
        if not rows:
            return None
        start = self.start

        def take(logits: torch.Tensor, at: int) -> None:
            # slot t predicts the token in slot t + 1; a row's prompt ends at the last slot
            slots = torch.arange(start + at, start + at + logits.shape[1], device=self.prompt.device)
            follows = slots + 1 < self.prompt.shape[1]
            targets = self.prompt[rows][:, (slots + 1).clamp(max=self.prompt.shape[1] - 1)]
            # every row's positions in one call: per row, the vocabulary-wide operations
            # were most of a scoring block's time after its products
            seqs = [self.live[r] for r in rows]
            # a row's first slot is the first it computes itself (after a shared prefix's)
            firsts = [self.prompt.shape[1] - len(seq.prompt_ids) + self.shared for seq in seqs]
            keep = torch.stack([follows & (slots >= first) for first in firsts])
            counts = keep.sum(-1).tolist()
            if not sum(counts):
                return
            tops = [seq.params.prompt_logprobs for seq, n in zip(seqs, counts) for _ in range(n)]
            entries = iter(position_logprobs(logits[keep.to(logits.device)], targets[keep], tops))
            for seq, n in zip(seqs, counts):
                seq.prompt_logprobs.extend(seq.decoded(next(entries)) for _ in range(n))

        return PositionLogits(torch.tensor(rows), take)

    @property
    def samples(self) -> bool:
        """Whether this step's logits give tokens: a prompt longer than the prefill chunk
        goes in over several steps, each chunk attending to the cache plus itself, and
        sampling starts after the last chunk."""
        return self.start + self.num_tokens >= self.prompt.shape[1]

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """This step's tokens, from its logits; their log-probabilities, for the rows that
        asked, go with them to :meth:`apply`."""
        tokens = self.sampler(logits)
        self._logprobs = self.sampler.logprobs(logits, tokens)
        return tokens

    @property
    def wants_logprobs(self) -> bool:
        """Whether a row asked for log-probabilities of its tokens or of its prompt."""
        return any(s.params.logprobs is not None or s.params.prompt_logprobs is not None
                   for s in self.live)

    def logprobs_message(self) -> tuple:
        """What :meth:`sample` found besides the tokens, for a rank that did not sample (the
        pipeline's first): the sampled tokens' log-probabilities and, when this step ends
        the prompts, the prompts' (which the sampling rank saw go by)."""
        prompts = None if self.decoding else [s.prompt_logprobs for s in self.live]
        return self._logprobs, prompts

    def take_logprobs(self, message: tuple) -> None:
        """The counterpart of :meth:`logprobs_message`, before :meth:`apply`."""
        self._logprobs, prompts = message
        for s, entries in zip(self.live, prompts or ()):
            if entries is not None:
                s.prompt_logprobs = entries

    def advance(self, logits: torch.Tensor) -> Iterator[StepEvent]:
        """Sample this step's tokens, report them, and prepare the next step."""
        if self._drafts is not None:
            return self._keep_agreed()
        return self.apply(self.sample(logits) if self.samples else None)

    def _propose(self) -> list[list[int]] | None:
        """Each row's proposals for a speculative step (engine.speculative), or None for a
        plain decode step: where no row proposes, or too few slots are left for a step of
        proposals to leave holes (the rows must still be able to decode their rest)."""
        live = [s for s in self.live if s.finish_reason is None and s.guesser]
        if not live:
            return None
        now = time.perf_counter()
        if self._last is not None and self._last[2].auto is not None:
            self._last[2].auto.timed(self._last[0], now - self._last[1])
        self._last = (0, now, live[0].guesser)
        owed = max(s.params.max_tokens - len(s.token_ids) for s in self.live
                   if s.finish_reason is None)
        k = min(max(s.guesser.k for s in live), self.slots - self.start - owed)
        if k < 1:
            return None
        ks = [0 if s.finish_reason is not None or not s.guesser else
              min(k, s.guesser.k, s.params.max_tokens - len(s.token_ids) - 1) for s in self.live]
        drafted = None
        drafter = next((s.guesser.draft for s in live if s.guesser.draft), None)
        if drafter is not None and max(ks) > 0:
            if self._draft_cache is None:
                self._draft_cache = drafter.new_cache(len(self.live), self.slots, self.chunk)
            drafted = drafter.propose(self._draft_cache, self.timeline, self.valid, self.start,
                                      self.chunk, max(ks))
        drafts = [[] if not n else drafted[r][:n] if s.guesser.draft else lookup(
            s.prompt_ids + s.token_ids, n, s.guesser.config.prompt_lookup_max)
            for r, (s, n) in enumerate(zip(self.live, ks))]
        if not any(drafts):
            return None
        self._last = (max(map(len, drafts)), now, live[0].guesser)
        return drafts

    def _checking(self, drafts: list[list[int]]) -> MicroBatch:
        """A step that feeds each row its last token and its proposals (rows with fewer
        repeat their last token; those slots are dropped after), taking every position's
        logits."""
        k = max(map(len, drafts))
        ids = self.ids.expand(-1, 1 + k).clone()
        for row, d in enumerate(drafts):
            ids[row, 1:1 + len(d)] = torch.tensor(d)
        self.timeline[:, self.start:self.start + 1 + k] = ids
        self.valid[:, self.start + 1:self.start + 1 + k] = True
        self._drafts = drafts
        self._draft_logits = None
        rows = torch.arange(len(self.live))

        def take(logits: torch.Tensor, at: int) -> None:
            if self._draft_logits is None:
                self._draft_logits = logits.new_empty(len(rows), 1 + k, logits.shape[-1])
            self._draft_logits[:, at:at + logits.shape[1]] = logits

        meta = StepMeta.build(self.valid, self.start, 1 + k)
        meta.checks = True
        return MicroBatch(ids, meta, self.cache, PositionLogits(rows, take), checks=True)

    def _keep_agreed(self) -> Iterator[StepEvent]:
        """Pick each row's tokens position by position from a speculative step's logits,
        as long as they agree with its proposals (module engine.speculative); report them,
        drop the slots of the inputs not kept, and prepare the next step."""
        drafts, logits = self._drafts, self._draft_logits
        self._drafts = self._draft_logits = None
        k = logits.shape[1] - 1
        kept = [0] * len(self.live)
        last = self.ids[:, 0].clone()
        going = [r for r, s in enumerate(self.live) if s.finish_reason is None]
        for j in range(k + 1):
            if not going:
                break
            at = logits[torch.tensor(going, device=logits.device), j]
            tokens = self.sampler(at, going)
            entries = self.sampler.logprobs(at, tokens, going) or [None] * len(going)
            agreed = []
            for r, token, entry in zip(going, tokens.tolist(), entries):
                s = self.live[r]
                s.append(token, entry)
                yield StepEvent(s, token, s.take_delta(), entry)
                kept[r], last[r] = kept[r] + 1, token
                if s.finish_reason is None and j < len(drafts[r]) and token == drafts[r][j]:
                    agreed.append(r)
            going = agreed
        for r, n in enumerate(kept):  # slots of inputs not kept: holes in the row's timeline
            self.valid[r, self.start + max(n, 1):self.start + 1 + k] = False
            if drafts[r] and (auto := self.live[r].guesser.auto) is not None:
                auto.counted(len(drafts[r]), max(n - 1, 0))
        stats = self.executor.stats
        stats.proposed_tokens += sum(map(len, drafts))
        stats.accepted_tokens += sum(max(n - 1, 0) for n in kept)
        stats.checking_steps += sum(map(bool, drafts))
        stats.decode_tokens += sum(kept) - len(self.live)  # (the step counted one a row)
        self.start += 1 + k
        self._next_step(last)

    def apply(self, tokens: torch.Tensor | None) -> Iterator[StepEvent]:
        """Report this step's sampled tokens (None for a prompt chunk that samples nothing)
        and prepare the next step."""
        if tokens is None:
            self.start += self.num_tokens
            self.num_tokens = min(self.chunk, self.prompt.shape[1] - self.start)
            self.ids = self.prompt[:, self.start:self.start + self.num_tokens]
            return
        logprobs, self._logprobs = self._logprobs or [None] * len(self.live), None
        for s, token, entry in zip(self.live, tokens.tolist(), logprobs):
            if s.finish_reason is None and s.params.max_tokens == 0:  # scored, not continued
                s.finish_reason = "length"
                yield StepEvent(s, -1, "")
            elif s.finish_reason is None:
                s.append(token, entry)
                yield StepEvent(s, token, s.take_delta(), entry)
        self.start += self.num_tokens
        self._next_step(tokens)

    def _next_step(self, tokens: torch.Tensor) -> None:
        """After a step that sampled ``tokens`` (one per row) and moved ``start`` past its
        slots: the next decode step, once finished rows have been dropped (when it pays)."""
        self.num_tokens = 1
        finished = [s.finish_reason is not None for s in self.live]
        if all(finished):
            self.done = True
            self.close()
            return
        self.valid[:, self.start] = True
        if sum(finished) * 4 >= len(self.live):  # drop finished rows once it pays
            rows = [r for r, f in enumerate(finished) if not f]
            rows_t = torch.tensor(rows, device=self.valid.device)
            self.live = [self.live[r] for r in rows]
            self.cache.keep_rows(rows_t)
            if self._draft_cache is not None:
                self._draft_cache.cache.keep_rows(rows_t)
            self.sampler.keep_rows(rows)
            self.valid, tokens = self.valid[rows_t], tokens[rows_t]
            self.timeline = self.timeline[rows_t]
        self.ids = tokens[:, None]


def run_block(executor: Executor, seqs: list[Sequence], micro_batch: int,
              chunk_size: int | None = None, share: bool = True) -> Iterator[StepEvent]:
    """Generate for a block of sequences, yielding each new token as it is produced.

    The block is cut into micro-batches of ``micro_batch`` sequences (the last may be
    smaller) that share each trip of a layer's weights; prompts are left-padded to one
    length within a micro-batch; a micro-batch leaves the block when all its sequences stop.
    A prefix that every prompt of the block starts with is computed once
    (:class:`SharedPrefix`).
    """
    groups = [seqs[i:i + micro_batch] for i in range(0, len(seqs), micro_batch)]
    longest = max(len(s.prompt_ids) for s in seqs)
    shapes = [(len(g), capacity(g)) for g in groups]
    # the prefill chunk: as asked, or cut so that each step fits the budgets
    chunk_size = executor.step_tokens(shapes, prefill_chunk(chunk_size, longest))
    executor.check_block(shapes, chunk_size)
    n = shared_length(executor, seqs) if share else 0
    shared = SharedPrefix.common(executor, seqs, n, chunk_size) if n else None
    executor.stats.shared_prompt_tokens += n * (len(seqs) - 1)
    states = []
    try:
        for g in groups:
            states.append(MicroBatchState(executor, g, chunk_size, shared=shared))
    except BaseException:
        for s in states:
            s.close()
        raise
    finally:
        if shared is not None:
            shared.close()
    try:
        while states:
            logits = executor.forward_block([s.work() for s in states])
            for state, lg in zip(states, logits):
                yield from state.advance(lg)
            states = [s for s in states if not s.done]
    finally:
        for s in states:
            s.close()
