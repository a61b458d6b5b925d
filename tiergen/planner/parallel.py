"""Plan and predict a parallel run: ``stages`` pipeline stages of ``tensor`` shards each.

Every rank is planned as one process over its share of the model (its span of layers, cut
as the run cuts them, and its slice of every layer), with its share of this machine's cores,
its own memory budgets and the policy search of :mod:`tiergen.planner.search`; the ranks
then agree on one batch shape (the run needs every rank to cut the batch alike: the
smallest block any rank can hold). The run's speed follows from the ranks' and the link's:

- A block's micro-batches are dealt into as many *units* as there are stages. Each stage
  runs each unit through its layers once per step; a unit's step passes every stage in turn,
  one message from stage to stage and the sampled tokens back to the first. A step of the
  block takes the longer of the busiest stage's work on all units and one unit's trip
  around the pipeline.
- Tensor-parallel shards add two all-reduces per layer (after attention and after the MLP)
  and the gather of the logits, each a fixed cost plus bytes over the link's rate; a stage
  goes at its slowest shard.

Simplifications: ranks on one machine divide its cores evenly and compute at the calibrated
rates for their share of the threads, at most their share of what all threads reach
together (see :func:`rank_calibration`; the disk's rate divided among all ranks, as if all
read at once); a message costs the link's calibrated mean; stages do not overlap a message
with compute.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from tiergen import calibration
from tiergen.calibration import ONE_THREAD, Calibration
from tiergen.config import ModelConfig
from tiergen.errors import TiergenError
from tiergen.models import build_model
from tiergen.offload.memory import Budgets
from tiergen.offload.policy import Policy
from tiergen.engine.generate import chunks, default_prefill_chunk
from tiergen.engine.pipeline import micro_batch_size, pipeline_chunk
from tiergen.parallel import link as rank_link
from tiergen.parallel.shard import Shard
from tiergen.parallel.stage import Stage, layer_costs, split_layers
from tiergen.planner.calibrate import link_line
from tiergen.planner.cost import Estimate, PlacedWeights, Workload, blocks, estimate
from tiergen.planner.search import SearchRequest, fmt, nothing_fits, policy_flags, search

# the link where it was never measured: gloo over loopback on a 2-core VM
# (docs/BENCHMARKS-HISTORY.md)
DEFAULT_LINK = dict(latency=3e-4, bandwidth=1.5e9, reduce_latency=1e-3, reduce_bandwidth=1.5e9)


@dataclass
class RankPlan:
    """One rank's share and policy, and its estimate as one process over that share."""

    rank: int
    layers: range
    shard: int
    estimate: Estimate


@dataclass
class ParallelEstimate:
    """A parallel run's plan: each rank's policy and memory, and the run's predicted speed."""

    stages: int
    tensor: int
    ranks: list[RankPlan]
    workload: Workload
    prefill_seconds: float
    decode_seconds: float
    link: dict[str, float]

    @property
    def policies(self) -> list[Policy]:
        return [r.estimate.policy for r in self.ranks]

    @property
    def prefill_tok_s(self) -> float:
        w = self.workload
        return w.batch * w.prompt_len / self.prefill_seconds

    @property
    def decode_tok_s(self) -> float:
        w = self.workload
        return w.batch * (w.gen_len - 1) / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def total_tok_s(self) -> float:
        w = self.workload
        return w.batch * w.gen_len / (self.prefill_seconds + self.decode_seconds)


def rank_calibration(cal: Calibration, ranks: int) -> Calibration:
    """What one of ``ranks`` ranks on the calibrated machine gets: on a CPU, its share of
    the threads (compute rates scaled to it; the products' rates interpolated between those
    measured with one thread and with all) and of the disk.

    A product's rate is also at most the rank's share of what all threads together reach:
    ranks multiply at the same time, and where a product is bound by memory (few rows;
    bfloat16 widened on a CPU without it) one thread alone gets more of the bandwidth than
    it does beside the other ranks (a 1B-shaped bfloat16 pipeline stage at 16 rows took 1.7x
    the one-thread figure)."""
    if cal.device_type != "cpu" or ranks == 1:
        return cal
    threads = int(cal.hardware.get("torch_threads") or 1)
    mine = max(1, threads // ranks)
    share = mine / threads

    def scaled(table: dict[str, float]) -> dict[str, float]:
        return {k: v * share for k, v in table.items()}

    def products(kind: str) -> dict[str, float]:
        table, one = cal.linear_rows[kind], cal.linear_rows.get(f"{kind}{ONE_THREAD}")
        if one is None or threads == 1:
            return scaled(table)
        f = (mine - 1) / (threads - 1)
        return {r: min(one[r] + (v - one[r]) * f, v * share) for r, v in table.items()
                if r in one}

    return replace(cal, matmul=scaled(cal.matmul), gemv=scaled(cal.gemv),
                   linear_rows={k: products(k) for k in cal.linear_rows
                                if not k.endswith(ONE_THREAD)},
                   dequant=scaled(cal.dequant), cache_unpack=scaled(cal.cache_unpack),
                   prompt_attention=scaled(cal.prompt_attention),
                   cpu_attention=cal.cpu_attention * share, disk_read=cal.disk_read / ranks)


def units(policy: Policy, batch: int, max_batch_size: int, stages: int) -> list[list[list[int]]]:
    """Rows of each micro-batch of each unit of each block, as a pipelined run deals them."""
    out = []
    for rows in map(sum, blocks(policy, batch, max_batch_size)):
        micro = micro_batch_size(policy, rows, stages)
        cut = [min(micro, rows - i) for i in range(0, rows, micro)]
        out.append([cut[u::stages] for u in range(min(stages, len(cut)))])
    return out


def _ranks(cfg: ModelConfig, stages: int, tensor: int, source):
    """(rank, layers, shard, model, source) of every rank, cut as the run cuts them."""
    family = build_model(cfg)
    costs, head = layer_costs(family)
    spans = split_layers(costs, stages, head)
    for rank in range(stages * tensor):
        span, shard = spans[rank // tensor], rank % tensor
        part, src = family, source
        if tensor > 1:
            part = Shard(family, tensor, shard)
            src = source and part.source(source)
        yield rank, span, shard, Stage(part, span), src


def plan_parallel(cfg: ModelConfig, dtype: torch.dtype, workload: Workload, cal: Calibration,
                  budgets: Budgets, stages: int, tensor: int,
                  policy: Policy | list[Policy] | None = None, max_batch_size: int = 64,
                  allow_compression: bool = True, source=None) -> ParallelEstimate:
    """Each rank's policy (``policy``: one for all, one per rank, or None to search the
    fastest that fits each rank's budgets) and the run's predicted speed."""
    size = stages * tensor
    if isinstance(policy, (list, tuple)) and len(policy) != size:
        raise TiergenError(f"got {len(policy)} policies for {size} parallel ranks; give one "
                           "per rank, or one for all")
    rank_cal = rank_calibration(cal, size)
    device_type = cal.device_type
    ranks = list(_ranks(cfg, stages, tensor, source))
    chosen = []  # each rank's policy before they agree on the batch's cut
    for rank, span, shard, model, src in ranks:
        mine = policy[rank] if isinstance(policy, (list, tuple)) else policy
        if mine is None:
            request = SearchRequest(model.cfg, dtype, workload, rank_cal, device_type, budgets,
                                    max_batch_size, allow_compression, model=model, source=src)
            found = search(request)
            if not found.fits:
                e = nothing_fits(found, request)
                raise TiergenError(f"parallel rank {rank} (layers {span.start}-{span.stop - 1}"
                                   f"{f', shard {shard}' if tensor > 1 else ''}): {e}")
            mine = found.fits[0].policy
        chosen.append(mine)
    # every rank must cut the batch alike: the smallest block any rank holds (smaller blocks
    # need less memory, so every rank still fits)
    shape = min(chosen, key=lambda p: (p.gpu_batch_size or max_batch_size) * p.num_gpu_batches)
    cut = units(shape, workload.batch, max_batch_size, stages)
    chunk = pipeline_chunk(default_prefill_chunk(device_type), workload.prompt_len, stages)
    link = cal.link or DEFAULT_LINK
    prefill = decode = 0.0
    plans = []
    timing: dict[int, list[list[tuple[float, float]]]] = {}  # rank -> block -> unit
    for (rank, span, shard, model, src), mine in zip(ranks, chosen):
        p = replace(mine, gpu_batch_size=shape.gpu_batch_size,
                    num_gpu_batches=shape.num_gpu_batches)
        placed = PlacedWeights.make(model.cfg, dtype, p, device_type, model, src)
        e = estimate(model.cfg, dtype, p, workload, rank_cal, device_type, max_batch_size, placed)
        plans.append(RankPlan(rank, span, shard, e))
        head = cfg.vocab_size * cfg.hidden_size // tensor if model.last else 0
        timing[rank] = [[_unit_seconds(model, placed, p, rows, workload, rank_cal, dtype,
                                       max_batch_size, head, tensor, link, chunk)
                         for rows in block]
                        for block in cut]
    w = workload
    hop = link["latency"]  # the tokens' way back; hidden states add their bytes
    for b, block in enumerate(cut):
        for part in (0, 1):  # prefill, decode
            # a stage goes at its slowest shard
            per = [[max(timing[s * tensor + t][b][u][part] for t in range(tensor))
                    for u in range(len(block))] for s in range(stages)]
            steps = w.gen_len - 1 if part else -(-w.prompt_len // chunk)
            trips = []
            for u, rows in enumerate(block):
                new = 1 if part else min(w.prompt_len, chunk)
                message = hop + sum(rows) * new * cfg.hidden_size * 4 / link["bandwidth"]
                trips.append(sum(per[s][u] for s in range(stages))
                             + steps * ((stages - 1) * message + hop) * (stages > 1))
            seconds = max(max(sum(row) for row in per), max(trips))
            if part:
                decode += seconds
            else:
                prefill += seconds
    return ParallelEstimate(stages, tensor, plans, workload, prefill, decode, link)


def _unit_seconds(model: Stage, placed: PlacedWeights, policy: Policy, rows: list[int],
                  workload: Workload, cal: Calibration, dtype: torch.dtype,
                  max_batch_size: int, head: int, tensor: int, link: dict[str, float],
                  chunk: int) -> tuple[float, float]:
    """Seconds of prefill (in ``chunk``-token steps) and of decode (the whole generation)
    of one unit on one rank."""
    p = replace(policy, gpu_batch_size=max(rows), num_gpu_batches=len(rows))
    w = replace(workload, batch=sum(rows))
    e = estimate(model.cfg, dtype, p, w, cal, cal.device_type, max_batch_size, placed,
                 prefill_chunk=chunk, head=head)
    prefill, decode = e.prefill_seconds, e.decode_seconds
    if tensor > 1:
        c, p = model.cfg, workload.prompt_len
        for r in rows:
            prefill += sum(_reduces(link, c, r, r * len(span), head) for span in chunks(chunk, p))
            decode += (workload.gen_len - 1) * _reduces(link, c, r, r, head)
    return prefill, decode


def _reduces(link: dict[str, float], cfg: ModelConfig, rows: int, tokens: int, head: int
             ) -> float:
    """A micro-batch step's tensor-parallel messages: two all-reduces per layer of its
    ``tokens`` hidden rows, and (``head``) the gather of its ``rows`` logits."""
    def one(nbytes: int) -> float:
        return link["reduce_latency"] + nbytes / link["reduce_bandwidth"]

    hidden = 2 * cfg.num_layers * one(tokens * cfg.hidden_size * 4)
    return hidden + (one(rows * cfg.vocab_size * 4) if head else 0.0)


def format_parallel(e: ParallelEstimate, cfg: ModelConfig, dtype: torch.dtype) -> str:
    """The plan as a user reads it: each rank's share, flags and memory, then the run."""
    w = e.workload
    name = str(dtype).removeprefix("torch.")
    lines = [f"plan for {cfg.architecture}, {cfg.num_layers} layers, {name}, over "
             f"{e.stages} pipeline stage(s) x {e.tensor} tensor shard(s): {w.batch} prompt(s) "
             f"of {w.prompt_len} tokens, {w.gen_len} generated each"]
    for r in e.ranks:
        where = f"layers {r.layers.start}-{r.layers.stop - 1}"
        if e.tensor > 1:
            where += f", shard {r.shard}"
        memory = ", ".join(f"{t} {fmt(n)}" for t, n in r.estimate.memory.items())
        lines.append(f"  rank {r.rank:<4} {where}: {policy_flags(r.estimate.policy)}; {memory}")
    lines += [
        f"  link       {link_line(e.link)}",
        (f"  predicted  prefill {e.prefill_tok_s:.1f} tok/s, decode {e.decode_tok_s:.1f} "
         f"tok/s, total {e.total_tok_s:.1f} generated tok/s")]
    return "\n".join(lines)


def with_link(cal: Calibration, progress: bool = False) -> Calibration:
    """``cal`` with the link measured (and saved) if it was not yet."""
    if cal.link:
        return cal
    if progress:
        print("tiergen: note: measuring the link between parallel ranks (saved for next time)",
              file=sys.stderr)
    cal = replace(cal, link=rank_link.measure_link() or {})
    try:
        calibration.save(cal)
    except TiergenError:
        pass  # still good for this run
    return cal
