"""The LLM facade: load a model once, then generate for batches of prompts or chat."""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tiergen import calibration
from tiergen._platform import release_freed_memory
from tiergen.devices import resolve_activations, resolve_device, resolve_dtype
from tiergen.engine.executor import Executor, MicroBatch, RunStats
from tiergen.engine.generate import (DEFAULT_PREFILL_CHUNK, Sequence, StepEvent, chunks,
                                     make_sequences, prefill_chunk, run_block)
from tiergen.engine.sampler import PositionLogprobs, SamplingParams
from tiergen.cache.step import StepMeta
from tiergen.errors import TiergenError
from tiergen.models import build_model
from tiergen.models.layers import use_compiled_gemv
from tiergen.offload.experts import HostRates
from tiergen.offload.memory import Budgets
from tiergen.offload.policy import Policy, parse_size
from tiergen.parallel.group import TOKENS, Group, under_torchrun
from tiergen.engine.pipeline import (Replica, micro_batch_size, run_pipelined, stage_forward,
                                     start_ranks)
from tiergen.parallel.shard import Shard
from tiergen.parallel.stage import Stage, layer_costs, split_layers
from tiergen.weights import ModelFiles, open_model, quantized

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


def _expert_rates(device: torch.device) -> HostRates | None:
    """Where routed experts in host RAM should run, from this machine's calibration if one
    is cached (``tiergen calibrate``); only a GPU has the choice."""
    if device.type != "cuda":
        return None
    gpu = calibration.load(device)  # the link
    cpu = calibration.load("cpu")  # the host's own rates
    if gpu is None and cpu is None:
        return None
    return HostRates.measured(max(cpu.matmul.values(), default=None) if cpu else None,
                              cpu.host_memcpy if cpu else None,
                              gpu.host_to_device if gpu else None)


class LLM:
    """A loaded model.

    ``policy`` places weights, KV cache and activations on device, host RAM and disk;
    ``device_memory``/``host_memory`` are budgets (bytes or "8G") a plan must fit;
    ``compile=True`` compiles batch-1 CPU matmuls (faster decode after a few seconds of
    compilation on first use); ``prefill_chunk_size`` feeds long prompts in chunks that each
    attend to the cache plus themselves, so prefill memory grows with chunk x context rather
    than context squared (None: whole prompts at once); ``share_prefixes`` computes a prompt
    prefix that every sequence of a block (or of a server micro-batch) starts with once, and
    copies its cache into each row (False: every row computes its whole prompt). ``packed=False`` decodes a GGUF's
    quantised matrices at load (by default they stay in their blocks and are multiplied
    packed). ``activations`` says how those products treat their inputs: "auto" (int8 on a
    CPU, float32 elsewhere), "int8" (quantised to 8 bits, a scale per 8 values, and
    multiplied by the integer kernels: the fast path, a KL divergence below 2e-3 from the
    float path on the packaged models), "int16" (16 bits as two int8 halves: slower, below
    5e-6) or
    "float32" (the float path: products equal decode-then-multiply). ``quantize`` ("q8_0",
    "q4_0" or "q4_k") quantises a float checkpoint's layer matrices into those GGML blocks at
    load, once (cached), so that they run packed as a GGUF's would
    (:mod:`tiergen.weights.quantize`).

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

    def __init__(self, model: str | Path | ModelFiles, dtype: str | torch.dtype = "auto",
                 device: str | None = None, max_batch_size: int = 64,
                 policy: Policy | None = None, device_memory: int | str | None = None,
                 host_memory: int | str | None = None, compile: bool = False,
                 prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK, packed: bool = True,
                 activations: str = "auto", pipeline_parallel: int = 1,
                 tensor_parallel: int = 1, parallel_timeout: float = 60.0,
                 quantize: str | None = None, share_prefixes: bool = True, *,
                 _group: Group | None = None) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise TiergenError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if prefill_chunk_size is not None and (not isinstance(prefill_chunk_size, int)
                                               or prefill_chunk_size < 1):
            raise TiergenError("prefill_chunk_size must be a positive integer (or None for the "
                               f"whole prompt at once), got {prefill_chunk_size!r}")
        self.prefill_chunk_size = prefill_chunk_size
        self.share_prefixes = share_prefixes
        self.device = resolve_device(device)
        self.activations = resolve_activations(activations, self.device)
        if isinstance(model, ModelFiles):
            files = model if quantize is None else quantized(model, quantize)
        else:
            files = open_model(model, packed, quantize)
        family, model_id, source = build_model(files.config), files.fingerprint, files.source
        self.group = group = _group
        if group is None and (pipeline_parallel != 1 or tensor_parallel != 1 or under_torchrun()):
            self.group = group = start_ranks(
                files, pipeline_parallel, tensor_parallel, parallel_timeout, dict(
                    dtype=dtype, device=device, max_batch_size=max_batch_size, policy=policy,
                    device_memory=device_memory, host_memory=host_memory, compile=compile,
                    prefill_chunk_size=prefill_chunk_size, activations=activations), serve_rank)
        if group is not None:
            costs, head = layer_costs(family)
            span = split_layers(costs, group.pipeline, head)[group.stage]
            model_id = f"{model_id}|layers {span.start}-{span.stop}"
            if group.tensor > 1:
                family = Shard(family, group.tensor, group.shard, group)
                source = family.source(source)
                model_id = f"{model_id}|shard {group.shard} of {group.tensor}"
            family = Stage(family, span)
            if isinstance(policy, (list, tuple)):
                problem = f"got {len(policy)} policies for {group.size} parallel ranks; give " \
                    "one per rank, or one for all" if len(policy) != group.size else None
                if len({(p.gpu_batch_size, p.num_gpu_batches) for p in policy}) > 1:
                    problem = ("the parallel ranks' policies must cut the batch alike: give "
                               "them the same gpu_batch_size and num_gpu_batches")
                if problem:
                    group.close(graceful=False)
                    raise TiergenError(problem)
                policy = policy[group.rank]
        elif isinstance(policy, (list, tuple)):
            raise TiergenError("a list of policies is for pipeline_parallel or tensor_parallel "
                               "> 1 (one per rank)")
        self.policy = policy or Policy()
        self.name = files.name
        self.config = files.config
        self.tokenizer = files.tokenizer
        self.dtype = resolve_dtype(dtype, self.device, files.default_dtype, files.packed)
        self.eos_token_ids = sorted(set(self.config.eos_token_ids) |
                                    set(self.tokenizer.eos_token_ids if self.tokenizer else []))
        self.micro_batch = self.policy.gpu_batch_size or max_batch_size
        budgets = Budgets(None if device_memory is None else parse_size(device_memory),
                          None if host_memory is None else parse_size(host_memory))

        def executor() -> Executor:
            return Executor(family, source, self.dtype, self.device, self.policy, model_id,
                            budgets, _expert_rates(self.device), self.activations)

        if compile:  # process-wide, like torch's own backend switches
            use_compiled_gemv(True)
        self.last_stats: RunStats | None = None
        self._replica: Replica | None = None  # a server's micro-batches, on other ranks
        if self.group is None:
            self.executor = executor()
            release_freed_memory()
        else:
            try:
                self.executor = self.group.agree(executor, patient=True)
            except BaseException:
                self.group.close(graceful=False)
                raise
            if self.group.rank != 0 and under_torchrun():
                self.serve_ranks()
                raise SystemExit(0)
            weakref.finalize(self, self.group.close)

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
        return prompts, make_sequences(ids, plist, self.eos_token_ids, self.tokenizer)

    def _check_extras(self, params: SamplingParams) -> None:
        vocab = self.config.vocab_size
        outside = [t for t in params.logit_bias or {} if t >= vocab]
        if outside:
            raise TiergenError(f"invalid sampling parameter: logit_bias names token id "
                               f"{outside[0]}, outside the vocabulary (0..{vocab - 1})")

    def prefill_chunk(self, tokens: int) -> int:
        """Tokens per prefill step over prompts of up to ``tokens`` tokens."""
        return prefill_chunk(self.prefill_chunk_size, tokens)

    def _blocks(self, seqs: list[Sequence]) -> Iterator[list[Sequence]]:
        """Blocks of num_gpu_batches micro-batches, prompts of similar length together so
        that little padding is computed."""
        order = sorted(seqs, key=lambda s: len(s.prompt_ids), reverse=True)
        for i in range(0, len(order), self.block_size):
            yield order[i:i + self.block_size]

    @property
    def block_size(self) -> int:
        """Sequences run together: num_gpu_batches micro-batches."""
        return self.micro_batch * self.policy.num_gpu_batches

    # -- generation ----------------------------------------------------------------------
    def _run(self, seqs: list[Sequence]) -> Iterator[StepEvent]:
        if self.group is not None:
            yield from self._run_pipelined(seqs)
            return
        self.executor.start_run()
        for block in self._blocks(seqs):
            yield from run_block(self.executor, block, self.micro_batch, self.prefill_chunk_size,
                                 self.share_prefixes)
        self.last_stats = self.executor.finish_run()

    def _command(self, *command) -> None:
        """Rank 0: hand every other rank what to run next."""
        if self.group.closed:
            raise TiergenError("this LLM's parallel ranks have stopped (a rank failed or close() "
                               "was called); create a new LLM")
        self.group.command(command)

    def _pipelined(self, command: str, *args):
        """Rank 0: have every rank run ``command`` with this process; a failure stops them all."""
        self._command(command, *args)
        try:
            return self._handler(command)(*args)
        except BaseException:
            self.group.close(graceful=False)
            raise

    def _run_pipelined(self, seqs: list[Sequence]) -> Iterator[StepEvent]:
        """Rank 0 hands the sequences to every rank, and all run them together; a caller
        that stops listening early still lets the run finish, so the ranks stay in step."""
        group = self.group
        if group.rank == 0:
            self._command("generate", [s.prompt_ids for s in seqs], [s.params for s in seqs])
        self.executor.start_run()
        runs = (run_pipelined(self.executor, group, block,
                              micro_batch_size(self.policy, len(block), group.pipeline),
                              self.prefill_chunk_size)
                for block in self._blocks(seqs))
        run = iter(())
        try:
            for run in runs:
                for event in run:
                    yield event  # (not ``yield from``: closing us must not close ``run``)
        except GeneratorExit:
            for rest in (run, *runs):
                for _ in rest:
                    pass
            raise
        except BaseException:
            group.close(graceful=False)
            raise
        finally:
            self.last_stats = self.executor.finish_run()

    def _handler(self, command: str):
        """What a command from rank 0 runs (on rank 0 too, for those it runs alike). Made on
        each call: kept on the LLM, its bound methods would keep it alive past its last use."""
        return {"generate": self._generate, "score": self._score, "step": self._step}[command]

    def _generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> None:
        """Ranks other than 0: run rank 0's sequences with it."""
        for _ in self._run(make_sequences(prompt_ids, params, self.eos_token_ids,
                                          self.tokenizer)):
            pass

    def _step(self, replay: list[tuple], keys: list[int], chunk: int | None) -> None:
        """Ranks other than 0 under a server: one step of rank 0's scheduler."""
        if self._replica is None:
            self._replica = Replica(self.executor, self.group, lambda ids, params: make_sequences(
                ids, params, self.eos_token_ids, self.tokenizer), self.prefill_chunk_size)
        self._replica.step(replay, keys, chunk)

    def serve_ranks(self) -> None:
        """Ranks other than 0: run what rank 0 asks until it closes the group."""
        while (command := self.group.next_command()) is not None:
            self._handler(command[0])(*command[1:])

    def close(self) -> None:
        """Stop the other parallel ranks (nothing to do for one process)."""
        if self.group is not None and self.group.rank == 0:
            self.group.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(self, prompts: Prompt | Seq[Prompt],
               params: SamplingParams | Seq[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        """Yield text as it is produced, for every prompt (events of a batch interleave)."""
        _, seqs = self.prepare(prompts, params)
        run = self._run(seqs)
        try:
            for ev in run:
                yield StreamEvent(ev.seq.index, ev.token_id, ev.delta, ev.seq.finish_reason,
                                  ev.logprobs)
        finally:  # a stream closed early ends its run now, not when the run is collected
            run.close()  # (a pipeline's ranks finish the run together, see _run_pipelined)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[GenerationResult]:
        """Generate for every prompt; results come back in prompt order."""
        texts, seqs = self.prepare(prompts, params)
        with tqdm(total=len(seqs), disable=not use_tqdm, unit="prompt") as bar:
            for ev in self._run(seqs):
                bar.update(ev.seq.finish_reason is not None)
        return [GenerationResult(t if isinstance(t, str) else None, s.prompt_ids, s.text,
                                 s.token_ids, s.finish_reason or "length", s.logprobs,
                                 s.prompt_logprobs)
                for t, s in zip(texts, seqs)]

    def perplexity(self, text: Prompt) -> float:
        """exp(mean negative log-likelihood) of each token of ``text`` given those before it,
        fed in chunks of ``prefill_chunk_size`` through the policy's cache."""
        ids = self._scored(text)
        return math.exp(self._score_everywhere(ids, "nll").item() / (len(ids) - 1))

    def logits(self, text: Prompt) -> torch.Tensor:
        """Float32 logits (tokens, vocab) after each token of ``text``, fed as perplexity's, in
        host memory wherever the model runs."""
        return self._score_everywhere(self._scored(text), "logits")

    def _scored(self, text: Prompt) -> list[int]:
        ids = self.encode(text)
        if len(ids) < 2:
            raise TiergenError("scoring needs a text of at least two tokens")
        if len(ids) > self.config.context_length:
            raise TiergenError(f"the text has {len(ids)} tokens, more than the model's context "
                               f"of {self.config.context_length}; shorten it")
        return ids

    def _score_everywhere(self, ids: list[int], what: str) -> torch.Tensor:
        return self._score(ids, what) if self.group is None else \
            self._pipelined("score", ids, what)

    def _score(self, ids: list[int], what: str) -> torch.Tensor:
        """Feed ``ids`` in chunks and return their negative log-likelihood ("nll", float64)
        or every position's logits ("logits"). Over several ranks each runs its share; the
        rank that samples has the result and hands it to rank 0 (the others return it
        empty)."""
        group = self.group
        tokens = torch.tensor([ids])
        valid = torch.ones(1, len(ids), dtype=torch.bool)
        cache = self.executor.new_cache(1, len(ids))
        nll, logits = torch.zeros((), dtype=torch.float64), []
        self.executor.start_run()
        try:
            for span in chunks(self.prefill_chunk_size, len(ids)):
                start, piece = span.start, tokens[:, span.start:span.stop]
                meta = StepMeta.build(valid, start, piece.shape[1])
                block = [MicroBatch(piece, meta, cache)]
                out = self.executor.forward_block(block, True) if group is None else \
                    stage_forward(self.executor, group, block, True)
                if out is None:  # a rank without the logits
                    continue
                if what == "logits":
                    logits.append(out[0][0].cpu())
                    continue
                targets = tokens[0, start + 1:start + 1 + piece.shape[1]]
                logp = torch.log_softmax(out[0][0, :len(targets)], dim=-1)
                nll -= logp.gather(1, targets[:, None].to(logp.device)).sum().double().cpu()
        finally:
            cache.close()
            self.last_stats = self.executor.finish_run()
        result = (torch.cat(logits) if logits else torch.empty(0)) if what == "logits" else nll
        if group is not None and group.sampler != 0:
            if group.rank == group.sampler:
                group.send([result], 0, TOKENS)
            elif group.rank == 0:
                shape = (len(ids), self.config.vocab_size) if what == "logits" else ()
                result = group.recv([(shape, result.dtype)], group.sampler, TOKENS)[0]
            group.flush()
        return result

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


def serve_rank(spec: dict, group: Group) -> None:
    """What a started rank runs: its share of the model, serving rank 0 until it closes."""
    LLM(**spec, _group=group).serve_ranks()
