"""Speculative decoding: a guesser proposes the next few tokens of a sequence, one step of
the model checks them all, and the sequence keeps those its own choices agree with.

A step feeds each row its last token and its proposals d1..dk, and takes the logits at every
position. Position j's token is picked as a decode step would pick it (the same penalties,
bias, grammar, temperature and random draw, after the tokens before it), and the row goes on
to position j + 1 only while the pick equals d(j+1); it keeps the picks, the last of which is
either the correction of a wrong proposal or, when all k agree, a token of its own. So each
row's output is exactly what the model alone picks, greedy or sampled (for proposals that do
not depend on chance, as both guessers' do not, picking and keeping the equal ones is the
rejection rule of speculative sampling), and a seeded row draws the same numbers as without
speculation. The cache slots of proposals that were not kept are marked invalid: the row's
timeline has a hole there, which positions and attention skip as they skip padding.

Two guessers: prompt lookup ("ngram", :func:`lookup`) copies what followed the text's last
tokens earlier in it; a draft model ("draft_model", :class:`DraftModel`), a smaller model of
the same vocabulary, proposes its own greedy continuation from a cache that follows the
micro-batch's timeline slot for slot, holes included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiergen.cache.step import StepMeta
from tiergen.config import ModelConfig
from tiergen.engine.executor import Executor, MicroBatch
from tiergen.errors import TiergenError

if TYPE_CHECKING:
    from tiergen.offload.kv import TieredKV

METHODS = ("ngram", "draft_model")
MAX_NGRAM = 3  # longest tail of the text that prompt lookup looks for earlier in it
MAX_SPECULATIVE_TOKENS = 64  # more proposals a step than any guesser gets right in a row
AUTO_MOST = 16  # most proposals a step under num_speculative_tokens "auto"


@dataclass
class SpeculativeConfig:
    """How to decode speculatively, spelled as vLLM's ``speculative_config``:
    ``{"method": "ngram" | "draft_model", "num_speculative_tokens": k, "model": ...}``.

    ``num_speculative_tokens``: most tokens proposed per sequence and step, or "auto" (the
    default): as many as maximise the kept tokens per second that the run measures
    (:class:`AutoLength`), up to 16.
    ``model`` (draft_model): the draft's checkpoint, GGUF or short name, of the target's
    vocabulary; it loads on the target's device with every weight there, in its own dtype
    and activations, within the target's budgets (what it holds is taken from the target's
    share). ``prompt_lookup_max`` (ngram): the longest tail of the text looked for.
    """

    method: str
    num_speculative_tokens: int | str = "auto"
    model: str | Path | None = None
    prompt_lookup_max: int = MAX_NGRAM

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise TiergenError(f"speculative_config's method must be one of {', '.join(METHODS)}, "
                               f"got {self.method!r}")
        k = self.num_speculative_tokens
        if k != "auto" and (not isinstance(k, int) or isinstance(k, bool)
                            or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise TiergenError("speculative_config's num_speculative_tokens must be an integer "
                               f"from 1 to {MAX_SPECULATIVE_TOKENS} or \"auto\", got {k!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise TiergenError("speculative_config's model names the draft model: give it with "
                               "method draft_model, and only then")
        n = self.prompt_lookup_max
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise TiergenError("speculative_config's prompt_lookup_max must be a positive "
                               f"integer, got {n!r}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from what a user gives: one already made, a dict, or its JSON text."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise TiergenError(f"speculative_config is not JSON ({e}); give an object such as "
                                   '{"method": "ngram", "num_speculative_tokens": 4}') from None
        if not isinstance(value, dict):
            raise TiergenError("speculative_config must be an object (dict) with a method, got "
                               f"{type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise TiergenError(f"speculative_config has unknown keys {', '.join(unknown)}; it "
                               f"takes {', '.join(cls.__dataclass_fields__)}")
        if "method" not in value:
            raise TiergenError(f"speculative_config needs a method ({', '.join(METHODS)})")
        return cls(**value)


def lookup(history: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Prompt lookup: the (up to) k tokens that followed the latest earlier occurrence of the
    last n tokens of ``history`` (the prompt and the output so far), for the longest n from
    ``max_ngram`` down to 1 that occurs; none where none does."""
    if k < 1 or len(history) < 2:
        return []
    ids = np.asarray(history)
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(hits):
            at = int(hits[-1]) + n
            return ids[at:at + k].tolist()
    return []


class AutoLength:
    """The number of proposals a step that maximises the tokens a sequence keeps per second.

    With a chance ``a`` that a proposal is kept once those before it were, a step of k
    proposals keeps (1 - a^(k+1)) / (1 - a) tokens on average; it costs t(k), a step's time
    from one proposal to the next (the draft model's steps, the checking pass, and what else
    the block does), which is flat while streaming the weights binds and grows with k when
    computing does. ``a`` is counted from the rows' steps, more recent ones weighing more;
    t(k) is a line through the mean times of the lengths tried, and t(0) that of plain
    steps where there were some (a checking step may take a slower path than decoding). It first tries 4 and 16
    proposals, then takes the best length of its estimates; where no length beats plain
    decoding (k = 0), it decodes plainly for a while, then tries one proposal again.
    """

    PROBES = (4, 16)  # long enough that a step that streams the weights pays for itself
    PAUSE = 16  # plain steps before trying again, where speculation does not pay
    DECAY = 0.97  # the weight of a step's counts against the next's

    def __init__(self, most: int = AUTO_MOST) -> None:
        self.most = most
        self.times: dict[int, float] = {}  # proposals a step -> mean seconds of such steps
        self.kept = self.missed = 0.0  # proposals kept, and rows' first proposals not kept
        self.paused = 0
        self.retry = False  # after a pause: one proposal, to count its chance again

    def choose(self) -> int:
        """The next step's length (the same until something is observed)."""
        if self.paused:
            return 0
        if self.retry:
            return 1
        for k in self.PROBES:
            if min(k, self.most) not in self.times:
                return min(k, self.most)
        a = (self.kept + 1) / (self.kept + self.missed + 2)
        intercept, slope = self._line()
        rates = [(1 - a ** (k + 1)) / (1 - a) / max(intercept + slope * k, 1e-9)
                 for k in range(self.most + 1)]
        if 0 in self.times:  # a plain step may take another path than a checking one
            rates[0] = 1 / max(self.times[0], 1e-9)
        return max(range(self.most + 1), key=rates.__getitem__)

    def timed(self, k: int, seconds: float) -> None:
        """A step of ``k`` proposals (0: a plain decode step) took ``seconds``."""
        old = self.times.get(k)
        self.times[k] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if self.paused:
            self.paused -= 1
            self.retry = not self.paused
        elif k == 0 and self.choose() == 0:
            self.paused = self.PAUSE
        elif k == 1:
            self.retry = False

    def counted(self, proposed: int, kept: int) -> None:
        """A row's step kept ``kept`` of its ``proposed`` proposals."""
        self.kept = self.kept * self.DECAY + kept
        self.missed = self.missed * self.DECAY + (kept < proposed)

    def _line(self) -> tuple[float, float]:
        """t(k) = intercept + slope * k, least squares over the lengths of proposals tried
        (one length: flat)."""
        ks = np.array([k for k in self.times if k], dtype=float)
        ts = np.array([t for k, t in self.times.items() if k])
        if len(ks) < 2:
            return float(ts.mean()), 0.0
        slope, intercept = np.polyfit(ks, ts, 1)
        return float(intercept), max(float(slope), 0.0)


@dataclass
class Guesser:
    """What proposes a sequence's tokens: the config, the draft model for draft_model, and
    the length controller for "auto"."""

    config: SpeculativeConfig
    draft: DraftModel | None = None

    def __post_init__(self) -> None:
        auto = self.config.num_speculative_tokens == "auto"
        self.auto = AutoLength() if auto else None

    @property
    def k(self) -> int:
        """Most proposals for the next step."""
        return self.auto.choose() if self.auto else self.config.num_speculative_tokens


class DraftCache:
    """A draft model's cache for one micro-batch: the same rows and slots as the
    micro-batch's own, computed up to (not including) slot ``filled``."""

    def __init__(self, cache: TieredKV) -> None:
        self.cache, self.filled = cache, 0


class DraftModel:
    """A smaller model proposing its greedy continuation.

    Its cache follows the micro-batch's timeline slot for slot and takes the micro-batch's
    valid slots as its own, so that a row's positions and what it attends to are the
    target's. To propose from slot ``start`` (where the micro-batch's next input goes), it
    first feeds the slots it has not computed (the prompt, the last proposal of a step that
    kept them all, the input at ``start``), then its own picks one slot at a time. A slot it
    computed from its own proposal holds the token the target fed there, or is a hole.
    """

    def __init__(self, executor: Executor, vocab_size: int) -> None:
        self.executor = executor
        self.vocab_size = vocab_size  # the target's: a draft's extra (padding) rows never win

    def new_cache(self, rows: int, slots: int, chunk: int) -> DraftCache:
        self.executor.check_block([(rows, slots)], chunk, "the draft model's cache")
        return DraftCache(self.executor.new_cache(rows, slots))

    def propose(self, draft: DraftCache, timeline: torch.Tensor, valid: torch.Tensor,
                start: int, chunk: int, k: int) -> list[list[int]]:
        """k greedy tokens for every row of a micro-batch whose next input, at slot
        ``start``, is in its ``timeline`` (every slot's input token); ``valid`` its valid
        slots, ``chunk`` its prefill chunk."""
        valid = valid.clone()
        valid[:, start:start + k] = True  # the draft's own inputs, while it proposes
        logits = None
        while draft.filled <= start:  # what it has not seen, in prefill chunks
            end = min(start + 1, draft.filled + chunk)
            logits = self._step(timeline[:, draft.filled:end], valid, draft, end)
        picks = [logits.argmax(-1)]
        for j in range(1, k):
            logits = self._step(picks[-1][:, None], valid, draft, start + j + 1)
            picks.append(logits.argmax(-1))
        return torch.stack(picks, 1).tolist()

    def _step(self, ids: torch.Tensor, valid: torch.Tensor, draft: DraftCache, end: int
              ) -> torch.Tensor:
        ex, T = self.executor, ids.shape[1]
        meta = StepMeta.build(valid.to(ex.device), end - T, T)
        logits = ex.forward_block([MicroBatch(ids.to(ex.device), meta, draft.cache)])[0]
        draft.filled = end
        return logits[:, :self.vocab_size]


def check_vocabularies(target, draft) -> None:
    """Refuse a draft model whose token ids do not mean the target's (ModelFiles both)."""
    a, b = target.tokenizer, draft.tokenizer
    if a is not None and b is not None:
        same = a.backend.get_vocab(with_added_tokens=True) == \
            b.backend.get_vocab(with_added_tokens=True)
    else:
        same = target.config.vocab_size == draft.config.vocab_size
    if not same:
        raise TiergenError(f"the draft model {draft.name} has another vocabulary than "
                           f"{target.name}: its token ids mean other tokens, so its proposals "
                           "would be wrong; give a draft of the same tokenizer (a smaller model "
                           "of the same family, or a quantised copy)")


def check_speculation(cfg: ModelConfig, spec: SpeculativeConfig | None, batch_invariant: bool,
                      parallel: bool, what: str = "this model") -> None:
    """Refuse, naming why, speculation that cannot keep its promise for ``cfg``'s model."""
    if spec is None:
        return
    why = None
    if cfg.keeps_states:
        why = "its linear-attention states cannot drop the proposals that are not kept"
    elif any(map(cfg.window, range(cfg.num_layers))):
        why = "a sliding window counts cache slots, and the dropped proposals would take some"
    elif batch_invariant:
        why = ("batch invariance promises a row the same numbers whatever runs beside it, and a "
               "checking step's shape depends on the other rows' proposals")
    elif parallel:
        why = "it runs in one process only (not over pipeline or tensor ranks)"
    if why:
        raise TiergenError(f"speculative decoding is not available for {what} or setting: "
                           f"{why}; run without speculative_config")
