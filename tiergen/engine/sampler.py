"""Sampling parameters and the sampler: logits and per-sequence settings in, token ids out;
and the log-probabilities of chosen tokens and their best alternatives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiergen import kernels
from tiergen.engine.constraints import Constraint, grammar_of, masked_rows
from tiergen.errors import TiergenError

MAX_LOGPROBS = 20  # most alternatives a token's log-probabilities list
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_BIAS = 100.0  # a logit bias lies in [-100, 100]


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per prompt.

    temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; ``seed`` makes
    sampling reproducible whatever else is in the batch. ``max_tokens`` 0 generates nothing
    (with ``prompt_logprobs``: the prompt is scored only).

    Before picking, the logits change as OpenAI's and vLLM's do: ``repetition_penalty``
    divides a positive logit (multiplies a negative one) of every token seen in the prompt or
    the output; ``presence_penalty`` is subtracted from every token generated so far, and
    ``frequency_penalty`` times the number of times it was generated; ``logit_bias`` (token id
    -> -100..100) is added (-100 bans a token, +100 all but forces it).

    ``logprobs=k`` reports, for each generated token, its log-probability and those of the k
    likeliest tokens; ``prompt_logprobs=k`` the same for each prompt token given those before
    it (none for the first). They are the log-softmax of the model's logits, before
    temperature, filters, penalties and bias.

    Constrained output: ``json_schema`` (a dict, or its JSON text), ``regex`` or ``grammar``
    (Lark syntax, as llguidance reads it), at most one, limits every token to those that keep
    the output on course; once the output is complete the sequence stops ("stop"). JSON is
    compact (no whitespace between tokens) unless ``flexible_json``.

    ``num_speculative_tokens`` changes the LLM's speculative decoding for this prompt: 0
    turns it off, k proposes at most k tokens a step, "auto" lets the run choose; with the
    LLM's draft model, or else by prompt lookup ("ngram"). None (the default) keeps the
    LLM's ``speculative_config``.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    flexible_json: bool = False
    num_speculative_tokens: int | str | None = None
    # the constraint compiled for llguidance (None: unconstrained)
    compiled_grammar: str | None = field(default=None, init=False, repr=False, compare=False)

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
        bias = self.logit_bias
        checks = [
            (integer(self.max_tokens) and self.max_tokens >= 0,
             f"max_tokens must be an integer >= 0, got {self.max_tokens!r}"),
            (number(self.temperature) and self.temperature >= 0,
             f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}"),
            (number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (integer(self.top_k) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"),
            (number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}"),
            (number(self.presence_penalty) and abs(self.presence_penalty) <= MAX_PENALTY,
             f"presence_penalty must be between -2 and 2, got {self.presence_penalty!r}"),
            (number(self.frequency_penalty) and abs(self.frequency_penalty) <= MAX_PENALTY,
             f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty!r}"),
            (bias is None or (isinstance(bias, dict) and all(
                integer(t) and t >= 0 and number(b) and abs(b) <= MAX_BIAS for t, b in bias.items())),
             f"logit_bias must map token ids to numbers between -100 and 100, got {bias!r}"),
            (self.seed is None or integer(self.seed), f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.num_speculative_tokens in (None, "auto") or (
                integer(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 64),
             "num_speculative_tokens must be an integer from 0 (off) to 64 or \"auto\", got "
             f"{self.num_speculative_tokens!r}"),
        ]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            checks.append((value is None or (integer(value) and 0 <= value <= MAX_LOGPROBS),
                           f"{name} must be an integer from 0 to {MAX_LOGPROBS} (or None), "
                           f"got {value!r}"))
        for ok, message in checks:
            if not ok:
                raise TiergenError(f"invalid sampling parameter: {message}")
        if not isinstance(self.flexible_json, bool):
            raise TiergenError(f"invalid sampling parameter: flexible_json must be true or "
                               f"false, got {self.flexible_json!r}")
        self.compiled_grammar = grammar_of(self.json_schema, self.regex, self.grammar,
                                           self.flexible_json)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Logprob:
    """One token's log-probability at one position, and its rank there (1: the likeliest)."""

    logprob: float
    rank: int
    decoded_token: str | None = None  # its text, where the output has text


PositionLogprobs = dict[int, Logprob]  # token id -> Logprob: the chosen token, then the top k


def position_logprobs(logits: torch.Tensor, chosen: torch.Tensor,
                      top: list[int]) -> list[PositionLogprobs]:
    """For each row of logits (N, V): the log-softmax of the chosen token and of the row's
    ``top[i]`` likeliest tokens, computed in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, chosen[:, None].long())
    ranks = ((logp > picked).sum(-1, dtype=torch.int32) + 1).tolist()  # (int32: 1.5x faster)
    best = logp.topk(max(top), dim=-1) if max(top) else None
    out = []
    for i, (token, value, rank) in enumerate(zip(chosen.tolist(), picked[:, 0].tolist(), ranks)):
        entry = {token: Logprob(value, rank)}
        if best is not None:
            ids, values = best.indices[i, :top[i]].tolist(), best.values[i, :top[i]].tolist()
            for r, (t, v) in enumerate(zip(ids, values), start=1):
                entry.setdefault(t, Logprob(v, r))
        out.append(entry)
    return out


# Per-row state a batch keeps only when one of its rows needs it: (rows, 1) coefficients and
# (rows, vocab) tables, with the value that leaves a row unchanged.
_NEUTRAL = {"repetition": 1.0, "seen": False, "presence": 0.0, "frequency": 0.0, "counts": 0.0,
            "bias": 0.0}
_WIDE = ("seen", "counts", "bias")


class Sampler:
    """Holds the per-row state sampling needs (seeded generators, seen and generated tokens,
    biases) for a batch; rows that ask for no penalty, bias or log-probabilities cost
    nothing when no row of their batch does."""

    def __init__(self, params: list[SamplingParams], prompts: list[list[int]], vocab_size: int,
                 device: torch.device,
                 constraints: list[Constraint | None] | None = None) -> None:
        self.params = params
        self.constraints = constraints or [None] * len(params)
        self.vocab_size, self.device = vocab_size, device
        self.generators = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed)
                           for p in params]
        self.state: dict[str, torch.Tensor] = {}

        def column(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(p, name + "_penalty")) for p in params],
                                device=device)[:, None]

        if any(p.repetition_penalty != 1.0 for p in params):
            self.state["repetition"] = column("repetition")
            seen = self._neutral("seen", len(params))
            for row, ids in enumerate(prompts):
                seen[row, torch.tensor(ids, dtype=torch.long)] = True
            self.state["seen"] = seen
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            self.state["presence"], self.state["frequency"] = column("presence"), column("frequency")
            self.state["counts"] = self._neutral("counts", len(params))
        if any(p.logit_bias for p in params):
            bias = self._neutral("bias", len(params))
            for row, p in enumerate(params):
                if p.logit_bias:
                    bias[row, torch.tensor(list(p.logit_bias))] = torch.tensor(
                        [float(b) for b in p.logit_bias.values()], device=device)
            self.state["bias"] = bias

    def _neutral(self, name: str, rows: int) -> torch.Tensor:
        shape = (rows, self.vocab_size if name in _WIDE else 1)
        return torch.full(shape, _NEUTRAL[name], device=self.device,
                          dtype=torch.bool if name == "seen" else torch.float32)

    def keep_rows(self, rows: list[int]) -> None:
        self.params = [self.params[r] for r in rows]
        self.generators = [self.generators[r] for r in rows]
        self.constraints = [self.constraints[r] for r in rows]
        self.state = {name: t[rows] for name, t in self.state.items()}

    def extend(self, other: Sampler) -> None:
        """Append the rows of another batch's sampler (micro-batches merging)."""
        for name in self.state.keys() | other.state.keys():
            mine = self.state.get(name, None)
            theirs = other.state.get(name, None)
            self.state[name] = torch.cat([
                mine if mine is not None else self._neutral(name, len(self.params)),
                theirs if theirs is not None else self._neutral(name, len(other.params))])
        self.params = self.params + other.params
        self.generators = self.generators + other.generators
        self.constraints = self.constraints + other.constraints

    def adjusted(self, logits: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """The logits (B, V) after each row's penalties and bias (a new tensor where any);
        ``rows``: the batch's rows that the logits are of (default: all, in order)."""
        s = self.state if rows is None else {n: t[rows] for n, t in self.state.items()}
        if "repetition" in s:
            penalised = torch.where(logits > 0, logits / s["repetition"], logits * s["repetition"])
            logits = torch.where(s["seen"], penalised, logits)
        if "counts" in s:
            logits = logits - s["frequency"] * s["counts"] - s["presence"] * (s["counts"] > 0)
        if "bias" in s:
            logits = logits + s["bias"]
        return logits

    def __call__(self, logits: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Pick one token per row from float32 logits (B, V) (left unchanged); ``rows``: the
        batch's rows they are of (default: all, in order), whose state the picks update."""
        s = self.state
        logits = self.adjusted(logits, rows)
        rows = list(range(len(self.params))) if rows is None else rows
        tokens = kernels.argmax(logits)
        constrained = [i for i, r in enumerate(rows)
                       if self.constraints[r] is not None and not self.constraints[r].finished]
        masked = dict(zip(constrained, masked_rows(
            logits, constrained, [self.constraints[rows[i]] for i in constrained]))) \
            if constrained else {}
        for i, row in enumerate(rows):
            p = self.params[row]
            row_logits = masked.get(i, logits[i])
            if not p.greedy:
                tokens[i] = self._sample_row(row_logits, p, self.generators[row])
            elif i in masked:
                tokens[i] = row_logits.argmax()
        if s:
            index = torch.tensor(rows, device=tokens.device)
            if "seen" in s:
                s["seen"][index, tokens] = True
            if "counts" in s:
                s["counts"][index, tokens] += 1
        return tokens

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[int] | None = None
                 ) -> list[PositionLogprobs | None] | None:
        """The log-probabilities of each row's chosen token and top alternatives, for the
        rows that asked (None for the others; None for all when no row asked); ``rows`` as
        for :meth:`__call__`."""
        rows = list(range(len(self.params))) if rows is None else rows
        asked = [i for i, r in enumerate(rows) if self.params[r].logprobs is not None]
        if not asked:
            return None
        index = torch.tensor(asked, device=logits.device)
        entries = position_logprobs(logits[index], tokens[index],
                                    [self.params[rows[i]].logprobs for i in asked])
        out: list[PositionLogprobs | None] = [None] * len(rows)
        for i, entry in zip(asked, entries):
            out[i] = entry
        return out

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
