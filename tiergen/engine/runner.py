"""How a loaded model runs: on this process alone (:class:`LocalRunner`), or as one rank of a
pipeline/tensor-parallel group (:class:`RankedRunner`). The choice is made once, when the
model loads (:func:`open_runner`); the LLM facade and the scheduler then ask the runner to
run sequences, to run one scheduler step, or to score a text, and the ranks other than 0 ask
theirs to serve rank 0, without knowing which kind it is."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import torch

from tiergen import calibration
from tiergen._platform import release_freed_memory
from tiergen.cache.step import StepMeta
from tiergen.devices import resolve_activations, resolve_device, resolve_dtype
from tiergen.engine.config import EngineConfig
from tiergen.engine.executor import Executor, MicroBatch, Resolved, RunStats
from tiergen.engine.generate import (MicroBatchState, Sequence, StepEvent, chunks, make_sequences,
                                     prefill_chunk, run_block)
from tiergen.engine.pipeline import (Replica, micro_batch_size, run_pipelined, stage_forward,
                                     start_ranks, step_ranks)
from tiergen.engine.sampler import SamplingParams
from tiergen.engine.speculative import (DraftModel, Guesser, SpeculativeConfig, check_speculation,
                                        check_vocabularies)
from tiergen.errors import TiergenError
from tiergen.models import ModelFamily, build_model
from tiergen.models.layers import use_compiled_gemv
from tiergen.offload.experts import HostRates
from tiergen.offload.policy import Policy
from tiergen.parallel.group import TOKENS, Group, under_torchrun
from tiergen.parallel.shard import Shard
from tiergen.parallel.stage import Stage, layer_costs, split_layers
from tiergen.weights import ModelFiles, WeightSource


class Runner:
    """Runs this process's share of the model through its executor. ``micro_batch``,
    ``prefill_chunk_size`` and ``share_prefixes`` start as the config says and may be changed
    between runs; ``group`` is the ranks' group, None for one process."""

    group: Group | None = None

    def __init__(self, executor: Executor, config: EngineConfig, files: ModelFiles,
                 draft: DraftModel | None = None) -> None:
        self.executor = executor
        self.policy: Policy = executor.policy
        self.micro_batch = self.policy.gpu_batch_size or config.max_batch_size
        self.prefill_chunk_size = config.prefill_chunk_size
        self.share_prefixes = config.share_prefixes
        self.tokenizer = files.tokenizer
        self.eos_token_ids = sorted(set(files.config.eos_token_ids) |
                                    set(self.tokenizer.eos_token_ids if self.tokenizer else []))
        self.vocab_size = files.config.vocab_size
        self.last_stats: RunStats | None = None
        spec = config.speculative_config
        check_speculation(files.config, spec, config.batch_invariant, config.parallel)
        self.guesser = spec and Guesser(spec, draft)  # every sequence's, unless it says
        # a prompt's own num_speculative_tokens -> its guesser (the LLM's method, else ngram)
        self._guessers: dict[int | str, Guesser] = {}
        self._can_speculate = partial(check_speculation, files.config,
                                      batch_invariant=config.batch_invariant,
                                      parallel=config.parallel)

    @property
    def block_size(self) -> int:
        """Sequences run together: num_gpu_batches micro-batches."""
        return self.micro_batch * self.policy.num_gpu_batches

    @property
    def prefixes_shared(self) -> bool:
        """Whether a scheduler step may start its rows from a prompt prefix computed once."""
        return self.share_prefixes

    def prefill_chunk(self, tokens: int) -> int:
        """Tokens per prefill step over prompts of up to ``tokens`` tokens."""
        return prefill_chunk(self.prefill_chunk_size, tokens)

    def sequences(self, prompt_ids: list[list[int]], params: list[SamplingParams]
                  ) -> list[Sequence]:
        seqs = make_sequences(prompt_ids, params, self.eos_token_ids, self.tokenizer)
        for s in seqs:
            s.guesser = self._guesser(s.params.num_speculative_tokens)
        return seqs

    def _guesser(self, k: int | str | None) -> Guesser | None:
        """The guesser of a prompt that asks for ``k`` proposals a step (SamplingParams)."""
        if k is None or k == 0:
            return self.guesser if k is None else None
        if k not in self._guessers:
            base = self.guesser.config if self.guesser else SpeculativeConfig("ngram")
            spec = replace(base, num_speculative_tokens=k)
            self._can_speculate(spec)
            same = self.guesser is not None and spec == self.guesser.config
            self._guessers[k] = self.guesser if same else Guesser(
                spec, self.guesser and self.guesser.draft)
        return self._guessers[k]

    def blocks(self, seqs: list[Sequence]) -> Iterator[list[Sequence]]:
        """Blocks of num_gpu_batches micro-batches, prompts of similar length together so
        that little padding is computed."""
        order = sorted(seqs, key=lambda s: len(s.prompt_ids), reverse=True)
        for i in range(0, len(order), self.block_size):
            yield order[i:i + self.block_size]

    def run(self, seqs: list[Sequence]) -> Iterator[StepEvent]:
        """Generate for ``seqs``, block by block; ``last_stats`` measures the run."""
        raise NotImplementedError

    def step(self, states: list[MicroBatchState], works: list[MicroBatch], chunk: int | None,
             replay: list[tuple]) -> list[StepEvent]:
        """One step of a scheduler's micro-batches (``replay``: what the scheduler did since
        its last step, which other ranks repeat on their copies)."""
        raise NotImplementedError

    def score(self, ids: list[int], what: str) -> torch.Tensor:
        """``ids``' negative log-likelihood ("nll", float64) or every position's logits
        ("logits"), fed in prefill chunks."""
        return self._score(ids, what)

    def serve(self) -> None:
        """Run what rank 0 asks until it closes the group (nothing to serve alone)."""

    def close(self) -> None:
        """Stop the other ranks, if any."""

    def _forward_all(self, block: list[MicroBatch]) -> list[torch.Tensor] | None:
        """Every position's logits of ``block`` (None on a rank that does not sample)."""
        return self.executor.forward_block(block, True)

    def _score(self, ids: list[int], what: str) -> torch.Tensor:
        tokens = torch.tensor([ids])
        valid = torch.ones(1, len(ids), dtype=torch.bool)
        cache = self.executor.new_cache(1, len(ids))
        nll, logits = torch.zeros((), dtype=torch.float64), []
        self.executor.start_run()
        try:
            for span in chunks(self.prefill_chunk_size, len(ids)):
                start, piece = span.start, tokens[:, span.start:span.stop]
                out = self._forward_all([MicroBatch(piece, StepMeta.build(
                    valid, start, piece.shape[1]), cache)])
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
        return (torch.cat(logits) if logits else torch.empty(0)) if what == "logits" else nll


class LocalRunner(Runner):
    """The whole model in this process."""

    def run(self, seqs: list[Sequence]) -> Iterator[StepEvent]:
        self.executor.start_run()
        for block in self.blocks(seqs):
            yield from run_block(self.executor, block, self.micro_batch, self.prefill_chunk_size,
                                 self.share_prefixes)
        self.last_stats = self.executor.finish_run()

    def step(self, states: list[MicroBatchState], works: list[MicroBatch], chunk: int | None,
             replay: list[tuple]) -> list[StepEvent]:
        logits = self.executor.forward_block(works)
        return [ev for s, lg in zip(states, logits) for ev in s.advance(lg)]


class RankedRunner(Runner):
    """One rank of a pipeline/tensor-parallel group. Rank 0 hands every other rank each
    command (generate, score, a scheduler's step) and all run it together; the others serve
    rank 0 until it closes the group. A failure anywhere stops every rank."""

    def __init__(self, executor: Executor, config: EngineConfig, files: ModelFiles,
                 group: Group) -> None:
        super().__init__(executor, config, files)
        self.group = group
        self._replica: Replica | None = None  # ranks other than 0: a scheduler's micro-batches

    @property
    def prefixes_shared(self) -> bool:
        return False  # every row computes its own prompt: a prefix is computed on one rank

    def run(self, seqs: list[Sequence]) -> Iterator[StepEvent]:
        """Rank 0 hands the sequences to every rank, and all run them together; a caller
        that stops listening early still lets the run finish, so the ranks stay in step."""
        group = self.group
        if group.rank == 0:
            self._command("generate", [s.prompt_ids for s in seqs], [s.params for s in seqs])
        self.executor.start_run()
        runs = (run_pipelined(self.executor, group, block,
                              micro_batch_size(self.policy, len(block), group.pipeline),
                              self.prefill_chunk_size)
                for block in self.blocks(seqs))
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

    def step(self, states: list[MicroBatchState], works: list[MicroBatch], chunk: int | None,
             replay: list[tuple]) -> list[StepEvent]:
        """Rank 0: every rank replays ``replay`` on its copy, then all run the step."""
        self._command("step", replay, [s.key for s in states], chunk)
        try:
            return list(step_ranks(self.executor, self.group, states, works))
        except BaseException:
            self.group.close(graceful=False)
            raise

    def score(self, ids: list[int], what: str) -> torch.Tensor:
        self._command("score", ids, what)
        try:
            return self._score_here(ids, what)
        except BaseException:
            self.group.close(graceful=False)
            raise

    def serve(self) -> None:
        # made here, not kept on the runner: its bound methods would keep it alive too long
        handlers = {"generate": self._generate, "score": self._score_here, "step": self._step}
        while (command := self.group.next_command()) is not None:
            handlers[command[0]](*command[1:])

    def close(self) -> None:
        if self.group.rank == 0:
            self.group.close()

    def _forward_all(self, block: list[MicroBatch]) -> list[torch.Tensor] | None:
        return stage_forward(self.executor, self.group, block, True)

    def _command(self, *command) -> None:
        """Rank 0: hand every other rank what to run next."""
        if self.group.closed:
            raise TiergenError("this LLM's parallel ranks have stopped (a rank failed or close() "
                               "was called); create a new LLM")
        try:
            self.group.command(command)
        except BaseException:  # a rank lost before the command arrived
            self.group.close(graceful=False)
            raise

    def _generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> None:
        for _ in self.run(self.sequences(prompt_ids, params)):
            pass

    def _score_here(self, ids: list[int], what: str) -> torch.Tensor:
        """This rank's share of scoring; the rank that samples has the result and hands it
        to rank 0 (the others return it empty)."""
        group, result = self.group, self._score(ids, what)
        if group.sampler != 0:
            if group.rank == group.sampler:
                group.send([result], 0, TOKENS)
            elif group.rank == 0:
                shape = (len(ids), self.vocab_size) if what == "logits" else ()
                result = group.recv([(shape, result.dtype)], group.sampler, TOKENS)[0]
            group.flush()
        return result

    def _step(self, replay: list[tuple], keys: list[int], chunk: int | None) -> None:
        """Ranks other than 0 under a server: one step of rank 0's scheduler."""
        if self._replica is None:
            self._replica = Replica(self.executor, self.group, self.sequences,
                                    self.prefill_chunk_size)
        self._replica.step(replay, keys, chunk)


def open_runner(config: EngineConfig, files: ModelFiles, group: Group | None = None) -> Runner:
    """The runner of ``config``'s model, chosen here once: a local one, or this process's rank
    of a group (``group``: one rank 0 started; else, for pipeline_parallel or tensor_parallel
    or under torchrun, this process joins or starts one)."""
    family = build_model(files.config)
    if config.compile:  # process-wide, like torch's own backend switches
        use_compiled_gemv(True)
    if group is None and not config.parallel:
        draft = _open_draft(config, files)
        if draft is not None:  # its weights are held out of the target's budgets
            config.budgets = config.budgets.less(draft.executor.weight_plan.needs())
        runner = LocalRunner(_executor(config, files, family), config, files, draft)
        release_freed_memory()
        return runner
    group = group or start_ranks(files, config, serve_rank)
    try:  # on every rank at once: one that fails stops all
        executor = group.agree(partial(_executor, config, files, family, group), patient=True)
    except BaseException:
        group.close(graceful=False)
        raise
    runner = RankedRunner(executor, config, files, group)
    if group.rank != 0 and under_torchrun():  # every rank runs the user's program
        runner.serve()
        raise SystemExit(0)
    weakref.finalize(runner, group.close)
    return runner


def serve_rank(config: EngineConfig, group: Group) -> None:
    """What a rank started by rank 0 runs: its share of the model, serving rank 0 until it
    closes the group."""
    open_runner(config, config.open(), group).serve()


def _executor(config: EngineConfig, files: ModelFiles, family: ModelFamily,
              group: Group | None = None) -> Executor:
    """This process's executor: of the whole model, or of its rank's share of ``group``, on
    what this rank settles on its own machine."""
    here = _resolve(config, files)
    rank, ranks = (group.rank, group.size) if group else (0, 1)
    family, source, model_id = _rank_share(family, files, group)
    return Executor(family, source, config.policy_for(rank, ranks), model_id, here)


def _open_draft(config: EngineConfig, files: ModelFiles) -> DraftModel | None:
    """The draft model of ``config``'s speculative_config (None without one): loaded as the
    target is, on its device, with every weight there, within the target's budgets; in its
    own dtype and activations (its numbers only choose proposals, never the output)."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    check_speculation(files.config, spec, config.batch_invariant, config.parallel)  # (first)
    own = EngineConfig(model=spec.model, device=config.device,
                       max_batch_size=config.max_batch_size, device_memory=config.device_memory,
                       host_memory=config.host_memory, prefill_chunk_size=config.prefill_chunk_size)
    draft = own.open()
    check_vocabularies(files, draft)
    check_speculation(draft.config, spec, False, False, f"the draft model {draft.name}")
    return DraftModel(_executor(own, draft, build_model(draft.config)), files.config.vocab_size)


def _resolve(config: EngineConfig, files: ModelFiles) -> Resolved:
    """What this rank settles on its own machine: the device, the dtype and activations on
    it, and, on a GPU, where routed experts in host RAM run, from this machine's calibration
    if one is cached (``tiergen calibrate``)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, files.default_dtype, files.packed)
    activations = resolve_activations(config.activations, device)
    rates = None
    if device.type == "cuda":  # only a GPU has the choice
        rates = HostRates.calibrated(calibration.load("cpu"), calibration.load(device))
    return Resolved(device, dtype, activations, config.batch_invariant, config.budgets, rates)


def _rank_share(family: ModelFamily, files: ModelFiles, group: Group | None
                ) -> tuple[ModelFamily, WeightSource, str]:
    """This rank's stage of the layers (and shard of each layer), its tensors, and the name
    of that share (for the weights' cache files); without a group, the whole model."""
    source, model_id = files.source, files.fingerprint
    if group is None:
        return family, source, model_id
    costs, head = layer_costs(family)
    span = split_layers(costs, group.pipeline, head)[group.stage]
    model_id = f"{model_id}|layers {span.start}-{span.stop}"
    if group.tensor > 1:
        family = Shard(family, group.tensor, group.shard, group)
        source = family.source(source)
        model_id = f"{model_id}|shard {group.shard} of {group.tensor}"
    return Stage(family, span), source, model_id
