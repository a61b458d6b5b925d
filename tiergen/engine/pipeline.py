"""The pipeline schedule: every stage works at once on a different share of the batch.

Every rank runs this same loop over the same sequences (rank 0 hands them out), so each
knows every micro-batch's state and every message's shape without being told: only hidden
states (from each stage to the next) and sampled tokens (from the last stage to all) travel.
The micro-batches of a block are dealt into as many *units* as there are stages; a stage
runs one unit through its layers (one trip of its weights per unit), passes it on, and goes
on to the next unit while later stages work on the earlier ones. A unit's next step starts
on the first stage as soon as its tokens come back, so with as many units as stages no
stage waits once the pipeline is full.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from tiergen.engine.config import EngineConfig
from tiergen.engine.executor import Executor, MicroBatch
from tiergen.engine.generate import MicroBatchState, Sequence, StepEvent, capacity, prefill_chunk
from tiergen.errors import TiergenError
from tiergen.parallel.group import (HIDDEN, LOGPROBS, TOKENS, Group, join_torchrun, launch,
                                    run_stages, under_torchrun)
from tiergen.parallel.shard import ShardPlan
from tiergen.parallel.stage import Stage, split_layers


def micro_batch_size(policy, rows: int, stages: int) -> int:
    """Rows per micro-batch of a pipelined block of ``rows`` sequences: the policy's, or else
    enough micro-batches (``stages`` x ``num_gpu_batches``) to keep every stage busy."""
    return policy.gpu_batch_size or -(-rows // (stages * policy.num_gpu_batches))


PIPELINE_CHUNKS = 2  # prompt chunks per unit and stage at least, so prefill overlaps too
MIN_CHUNK = 16  # tokens: smaller chunks would cost more in calls than the overlap saves


def pipeline_chunk(chunk_size: int | None, longest: int, stages: int) -> int | None:
    """The prefill chunk size of a pipelined block whose longest prompt has ``longest``
    tokens (``chunk_size``: the LLM's prefill_chunk_size; each micro-batch then cuts its
    prompts by :func:`~tiergen.engine.generate.prefill_chunk`). A prompt in one chunk leaves
    stages idle while the first units fill the pipeline and the last drain it (with 2 units
    over 2 stages, a third of the time); cut into a few chunks, the later ones go through the
    first stages while earlier ones are in the last."""
    if stages == 1:
        return chunk_size
    return min(prefill_chunk(chunk_size, longest),
               max(MIN_CHUNK, -(-longest // (PIPELINE_CHUNKS * stages))))


def stage_forward(executor: Executor, group: Group, block: list[MicroBatch],
                  all_positions: bool = False) -> list[torch.Tensor] | None:
    """This stage's part of a forward pass: hidden states come from the stage before
    (unless this one embeds) and go to the next (unless this one ends the model). The rank
    that samples returns the logits; the others return None."""
    stage: Stage = executor.model
    hidden = None if stage.first else group.recv(
        [((*mb.ids.shape, executor.cfg.hidden_size), torch.float32) for mb in block],
        group.rank - group.tensor, HIDDEN)
    out = executor.forward_block(block, all_positions, hidden)
    if not stage.last:
        group.send(out, group.rank + group.tensor, HIDDEN)
    return out if group.rank == group.sampler else None


def run_pipelined(executor: Executor, group: Group, seqs: list[Sequence], micro_batch: int,
                  chunk_size: int | None = None) -> Iterator[StepEvent]:
    """Generate for a block of sequences over the pipeline (the counterpart of
    :func:`tiergen.engine.generate.run_block`); rank 0's events are the ones that count.
    Time spent waiting for other stages counts as prefill or decode time, like computing."""
    stats = executor.stats
    groups = [seqs[i:i + micro_batch] for i in range(0, len(seqs), micro_batch)]
    longest = max(len(s.prompt_ids) for s in seqs)
    group.agree(lambda: executor.check_block([(len(g), capacity(g)) for g in groups], longest))
    chunk = pipeline_chunk(chunk_size, longest, group.pipeline)
    states = [MicroBatchState(executor, g, chunk) for g in groups]
    units = [states[u::group.pipeline] for u in range(min(group.pipeline, len(states)))]
    waiting: dict[int, tuple[list[MicroBatchState], bool]] = {}  # tokens on their way here

    def clock() -> tuple[float, float]:
        return time.perf_counter(), stats.decode_seconds + stats.prefill_seconds

    def add_wait(start: tuple[float, float], decoding: bool) -> None:
        """Count as prefill or decode the wall time since ``start`` the executor did not."""
        now, counted = clock()
        seconds = (now - start[0]) - (counted - start[1])
        if decoding:
            stats.decode_seconds += seconds
        else:
            stats.prefill_seconds += seconds

    try:
        while any(not s.done for s in states) or waiting:
            for u, unit in enumerate(units):
                if u in waiting:  # tokens of the unit's last step, before its next step
                    sampling, decoding = waiting.pop(u)
                    start = clock()
                    received = group.recv([((len(s.live),), torch.long) for s in sampling],
                                          group.sampler, TOKENS)
                    add_wait(start, decoding)
                    for s, tokens in zip(sampling, received):
                        if group.rank == 0 and s.wants_logprobs:
                            s.take_logprobs(group.recv_object(group.sampler, LOGPROBS))
                        yield from s.apply(tokens.to(s.valid.device))
                live = [s for s in unit if not s.done]
                if not live:
                    continue
                work = [s.work() for s in live]
                decoding = not all(mb.is_prompt for mb in work)  # as the executor counts it
                start = clock()
                out = stage_forward(executor, group, work)
                add_wait(start, decoding)
                sampled = [s.sample(lg) if s.samples else None for s, lg in zip(live, out)] \
                    if out is not None else [None] * len(live)
                if out is not None:
                    group.share([t for t in sampled if t is not None])
                    send_logprobs(group, [s for s, t in zip(live, sampled) if t is not None])
                for s, tokens in zip(live, sampled):
                    if tokens is not None or not s.samples:
                        yield from s.apply(tokens)
                    else:
                        waiting.setdefault(u, ([], decoding))[0].append(s)
        group.flush()
    finally:
        for s in states:
            if not s.done:
                s.close()


def step_ranks(executor: Executor, group: Group, states: list[MicroBatchState],
               work: list[MicroBatch]) -> Iterator[StepEvent]:
    """One step of a block on every rank at once (a server's step: the scheduler on rank 0
    decides each step, so stages take turns rather than overlap)."""
    sampling = [s for s in states if s.samples]
    out = stage_forward(executor, group, work)
    if out is None:
        tokens = group.recv([((len(s.live),), torch.long) for s in sampling], group.sampler,
                            TOKENS) if sampling else []
    else:
        tokens = [s.sample(lg) for s, lg in zip(states, out) if s.samples]
        group.share(tokens)
        send_logprobs(group, sampling)
    received = iter(tokens)
    for s in states:
        if s in sampling and out is None and group.rank == 0 and s.wants_logprobs:
            s.take_logprobs(group.recv_object(group.sampler, LOGPROBS))
        yield from s.apply(next(received).to(s.valid.device) if s in sampling else None)
    group.flush()


def send_logprobs(group: Group, sampled: list[MicroBatchState]) -> None:
    """The sampling rank: send rank 0 the log-probabilities its micro-batches asked for (its
    events are the ones that count), after their tokens."""
    for s in sampled:
        if group.rank != 0 and s.wants_logprobs:
            group.send_object(s.logprobs_message(), 0, LOGPROBS)


class Replica:
    """A rank other than 0 under a server: its copy of rank 0's running micro-batches,
    kept in step by replaying what the scheduler did before each step."""

    def __init__(self, executor: Executor, group: Group, make_sequences,
                 chunk_size: int | None) -> None:
        self.executor, self.group, self.chunk_size = executor, group, chunk_size
        self.make_sequences = make_sequences  # (prompts, params) -> sequences, as rank 0's
        self.states: dict[int, MicroBatchState] = {}
        self.seqs: dict[int, Sequence] = {}

    def step(self, replay: list[tuple], keys: list[int], chunk: int | None) -> None:
        for op, *args in replay:
            if op == "admit":
                key, requests = args
                seqs = self.make_sequences([r[1] for r in requests], [r[2] for r in requests])
                self.seqs.update(zip((r[0] for r in requests), seqs))
                self.states[key] = MicroBatchState(self.executor, seqs, self.chunk_size, key)
            elif op == "merge":
                self.states[args[0]].merge(self.states.pop(args[1]))
            elif op == "cancel" and args[0] in self.seqs:
                self.seqs[args[0]].finish_reason = "cancelled"
        states = [self.states[k] for k in keys]
        for _ in step_ranks(self.executor, self.group, states, [s.work(chunk) for s in states]):
            pass
        self.states = {k: s for k, s in self.states.items() if not s.done}
        self.seqs = {k: q for k, q in self.seqs.items() if q.finish_reason is None}


def start_ranks(files, config: EngineConfig, serve: Callable[[EngineConfig, Group], None]
                ) -> Group:
    """This process's place in the grid of ``config``'s pipeline stages x tensor shards:
    under torchrun, the rank it was given; otherwise rank 0, with ranks 1.. started here,
    each running ``serve(config, group)`` (the model as ``files`` was opened), the cores
    shared among all. Settings that cannot work are refused before any rank starts."""
    stages, tensor = config.pipeline_parallel, config.tensor_parallel
    timeout = config.parallel_timeout
    for r in range(tensor if isinstance(tensor, int) and tensor > 0 else 1):
        ShardPlan.make(files.config, tensor, r)
    if under_torchrun():
        size, stages = int(os.environ["WORLD_SIZE"]), run_stages(stages, tensor)
        if stages * tensor != size:
            raise TiergenError(f"pipeline_parallel={stages} x tensor_parallel={tensor} ranks, but "
                               f"torchrun started {size}; make them equal")
        split_layers([0.0] * files.config.num_layers, stages)
        return join_torchrun(timeout, tensor)
    split_layers([0.0] * files.config.num_layers, stages)  # refuse a bad count before starting
    if files.opened_as is None:
        raise TiergenError("pipeline_parallel and tensor_parallel need the model as a path or a "
                           "name, which every rank opens itself, not an already opened ModelFiles")
    if dist.is_initialized():
        raise TiergenError("this process already runs parallel ranks; close() that LLM first")
    threads_before = torch.get_num_threads()
    threads = max(1, threads_before // (stages * tensor))
    model, packed, quantize = files.opened_as
    shipped = replace(config, model=model, packed=packed, quantize=quantize)
    group = launch(stages * tensor, tensor, timeout, partial(serve, shipped), threads)
    group.threads_before = threads_before
    torch.set_num_threads(threads)
    return group
