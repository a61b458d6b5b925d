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
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist

from tiergen.engine.executor import Executor, MicroBatch
from tiergen.engine.generate import MicroBatchState, Sequence, StepEvent, capacity
from tiergen.errors import TiergenError
from tiergen.parallel.group import HIDDEN, TOKENS, Group, join_torchrun, launch, under_torchrun
from tiergen.parallel.shard import ShardPlan
from tiergen.parallel.stage import Stage, split_layers


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
                  prefill_chunk: int | None = None) -> Iterator[StepEvent]:
    """Generate for a block of sequences over the pipeline (the counterpart of
    :func:`tiergen.engine.generate.run_block`); rank 0's events are the ones that count.
    Time spent waiting for other stages counts as prefill or decode time, like computing."""
    stats = executor.stats
    groups = [seqs[i:i + micro_batch] for i in range(0, len(seqs), micro_batch)]
    longest = max(len(s.prompt_ids) for s in seqs)
    group.agree(lambda: executor.check_block([(len(g), capacity(g)) for g in groups], longest))
    states = [MicroBatchState(executor, g, prefill_chunk) for g in groups]
    units = [states[u::group.pipeline] for u in range(min(group.pipeline, len(states)))]
    sampler = group.sampler
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
                                          sampler, TOKENS)
                    add_wait(start, decoding)
                    for s, tokens in zip(sampling, received):
                        yield from s.apply(tokens.to(s.valid.device))
                live = [s for s in unit if not s.done]
                if not live:
                    continue
                work = [s.work() for s in live]
                decoding = not all(mb.is_prompt for mb in work)  # as the executor counts it
                start = clock()
                out = stage_forward(executor, group, work)
                add_wait(start, decoding)
                sampled = [s.sampler(lg) if s.samples else None for s, lg in zip(live, out)] \
                    if out is not None else [None] * len(live)
                if out is not None and any(t is not None for t in sampled):
                    for r in set(range(group.size)) - {sampler}:
                        group.send([t for t in sampled if t is not None], r, TOKENS)
                for s, tokens in zip(live, sampled):
                    if tokens is not None or not s.samples:
                        yield from s.apply(tokens)
                    else:
                        waiting.setdefault(u, ([], decoding))[0].append(s)
        group.flush()
    finally:
        for s in states:
            if not s.done:
                s.cache.close()


def start_ranks(files, stages: int, tensor: int, timeout: float, options: dict) -> Group:
    """This process's place in a grid of ``stages`` x ``tensor`` ranks: under torchrun, the
    rank it was given; otherwise rank 0, with ranks 1.. started here, the cores shared among
    all. Settings that cannot work are refused before any rank starts."""
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise TiergenError(f"parallel_timeout must be a number of seconds > 0, got {timeout!r}")
    for r in range(tensor if isinstance(tensor, int) and tensor > 0 else 1):
        ShardPlan.make(files.config, tensor, r)
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        if stages == 1 and size % tensor == 0:
            stages = size // tensor  # the ranks torchrun started, as pipeline stages
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
    model, packed = files.opened_as
    spec = dict(model=model, packed=packed, pipeline_parallel=stages, tensor_parallel=tensor,
                parallel_timeout=timeout, **options)
    group = launch(stages * tensor, tensor, timeout, partial(serve_rank, spec), threads)
    group.threads_before = threads_before
    torch.set_num_threads(threads)
    return group


def serve_rank(spec: dict, group: Group) -> None:
    """What a started rank runs: its share of the model, serving rank 0 until it closes."""
    from tiergen.engine.llm import LLM  # the facade builds on this module

    LLM(**spec, _group=group).serve_ranks()
