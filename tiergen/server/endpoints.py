"""What the endpoints make of a request body: validation, the prompts' token ids and sampling
parameters the engine runs, and the answer built from its results. The HTTP server and
``tiergen run-batch`` both go through here, so a batch line is answered as the server would
answer it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiergen.engine.llm import LLM, Prompt
from tiergen.engine.sampler import SamplingParams
from tiergen.errors import TiergenError
from tiergen.server.errors import APIError, bad_request
from tiergen.server.logprobs import Output, Report
from tiergen.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                     DetokenizeRequest, Envelope, GenerationRequest,
                                     TokenizeRequest, conversation, parse)
from tiergen.tokenizer import Tokenizer

COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"


@dataclass
class Prepared:
    """A validated generation request: its prompts, one SamplingParams per choice, the
    envelope its answer goes out in, and the report of its echo and log-probabilities."""

    body: GenerationRequest
    prompts: list[list[int]]
    params: list[SamplingParams]
    envelope: Envelope
    report: Report
    param: str  # the field a problem with the prompts is reported against

    def inputs(self) -> tuple[list[list[int]], list[SamplingParams]]:
        """What the engine runs: every choice of every prompt, prompt by prompt."""
        return [p for p in self.prompts for _ in self.params], self.params * len(self.prompts)

    @property
    def num_sequences(self) -> int:
        return len(self.prompts) * len(self.params)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def response(self, outputs: Sequence[Output], completion_tokens: int) -> dict:
        """The whole answer, from each sequence's finished output in ``inputs`` order (its
        text, finish reason and, when asked for, log-probabilities and echoed prompt)."""
        choices = []
        for i, out in enumerate(outputs):
            text, logprobs = self.report.whole(i, out)
            choices.append((text, out.finish_reason or "length", logprobs))
        return self.envelope.response(choices, self.prompt_tokens, completion_tokens)


class Endpoints:
    """The endpoints' work that needs no scheduler, over one model.

    ``model_names``: the names requests may ask for (the model's own name is always
    accepted); ``default_max_tokens`` applies to requests that give none; ``chat_template``
    replaces the model's.
    """

    def __init__(self, llm: LLM, model_names: Sequence[str], default_max_tokens: int,
                 chat_template: str | None) -> None:
        self.llm = llm
        self.model_names = list(model_names) or [llm.name]
        self.default_max_tokens = default_max_tokens
        self.chat_template = chat_template

    # -- checks ----------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.model_names and name != self.llm.name:
            raise APIError(404, f"the model '{name}' does not exist; this server has "
                                f"'{self.model_names[0]}'", "model", "model_not_found")

    def encode(self, prompt: Prompt, param: str) -> list[int]:
        try:
            return self.llm.encode(prompt)
        except TiergenError as e:
            raise bad_request(str(e), param) from None

    def chat_tokens(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
        """A conversation's prompt through the chat template (the server's, else the model's)."""
        tokenizer = self.llm.tokenizer
        template = self.chat_template or (tokenizer and tokenizer.chat_template)
        turns = conversation(messages, template)
        try:
            return self.llm.chat_prompt(turns, self.chat_template, add_generation_prompt,
                                        add_special_tokens)
        except TiergenError as e:
            raise bad_request(str(e), "messages") from None

    def max_tokens(self, body: GenerationRequest, prompts: list[list[int]], param: str) -> int:
        """The request's max_tokens (or the default, within the context), checked."""
        name, requested = body.requested_max_tokens()
        context = self.llm.config.context_length
        longest = max(len(p) for p in prompts)
        if requested is not None and requested < 1 and not (requested == 0 and body.echo_prompt):
            raise bad_request(f"'{name}' must be a positive integer (0 only with echo), got "
                              f"{requested}", name)
        if requested is not None and requested > context:
            raise bad_request(f"'{name}' is {requested}, beyond the model's context of {context} "
                              "tokens", name, "context_length_exceeded")
        if longest >= context:
            raise bad_request(f"the prompt is too long: {longest} tokens, and the model's context "
                              f"holds {context} (prompt and generated tokens together)", param,
                              "context_length_exceeded")
        if requested is None:
            return min(self.default_max_tokens, context - longest)
        if longest + requested > context:
            raise bad_request(f"the prompt's {longest} tokens plus {name}={requested} exceed the "
                              f"model's context of {context} tokens; shorten the prompt or lower "
                              f"{name}", name, "context_length_exceeded")
        return requested

    # -- generation requests ---------------------------------------------------------------
    def completion(self, raw: bytes) -> Prepared:
        """A /v1/completions body, validated and tokenised."""
        body = parse(CompletionRequest, raw)
        self.check_model(body.model)
        body.check_supported()
        prompts = [self.encode(p, "prompt") for p in body.prompts()]
        return self._prepared(body, prompts, chat=False, param="prompt")

    def chat(self, raw: bytes) -> Prepared:
        """A /v1/chat/completions body, validated and rendered through the chat template."""
        body = parse(ChatCompletionRequest, raw)
        self.check_model(body.model)
        body.check_supported()
        return self._prepared(body, [self.chat_tokens(body.messages)], chat=True,
                              param="messages")

    def prepare(self, url: str, raw: bytes) -> Prepared:
        """The body of a request to ``url`` (one of COMPLETIONS, CHAT_COMPLETIONS)."""
        return {COMPLETIONS: self.completion, CHAT_COMPLETIONS: self.chat}[url](raw)

    def _prepared(self, body: GenerationRequest, prompts: list[list[int]], chat: bool,
                  param: str) -> Prepared:
        params = body.sampling_params(self.max_tokens(body, prompts, param))
        report = Report(body, prompts, self.llm.tokenizer, chat)
        return Prepared(body, prompts, params, Envelope(body.model, chat=chat), report, param)

    # -- tokens ----------------------------------------------------------------------------
    def _tokenizer(self) -> Tokenizer:
        if self.llm.tokenizer is None:
            raise bad_request(f"the model {self.llm.name} has no tokenizer files")
        return self.llm.tokenizer

    def tokenize(self, raw: bytes) -> dict:
        """/tokenize (vLLM's): a prompt's tokens, or a chat's through the chat template."""
        body = parse(TokenizeRequest, raw)
        if body.model is not None:
            self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either 'prompt' (a string) or 'messages' (a chat)" +
                              (", not both" if body.prompt is not None else ""),
                              "messages" if body.prompt is not None else "prompt")
        tokenizer = self._tokenizer()
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = tokenizer.encode(body.prompt, add_special_tokens=special)
        else:  # the template writes the special tokens it wants; more only when asked for
            tokens = self.chat_tokens(body.messages, body.add_generation_prompt,
                                      bool(body.add_special_tokens))
        return {"tokens": tokens, "count": len(tokens),
                "max_model_len": self.llm.config.context_length}

    def detokenize(self, raw: bytes) -> dict:
        """/detokenize (vLLM's): the text of token ids, special tokens included."""
        body = parse(DetokenizeRequest, raw)
        if body.model is not None:
            self.check_model(body.model)
        tokenizer = self._tokenizer()
        size = tokenizer.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < size:
                raise bad_request(f"'tokens[{i}]' is {t}, which is no token id: the vocabulary "
                                  f"holds ids 0..{size - 1}", f"tokens[{i}]", "invalid_value")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        """/tokenizer_info (vLLM's): the special tokens and the chat template, what a client
        that tokenizes through /tokenize (lm-evaluation-harness) reads first."""
        tokenizer = self._tokenizer()
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        return {"tokenizer_class": "tiergen",
                "bos_token": tokenizer.token_text(tokenizer.bos_token_id),
                "eos_token": tokenizer.token_text(eos),
                "pad_token": tokenizer.token_text(tokenizer.pad_token_id),
                "chat_template": tokenizer.chat_template,
                "model_max_length": self.llm.config.context_length}
