"""Constrained output: a JSON schema, a regular expression or a Lark grammar that a
sequence's tokens must follow.

llguidance does the work: it compiles the constraint lazily (a schema in about a
millisecond) and computes each step's allowed tokens as a bitmask over the vocabulary
(about 0.2 ms a token for a 49k vocabulary). A `Constraint` is one sequence's matcher; the
sampler masks its row's logits with it and advances it with each token it picks.

JSON comes out compact by default: "," and ":" and no whitespace between tokens, as OpenAI's
structured outputs write it. With free whitespace a sampled answer can wander into newlines
until ``max_tokens`` cuts it (4 of 12 answers at temperature 1.0 never closed under a two-field
schema). ``flexible_json`` allows the whitespace again; a schema's own ``x-guidance`` options
win over either.
"""

from __future__ import annotations

import json
import weakref

import numpy as np
import torch

from tiergen.errors import TiergenError
from tiergen.tokenizer import Tokenizer

# llguidance's tokenizer for each of ours: building one reads the whole vocabulary (~0.5 s)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EXECUTOR = None  # llguidance's thread pool, for the masks of several rows at once
# llguidance's JSON options for each form (a schema's "x-guidance" is applied over them)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
FLEXIBLE_JSON = {"whitespace_flexible": True}


def grammar_of(json_schema: dict | str | None = None, regex: str | None = None,
               grammar: str | None = None, flexible_json: bool = False) -> str | None:
    """The llguidance grammar for at most one of a JSON schema (a dict or its text), a
    regular expression or a Lark grammar; None for none. A JSON schema's output is compact
    unless ``flexible_json``. A TiergenError names what is wrong with an invalid one."""
    given = [(name, value) for name, value in
             (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
             if value is not None]
    if flexible_json and json_schema is None:
        raise TiergenError("invalid sampling parameter: flexible_json applies to a json_schema "
                           "only; leave it out or give a json_schema")
    if not given:
        return None
    import llguidance  # only when a request is constrained: loading it costs resident memory

    if len(given) > 1:
        raise TiergenError("invalid sampling parameter: json_schema, regex and grammar are "
                           f"exclusive; got {' and '.join(n for n, _ in given)}")
    name, value = given[0]
    M = llguidance.LLMatcher
    if name == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise TiergenError(f"invalid sampling parameter: json_schema is not valid "
                                   f"JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise TiergenError(f"invalid sampling parameter: json_schema must be a JSON "
                               f"object, got {type(value).__name__}")
        try:
            text = M.grammar_from_json_schema(
                value, defaults=FLEXIBLE_JSON if flexible_json else COMPACT_JSON)
        except ValueError as e:
            raise TiergenError(f"invalid sampling parameter: json_schema: {e}") from None
    elif not isinstance(value, str):
        raise TiergenError(f"invalid sampling parameter: {name} must be a string, "
                           f"got {type(value).__name__}")
    else:
        text = M.grammar_from_regex(value) if name == "regex" else M.grammar_from_lark(value)
    error = M.validate_grammar(text)
    if error:
        raise TiergenError(f"invalid sampling parameter: {name} is not valid: {error.strip()}")
    return text


def _ll_tokenizer(tokenizer: Tokenizer):
    import llguidance

    found = _TOKENIZERS.get(tokenizer)
    if found is None:
        found = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                       eos_token=tokenizer.eos_token_ids or None)
        _TOKENIZERS[tokenizer] = found
    return found


class Constraint:
    """One sequence's place in its grammar."""

    def __init__(self, grammar: str, tokenizer: Tokenizer) -> None:
        import llguidance

        self.tokenizer = _ll_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise TiergenError(f"constrained output failed: {self.matcher.get_error()}")

    def advance(self, token: int) -> None:
        """Take the token the sampler picked (one the mask allowed)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
            self._check()

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete and allows nothing more."""
        return self.matcher.is_stopped()


def masked_rows(logits: torch.Tensor, rows: list[int],
                constraints: list[Constraint]) -> torch.Tensor:
    """Those ``rows`` of ``logits`` (B, V), copied, with every token their constraints forbid
    at -inf: (len(rows), V). The other rows are left alone, so they cost nothing."""
    import llguidance.torch as lt

    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    bitmask = lt.allocate_token_bitmask(len(rows), constraints[0].tokenizer.vocab_size)
    lt.fill_next_token_bitmask_par(_EXECUTOR, [(c.matcher, i) for i, c in enumerate(constraints)],
                                   bitmask)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(bits.view(np.bool_))
    width = logits.shape[1]
    if allowed.shape[1] < width:  # the model's padded vocabulary past the tokenizer's
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
    out = logits.index_select(0, torch.tensor(rows, device=logits.device))
    return out.masked_fill_(~allowed[:, :width].to(logits.device), float("-inf"))
