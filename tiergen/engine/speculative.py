"""Speculative decoding: a guesser proposes the next few tokens of a sequence, one step of
the model checks them all, and the sequence keeps those its own choices agree with.

A step feeds each row its last token and its proposals d1..dk, and takes the logits at every
position. Position j's token is picked as a decode step would pick it (the same penalties,
bias, grammar, temperature and random draw, after the tokens before it), and the row goes on
to position j + 1 only while the pick equals d(j+1); it keeps the picks, the last of which is
either the correction of a wrong proposal or, when all k agree, a token of its own. So each
row's output is exactly what the model alone picks, greedy or sampled (for proposals that do
not depend on chance, as these do not, picking and keeping the equal ones is the rejection
rule of speculative sampling), and a seeded row draws the same numbers as without
speculation. The cache slots of proposals that were not kept are marked invalid: the row's
timeline has a hole there, which positions and attention skip as they skip padding.
"""

from __future__ import annotations

import numpy as np

from tiergen.config import ModelConfig
from tiergen.errors import TiergenError

GUESSERS = ("prompt-lookup",)
MAX_NGRAM = 3  # longest tail of the text that prompt lookup looks for earlier in it


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


def check_speculation(cfg: ModelConfig, guesser: str | None, draft_tokens: int,
                      batch_invariant: bool, parallel: bool) -> None:
    """Refuse, naming why, speculation that cannot keep its promise for this model."""
    if guesser is None:
        return
    if guesser not in GUESSERS:
        raise TiergenError(f"speculative must be one of {', '.join(GUESSERS)} (or None), "
                           f"got {guesser!r}")
    if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) or draft_tokens < 1:
        raise TiergenError(f"draft_tokens must be a positive integer, got {draft_tokens!r}")
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
        raise TiergenError(f"speculative decoding is not available for this model or setting: "
                           f"{why}; run without speculative")
