"""OpenAI's wire format: request models with their validation, and the response and stream
chunk objects of the completions and chat completions endpoints."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from tiergen.engine.sampler import MAX_LOGPROBS, SamplingParams
from tiergen.errors import TiergenError
from tiergen.server.errors import APIError, bad_request

MAX_N = 64  # most choices per request
MAX_STOP = 4  # most stop sequences per request, as OpenAI allows
# OpenAI's documented ranges for the numeric fields, inclusive
RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
          "frequency_penalty": (-2.0, 2.0)}
ROLES = ("system", "user", "assistant", "developer")  # developer: OpenAI's newer name for system

# What a field must look like, for the fields whose type is a union (pydantic reports one
# error per alternative, which says less than this).
_EXPECTED = {
    "prompt": "'prompt' must be a string, a list of token ids, or a non-empty list of strings "
              "or of token-id lists",
    "stop": "'stop' must be a string or a list of strings",
    "messages": "each message must be an object with a string 'role' and a 'content' that is a "
                "string or a list of {'type': 'text', 'text': ...} parts (only text is supported)",
}


class _Strict(BaseModel):
    # JSON types are checked as they are ("5" is not an integer); unknown fields are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class GenerationRequest(_Strict):
    """The fields both endpoints share. ``None`` means "not given" for every optional field."""

    logprobs_field: ClassVar[str] = "logprobs"  # the field that says how many alternatives

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # tiergen's (and vLLM's) extensions
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    response_format: dict | None = None
    flexible_json: bool | None = None  # JSON output with free whitespace (default: compact)
    num_speculative_tokens: int | str | None = None  # 0: no speculative decoding (SamplingParams)

    def refused(self) -> dict[str, bool]:
        """Unsupported fields and whether this request sets them."""
        return {}

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token the request wants log-probabilities of (None: none)."""
        return None

    @property
    def echo_prompt(self) -> bool:
        """Whether each choice starts with its prompt (completions' echo)."""
        return False

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys read as token ids."""
        if not self.logit_bias:
            return None
        bad = [t for t in self.logit_bias if not t.isdigit()]
        if bad:
            raise bad_request(f"'logit_bias' keys must be token ids (digits in a string), got "
                              f"{bad[0]!r}", "logit_bias", "invalid_value")
        return {int(t): b for t, b in self.logit_bias.items()}

    def check_supported(self) -> None:
        """Refuse values outside OpenAI's documented ranges, then fields tiergen lacks."""
        for name, (low, high) in RANGES.items():
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise bad_request(f"'{name}' must be between {low:g} and {high:g}, got {value}",
                                  name, "invalid_value")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise bad_request(f"'stop' takes at most {MAX_STOP} sequences, got {len(self.stop)}",
                              "stop", "invalid_value")
        for token, bias in (self.logit_bias or {}).items():
            if not -100 <= bias <= 100:
                raise bad_request(f"'logit_bias' values must be between -100 and 100, got {bias} "
                                  f"for token {token}", "logit_bias", "invalid_value")
        top = self.top_logprobs_wanted()
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            name = self.logprobs_field
            raise bad_request(f"'{name}' must be between 0 and {MAX_LOGPROBS}, got {top}", name,
                              "invalid_value")
        for name, used in self.refused().items():
            if used:
                raise bad_request(f"'{name}' is not supported by this server; leave it out",
                                  name, "unsupported_parameter")
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise bad_request(f"'n' must be between 1 and {MAX_N}, got {self.n}", "n",
                              "invalid_value")

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """The field that sets the number of tokens to generate, and its value."""
        return "max_tokens", self.max_tokens

    def json_schema(self) -> dict | None:
        """The JSON schema ``response_format`` asks the output to follow: json_object's is any
        object; None for text or no response_format."""
        rf = self.response_format
        kind = (rf or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind != "json_schema":
            raise bad_request(f"'response_format.type' must be 'text', 'json_object' or "
                              f"'json_schema', got {kind!r}", "response_format.type",
                              "invalid_value")
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad_request("'response_format.json_schema' must be an object with a 'name' "
                              "and a 'schema' object", "response_format.json_schema",
                              "invalid_value")
        return spec.get("schema", {"type": "object"})

    def sampling_params(self, max_tokens: int) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i gets seed + i."""
        top, bias = self.top_logprobs_wanted(), self.token_bias()
        schema = self.json_schema()
        try:
            return [SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                seed=None if self.seed is None else self.seed + i,
                stop=self.stop, ignore_eos=bool(self.ignore_eos),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0, logit_bias=bias,
                logprobs=top, prompt_logprobs=top if self.echo_prompt else None,
                json_schema=schema, flexible_json=bool(self.flexible_json),
                num_speculative_tokens=self.num_speculative_tokens)
                for i in range(self.num_choices)]
        except TiergenError as e:
            raise sampling_error(e) from None


def sampling_error(e: TiergenError, param: str | None = None) -> APIError:
    """A 400 for an error of the engine's; one that reads "invalid sampling parameter: NAME
    must ..." ("stop strings must ..." for stop) names the field by the word after the colon."""
    message = str(e)
    if message.startswith("invalid sampling parameter:"):
        param = message.partition(": ")[2].split(" ")[0].rstrip(":") or None
    if param == "json_schema":  # the only way a request gives one
        param = "response_format"
    return bad_request(message, param)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str | list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refused(self) -> dict[str, bool]:
        return {**super().refused(), "best_of": self.best_of not in (None, 1),
                "suffix": bool(self.suffix)}

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        return bool(self.echo)

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one string or token-id list, or a list of those."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise bad_request("'prompt' is empty; give a string or a list of token ids", "prompt")
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logprobs_field: ClassVar[str] = "top_logprobs"
    tools: list[dict] | None = None

    def refused(self) -> dict[str, bool]:
        return {**super().refused(), "tools": bool(self.tools)}

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs",
                              "invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def conversation(self, template: str | None = None) -> list[dict[str, str]]:
        return conversation(self.messages, template)


def conversation(messages: list[ChatMessage], template: str | None = None) -> list[dict[str, str]]:
    """The messages as the chat template takes them. Roles are OpenAI's (developer is read
    as system) or another role that ``template``, the model's template source, names."""
    if not messages:
        raise bad_request("'messages' is empty; give at least one message, e.g. "
                          "[{\"role\": \"user\", \"content\": \"Hello\"}]", "messages")
    for i, m in enumerate(messages):
        known = m.role in ROLES or (template is not None and m.role.isidentifier() and
                                    any(f"{q}{m.role}{q}" in template for q in "'\""))
        if not known:
            raise bad_request(f"'messages[{i}].role' is '{m.role}'; it must be one of "
                              f"{', '.join(ROLES[:3])}", f"messages[{i}].role", "invalid_value")
    return [m.as_template_input() for m in messages]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text ``prompt``, or chat ``messages`` through the chat template.
    ``add_special_tokens`` defaults to true for a prompt and false for messages (the
    template writes its own)."""

    EXPECTED: ClassVar[dict[str, str]] = {"prompt": "'prompt' must be a string"}
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


R = TypeVar("R", bound=_Strict)


def parse(model: type[R], body: bytes) -> R:
    """Validate a JSON body; a wrong body raises a 400 APIError that says what is wrong."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        loc = error["loc"]
        if error["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {error['ctx']['error']}") from None
        if not loc:
            raise bad_request("the request body must be a JSON object") from None
        name = str(loc[0])
        expected = {**_EXPECTED, **getattr(model, "EXPECTED", {})}
        if name in expected and (len(loc) > 1 or error["type"] != "missing"):
            where = f"{name}[{loc[1]}]" if len(loc) > 1 and isinstance(loc[1], int) else name
            raise bad_request(f"{expected[name]} (problem at '{where}')", where) from None
        if error["type"] == "missing":
            raise bad_request(f"'{name}' is required", name) from None
        path = name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
        raise bad_request(f"'{path}': {error['msg']}, got {error['input']!r}", path) from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Envelope:
    """Builds the objects of one response: its id, model and creation time, in the shape of
    the completions (``chat=False``) or chat completions endpoint."""

    model: str
    chat: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _object(self, kind: str, choices: list[dict]) -> dict:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def response(self, texts: list[tuple[str, str, dict | None]], prompt_tokens: int,
                 completion_tokens: int) -> dict:
        """The whole answer: one (text, finish_reason, logprobs) per choice."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs, "finish_reason": reason}
                       for i, (text, reason, logprobs) in enumerate(texts)]
        else:
            choices = [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
                       for i, (text, reason, logprobs) in enumerate(texts)]
        body = self._object("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    def chunk(self, index: int, text: str, finish_reason: str | None = None,
              role: Literal["assistant"] | None = None,
              usage_so_far: tuple[int, int] | None = None, logprobs: dict | None = None) -> dict:
        """One streamed piece of one choice; with ``usage_so_far`` (prompt tokens, tokens
        generated so far) it carries a usage object too."""
        if self.chat:
            delta = {"role": role, "content": text} if role else {"content": text} if text else {}
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        body = self._object("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if usage_so_far is not None:
            body["usage"] = usage(*usage_so_far)
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk when the client asked for ``stream_options.include_usage``."""
        body = self._object("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
