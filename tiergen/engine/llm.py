"""The LLM facade: load a model once, then generate for batches of prompts or chat."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tiergen.engine.config import EngineConfig
from tiergen.engine.generate import Sequence
from tiergen.engine.runner import open_runner
from tiergen.engine.sampler import PositionLogprobs, SamplingParams
from tiergen.engine.speculative import SpeculativeConfig
from tiergen.errors import TiergenError
from tiergen.offload.policy import Policy
from tiergen.weights import ModelFiles

Prompt = str | list[int]
Message = dict[str, str]

@dataclass
class GenerationResult:
    """One prompt's output. ``token_ids`` are the generated ids (including a final EOS).

    With SamplingParams.logprobs, ``logprobs`` has one {token id: Logprob} per generated
    token (the chosen one, then the likeliest); with prompt_logprobs, ``prompt_logprobs`` one
    per prompt token, None for the first.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class StreamEvent:
    """A piece of one prompt's output, as soon as it is produced."""

    index: int  # which prompt
    token_id: int
    text: str  # new text since the last event of this prompt
    finish_reason: str | None
    logprobs: PositionLogprobs | None = None  # the token's, when the prompt asked for them


class _OfRunner:
    """An attribute of the LLM whose home is its runner, read and set through the LLM."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, llm: LLM | None, owner: type | None = None):
        return self if llm is None else getattr(llm.runner, self.name)

    def __set__(self, llm: LLM, value) -> None:
        setattr(llm.runner, self.name, value)


class LLM:
    """A loaded model.

    ``policy`` places weights, KV cache and activations on device, host RAM and disk;
    ``device_memory``/``host_memory`` are budgets (bytes or "8G") a plan must fit;
    ``compile=True`` compiles batch-1 CPU matmuls (faster decode after a few seconds of
    compilation on first use); ``prefill_chunk_size`` feeds long prompts in chunks that each
    attend to the cache plus themselves, so prefill memory grows with chunk x context rather
    than context squared (None: whole prompts at once; "auto": chunks of 1,024 on a CPU and
    512 on a GPU, or whole prompts where batch invariant); ``share_prefixes`` computes a
    prompt prefix that every sequence of a block (or of a server micro-batch) starts with
    once, and copies its cache into each row (False: every row computes its whole prompt;
    None: True, or False where batch invariant).
    ``packed=False`` decodes a GGUF's quantised matrices at load (by default they stay in
    their blocks and are multiplied packed). ``activations`` says how those products treat
    their inputs: "auto" (int8 on a CPU, float32 elsewhere), "int8" (quantised to 8 bits, a
    scale per 8 values, and multiplied by the integer kernels: the fast path, a KL divergence
    below 2e-3 from the float path on the packaged models), "int16" (16 bits as two int8
    halves: slower, below 5e-6) or "float32" (the float path: products equal
    decode-then-multiply). ``batch_invariant=True`` gives a sequence's tokens and
    log-probabilities on the integer path the same bits whatever else runs beside it (alone,
    in any batch, among a server's streams), at a cost for decode steps of one or two
    sequences (docs/BENCHMARKS.md, "Batch invariance"); its prompts are then computed whole
    and alone, without shared prefixes, unless ``prefill_chunk_size`` or
    ``share_prefixes`` say otherwise (a prompt longer than its step's budget allows is still
    cut into chunks, and then may round otherwise in a batch). ``quantize`` ("q8_0",
    "q4_0" or "q4_k") quantises a float checkpoint's layer matrices into those GGML blocks at
    load, once (cached), so that they run packed as a GGUF's would
    (:mod:`tiergen.weights.quantize`).

    ``speculative_config`` decodes speculatively (:class:`SpeculativeConfig`, or its dict
    or JSON): each step proposes up to ``num_speculative_tokens`` tokens per sequence and
    checks them in one pass; the output is what the model alone would give
    (:mod:`tiergen.engine.speculative`), in fewer passes over the weights. Method "ngram"
    copies the tokens that followed the text's last ones earlier in its prompt or output
    (for text that repeats itself: extraction, rewriting, code edits); "draft_model" runs a
    smaller model of the same vocabulary (``"model": path``) ahead.

    ``pipeline_parallel=P`` splits the layers into P consecutive spans, each run by its own
    process (rank); ``tensor_parallel=T`` splits every layer's heads, MLP columns and experts
    over T ranks (:mod:`tiergen.parallel.shard`); both together make P x T ranks. On one
    machine tiergen starts ranks 1.. itself and shares the cores among them, and under
    ``torchrun`` every rank runs the same program (on ranks other than 0 the constructor
    serves rank 0, then exits the process). ``policy`` may then be a list, one policy per
    rank; budgets apply to each rank. A rank that dies or does not answer within
    ``parallel_timeout`` seconds stops all of them with an error naming it.

    >>> llm = LLM("smollm2")
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    """

    # what the runner owns (the last three may be changed between runs)
    executor = _OfRunner()
    policy = _OfRunner()
    eos_token_ids = _OfRunner()
    block_size = _OfRunner()
    group = _OfRunner()  # the parallel ranks' group (None for one process)
    last_stats = _OfRunner()  # the last run's measurements
    micro_batch = _OfRunner()
    prefill_chunk_size = _OfRunner()
    share_prefixes = _OfRunner()

    def __init__(self, model: str | Path | ModelFiles, dtype: str | torch.dtype = "auto",
                 device: str | None = None, max_batch_size: int = 64,
                 policy: Policy | list[Policy] | None = None,
                 device_memory: int | str | None = None, host_memory: int | str | None = None,
                 compile: bool = False,
                 prefill_chunk_size: int | None | str = "auto", packed: bool = True,
                 activations: str = "auto", batch_invariant: bool = False,
                 pipeline_parallel: int = 1,
                 tensor_parallel: int = 1, parallel_timeout: float = 60.0,
                 quantize: str | None = None, share_prefixes: bool | None = None,
                 speculative_config: SpeculativeConfig | dict | str | None = None) -> None:
        self.engine_config = EngineConfig(
            model=model, dtype=dtype, device=device, max_batch_size=max_batch_size,
            policy=policy, device_memory=device_memory, host_memory=host_memory,
            compile=compile, prefill_chunk_size=prefill_chunk_size, packed=packed,
            activations=activations, batch_invariant=batch_invariant,
            pipeline_parallel=pipeline_parallel,
            tensor_parallel=tensor_parallel, parallel_timeout=parallel_timeout,
            quantize=quantize, share_prefixes=share_prefixes,
            speculative_config=speculative_config)
        files = self.engine_config.open()
        self.name, self.config, self.tokenizer = files.name, files.config, files.tokenizer
        self.runner = open_runner(self.engine_config, files)
        ex = self.runner.executor
        self.device, self.dtype, self.activations = ex.device, ex.dtype, ex.activations
        # What loading made stays for the model's life: out of the collector's generations,
        # so that the collections a generate loop's small objects set off do not walk it.
        gc.freeze()

    # -- prompts -------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TiergenError(f"model {self.name} has no tokenizer files: pass prompts as "
                                   "lists of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Seq) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise TiergenError(f"token id {bad[0]} is outside the vocabulary "
                                   f"(0..{self.config.vocab_size - 1})")
        else:
            raise TiergenError("a prompt must be a string or a list of token ids, "
                               f"got {type(prompt).__name__}")
        if not ids:
            raise TiergenError("a prompt is empty: give at least one token")
        return ids

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        limit = self.config.context_length
        if len(ids) + params.max_tokens > limit:
            raise TiergenError(
                f"prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} exceeds the "
                f"model's context of {limit} tokens; shorten the prompt or lower max_tokens")

    def prepare(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None
                 ) -> tuple[list[Prompt], list[Sequence]]:
        """Validate prompts and parameters and make their sequences (used by the scheduler too)."""
        if isinstance(prompts, str) or (isinstance(prompts, Seq) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, Seq):
            raise TiergenError("prompts must be a string, a list of token ids, or a list of those; "
                               f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in plist):
            raise TiergenError("params must be a SamplingParams or a list of them, one per prompt")
        if len(plist) != len(prompts):
            raise TiergenError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.encode(p) for p in prompts]
        for i, p in zip(ids, plist):
            self._check_length(i, p)
            if p.stop and self.tokenizer is None:
                raise TiergenError("stop strings need a tokenizer; this model has none")
            self._check_extras(p)
        return prompts, self.runner.sequences(ids, plist)

    def _check_extras(self, params: SamplingParams) -> None:
        vocab = self.config.vocab_size
        outside = [t for t in params.logit_bias or {} if t >= vocab]
        if outside:
            raise TiergenError(f"invalid sampling parameter: logit_bias names token id "
                               f"{outside[0]}, outside the vocabulary (0..{vocab - 1})")

    def close(self) -> None:
        """Stop the other parallel ranks (nothing to do for one process)."""
        self.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, prompts: Prompt | Seq[Prompt],
               params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Yield text as it is produced, for every prompt (events of a batch interleave)."""
        _, seqs = self.prepare(prompts, params)
        run = self.runner.run(seqs)
        try:
            for ev in run:
                yield StreamEvent(ev.seq.index, ev.token_id, ev.delta, ev.seq.finish_reason,
                                  ev.logprobs)
        finally:  # a stream closed early ends its run now, not when the run is collected
            run.close()  # (a pipeline's ranks finish the run together: RankedRunner.run)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult]:
        """Generate for every prompt; results come back in prompt order."""
        texts, seqs = self.prepare(prompts, params)
        with tqdm(total=len(seqs), disable=not use_tqdm, unit="prompt") as bar:
            for ev in self.runner.run(seqs):
                bar.update(ev.seq.finish_reason is not None)
        return [GenerationResult(t if isinstance(t, str) else None, s.prompt_ids, s.text,
                                 s.token_ids, s.finish_reason or "length", s.logprobs,
                                 s.prompt_logprobs)
                for t, s in zip(texts, seqs)]

    def perplexity(self, text: Prompt) -> float:
        """exp(mean negative log-likelihood) of each token of ``text`` given those before it,
        fed in chunks of ``prefill_chunk_size`` through the policy's cache."""
        ids = self._scored(text)
        return math.exp(self.runner.score(ids, "nll").item() / (len(ids) - 1))

    def logits(self, text: Prompt) -> torch.Tensor:
        """Float32 logits (tokens, vocab) after each token of ``text``, fed as perplexity's, in
        host memory wherever the model runs."""
        return self.runner.score(self._scored(text), "logits")

    def _scored(self, text: Prompt) -> list[int]:
        ids = self.encode(text)
        if len(ids) < 2:
            raise TiergenError("scoring needs a text of at least two tokens")
        if len(ids) > self.config.context_length:
            raise TiergenError(f"the text has {len(ids)} tokens, more than the model's context "
                               f"of {self.config.context_length}; shorten it")
        return ids

    def chat_prompt(self, messages: list[Message], chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
        """A conversation's tokens through the chat template (which writes its own special
        tokens: ``add_special_tokens`` adds the tokenizer's too)."""
        if self.tokenizer is None:
            raise TiergenError(f"model {self.name} has no tokenizer, so it cannot chat")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                  template=chat_template)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat(self, messages: list[Message] | list[list[Message]],
             params: SamplingParams | None = None,
             chat_template: str | None = None) -> GenerationResult | list[GenerationResult]:
        """Answer one conversation (a list of messages) or several (a list of lists)."""
        if messages and isinstance(messages[0], list):
            prompts = [self.chat_prompt(m, chat_template) for m in messages]
            return self.generate(prompts, params)
        return self.generate([self.chat_prompt(messages, chat_template)], params)[0]

