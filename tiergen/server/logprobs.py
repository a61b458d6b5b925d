"""What a response reports beside each choice's text: the prompt echoed (completions' ``echo``)
and log-probabilities, in the legacy completions format (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``) or the chat format (``content``: token, logprob, bytes,
top_logprobs)."""

from __future__ import annotations

from typing import Protocol

from tiergen.engine.sampler import PositionLogprobs
from tiergen.server.protocol import GenerationRequest
from tiergen.tokenizer import Tokenizer

LOWEST = -9999.0  # what JSON gets for -inf, as OpenAI writes it


def _finite(value: float) -> float:
    return max(value, LOWEST)


def _best_first(entry: PositionLogprobs) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda p: -p[1])


class Output(Protocol):
    """A finished choice as the engine leaves it: a scheduled Sequence, or a GenerationResult
    of ``LLM.generate``."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None
    prompt_logprobs: list[PositionLogprobs | None] | None


class Report:
    """The echo and log-probabilities of one request's choices (choice i answers prompt
    i // n). Legacy ``top_logprobs`` hold the k likeliest tokens and the chosen one, best
    first; chat's hold the k likeliest. ``text_offset`` counts characters of the choice's
    text, the echoed prompt included, across a stream's chunks too."""

    def __init__(self, body: GenerationRequest, prompts: list[list[int]],
                 tokenizer: Tokenizer | None, chat: bool) -> None:
        self.chat, self.tokenizer, self.prompts = chat, tokenizer, prompts
        self.top = body.top_logprobs_wanted()  # None: no log-probabilities
        self.n = body.num_choices
        self.echo: list[str] | None = None
        if body.echo_prompt:
            self.echo = [p if isinstance(p, str) else self._decode(ids)
                         for p, ids in zip(body.prompts(), prompts)]
        self._offsets: dict[int, int] = {}
        # id(entry) -> (entry, token_logprob, top_logprobs): rows that share a prompt prefix
        # share its entries, which are then written once per request, not once per row
        self._done: dict[int, tuple[PositionLogprobs, float, dict[str, float]]] = {}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _text(self, token: int) -> str:
        return self.tokenizer.token_string(token) if self.tokenizer is not None else ""

    def start(self, choice: int, prompt_logprobs: list[PositionLogprobs | None] | None
              ) -> tuple[str, dict | None]:
        """What comes before the generated text: the echoed prompt and its log-probabilities
        (``prompt_logprobs``, the choice's sequence's)."""
        if self.echo is None:
            return "", None
        logprobs = None
        if self.top is not None and prompt_logprobs is not None:
            logprobs = self._legacy(choice, self.prompts[choice // self.n], prompt_logprobs)
        return self.echo[choice // self.n], logprobs

    def tokens(self, choice: int, ids: list[int],
               entries: list[PositionLogprobs] | None) -> dict | None:
        """The log-probabilities of generated tokens (None when not asked)."""
        if self.top is None or entries is None:
            return None
        return self._chat(ids, entries) if self.chat else self._legacy(choice, ids, entries)

    def whole(self, choice: int, out: Output) -> tuple[str, dict | None]:
        """A finished choice's text and log-probabilities, the echo included."""
        self._offsets.pop(choice, None)
        text, before = self.start(choice, out.prompt_logprobs)
        after = self.tokens(choice, out.token_ids, out.logprobs)
        if before is not None and after is not None:
            after = {key: before[key] + after[key] for key in before}
        return text + out.text, after or before

    def _legacy(self, choice: int, ids: list[int],
                entries: list[PositionLogprobs | None]) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        at = self._offsets.get(choice, 0)
        for token, entry in zip(ids, entries):
            text = self._text(token)
            tokens.append(text)
            offsets.append(at)
            at += len(text)
            if entry is None:  # the first prompt token: nothing before it
                values.append(None)
                tops.append(None)
                continue
            done = self._done.get(id(entry))
            if done is None or done[0] is not entry:
                top: dict[str, float] = {}
                for t, value in _best_first(entry):
                    top.setdefault(self._text(t), _finite(value))
                done = self._done[id(entry)] = (entry, _finite(entry[token].logprob), top)
            values.append(done[1])
            tops.append(done[2])
        self._offsets[choice] = at
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _chat(self, ids: list[int], entries: list[PositionLogprobs]) -> dict:
        def item(token: int, value: float) -> dict:
            raw = self.tokenizer.token_bytes(token) if self.tokenizer is not None else b""
            return {"token": self._text(token), "logprob": _finite(value), "bytes": list(raw)}

        return {"content": [
            {**item(token, entry[token].logprob),
             "top_logprobs": [item(t, v) for t, v in _best_first(entry)[:self.top]]}
            for token, entry in zip(ids, entries)]}
