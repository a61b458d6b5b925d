"""The executor: the one place that decides where tensors live and runs the layers.

Every policy, from everything on the device to everything on disk, goes through the same
block schedule::

    for layer j:                      # weights of j cross the slow link once per block
        take j's weights; start fetching j+1's
        for micro-batch k:
            start loading k+1's cache of layer j
            h[k] = layer j (h[k], cache of k)
            write k's new cache entries back (I/O thread)
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from tiergen.cache.kv import KVView
from tiergen.config import ModelConfig
from tiergen import kernels
from tiergen.kernels import activations_set, amx_rows, rows_on_amx
from tiergen.kernels.layer import run_steps
from tiergen.cache.step import StepMeta
from tiergen.models.base import ModelFamily
from tiergen.offload.hidden import HiddenStates
from tiergen.offload.experts import HostRates
from tiergen.offload.kv import TieredKV, cache_dtype, cache_needs
from tiergen.offload.memory import (Budgets, add, available_ram, device_peak, fmt,
                                    largest_step, reset_peak_resident_set, resident_set,
                                    step_transient)
from tiergen.offload.policy import Policy, tiers_for
from tiergen.offload.weights import TieredWeights, WeightPlan, offload_root
from tiergen.weights.packed import INTEGER_TYPES
from tiergen.parallel.stage import Stage


POSITION_LOGITS_BYTES = 64 << 20  # most float32 logits PositionLogits.take is handed at once


@dataclass
class PositionLogits:
    """Some rows of a micro-batch whose logits are wanted at every position of a step, beside
    the last position's of every row (prompt log-probabilities). The executor hands them to
    ``take`` a few positions at a time, as float32 (rows, positions, vocab) with the index of
    the first position in the step, so that a long prompt's logits never exist all at once."""

    rows: torch.Tensor
    take: Callable[[torch.Tensor, int], None]


@dataclass
class MicroBatch:
    """Tokens of one micro-batch for one step, with its step metadata and cache."""

    ids: torch.Tensor  # (b, T)
    meta: StepMeta
    cache: TieredKV
    positions: PositionLogits | None = None
    # (b,) on a prompt step: the length of each row's whole prompt, which chooses its arithmetic
    # (kernels.amx_rows); None: the step's valid slots count them
    prompt_lengths: torch.Tensor | None = None
    checks: bool = False  # a speculative step (engine.speculative): decode, of several tokens

    @property
    def is_prompt(self) -> bool:
        """Whether this step feeds prompt tokens (prefill) rather than one new token each."""
        return self.meta.start == 0 or self.ids.shape[1] > 1

    def amx_rows(self) -> torch.Tensor | None:
        """The rows whose products and attention run on AMX tiles at this step (on this
        thread's activations); None for none. A speculative step's checks take the decode
        step's arithmetic, so that the picks are those of decoding alone."""
        if not self.is_prompt or self.checks:
            return None
        return amx_rows(self.meta.valid.sum(-1) if self.prompt_lengths is None
                        else self.prompt_lengths)


@dataclass
class _Chain:
    """A micro-batch's decode layers as the native layers run them (Executor._chained), with
    the weights and cache views they were described from, the views held weakly (a kept
    chain must not keep a finished cache's memory)."""

    weights: list[dict]
    views: list[weakref.ref]
    steps: list

    def holds(self, j: int, w: dict, view: KVView) -> bool:
        """Whether layer j's step was described from these very weights and cache view."""
        return j < len(self.steps) and self.weights[j] is w and self.views[j]() is view

    def add(self, w: dict, view: KVView, step) -> None:
        self.weights.append(w)
        self.views.append(weakref.ref(view))
        self.steps.append(step)


@dataclass
class RunStats:
    """What a run did: tokens and seconds of prefill and decode, per-layer seconds spent
    computing and waiting for each link, and peak bytes per tier."""

    num_layers: int
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    shared_prompt_tokens: int = 0  # prompt tokens copied from a shared prefix, not computed
    proposed_tokens: int = 0  # speculative decoding's proposals checked, and those kept
    accepted_tokens: int = 0
    checking_steps: int = 0  # rows' speculative steps (each keeps its kept proposals + 1)
    compute: list[float] = field(default_factory=list)
    wait_weights: list[float] = field(default_factory=list)
    wait_cache: list[float] = field(default_factory=list)
    planned: dict[str, int] = field(default_factory=dict)  # peak bytes per tier, by accounting
    peak_rss: int = 0  # measured peak resident memory of the process during the run
    peak_device: int | None = None  # measured peak GPU memory, when there is a GPU

    def __post_init__(self) -> None:
        self.compute = [0.0] * self.num_layers
        self.wait_weights = [0.0] * self.num_layers
        self.wait_cache = [0.0] * self.num_layers

    def report(self, verbose: bool = False) -> str:
        def rate(tokens: int, seconds: float) -> str:
            return f"{tokens} tokens in {seconds:.2f}s ({tokens / seconds:.1f} tok/s)" if seconds else "-"

        compute, ww, wc = sum(self.compute), sum(self.wait_weights), sum(self.wait_cache)
        lines = [f"prefill: {rate(self.prefill_tokens, self.prefill_seconds)}; "
                 f"decode: {rate(self.decode_tokens, self.decode_seconds)}"
                 + (f"; {self.shared_prompt_tokens} prompt tokens from shared prefixes"
                    if self.shared_prompt_tokens else "")
                 + (f"; {self.accepted_tokens} of {self.proposed_tokens} proposed tokens kept, "
                    f"{1 + self.accepted_tokens / self.checking_steps:.2f} tokens a checking step"
                    if self.checking_steps else ""),
                 f"layer time: compute {compute:.2f}s, waiting for weights {ww:.2f}s, "
                 f"waiting for cache {wc:.2f}s",
                 "peak memory: " + ", ".join(f"{t} {fmt(b)}" for t, b in self.planned.items())
                 + f" (planned); process RSS {fmt(self.peak_rss)}"
                 + (f", GPU {fmt(self.peak_device)}" if self.peak_device is not None else "")
                 + " (measured)"]
        if verbose:
            lines.append("layer  compute_s  wait_weights_s  wait_cache_s")
            lines += [f"{j:5d}  {c:9.3f}  {w:14.3f}  {k:12.3f}" for j, (c, w, k) in
                      enumerate(zip(self.compute, self.wait_weights, self.wait_cache))]
        return "\n".join(lines)


@dataclass(frozen=True)
class Resolved:
    """What a rank settles on its own machine from its config, which stays as given ("auto",
    None) to be shipped to every rank: the compute device, the dtype and activations on it
    (and whether its integer products are batch invariant), the memory budgets, and where
    routed experts in host RAM run (None: only a GPU has the choice)."""

    device: torch.device
    dtype: torch.dtype
    activations: str
    batch_invariant: bool
    budgets: Budgets
    expert_rates: HostRates | None


def cache_compression(policy: Policy) -> tuple[int, int] | None:
    """(bits, group size) of the KV cache's compression, or None."""
    return (policy.compress_bits, policy.compress_group_size) if policy.compress_cache else None


def block_needs(weights: WeightPlan, cfg: ModelConfig, dtype: torch.dtype, policy: Policy,
                micro_batches: list[tuple[int, int]], tokens: int,
                kv_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes per tier that running a block needs at its largest step: the weights as placed
    (with their streaming buffers), the KV cache of micro-batches given as (rows, capacity)
    in ``kv_dtype`` (default: ``dtype``), and what its steps of ``tokens`` per row (the
    prefill chunk) add (``step_needs``)."""
    cache = cache_needs(cfg, kv_dtype or dtype, tiers_for(cfg.num_layers, policy.cache_split),
                        micro_batches, weights.device_type, cache_compression(policy))
    return add(weights.needs(), cache,
               step_needs(cfg, dtype, policy, micro_batches, tokens, weights.device_type))


def step_needs(cfg: ModelConfig, dtype: torch.dtype, policy: Policy,
               micro_batches: list[tuple[int, int]], tokens: int, device_type: str
               ) -> dict[str, int]:
    """Bytes per tier that a block's steps add to its weights and cache: the float32 hidden
    states of ``tokens`` per row on their tiers, and on the device the largest transient of
    one micro-batch's step (``step_transient``: a prefill step of ``tokens`` or a decode
    step, over the capacity)."""
    acts = {"device": 0, "host": 0, "disk": 0}
    for (rows, _), tier in zip(micro_batches, tiers_for(len(micro_batches), policy.hidden_split)):
        acts[tier] += rows * tokens * cfg.hidden_size * 4  # the residual stream is float32
    decode_here = device_type == "cpu" or not policy.cpu_attention or any(
        t != "host" for t in tiers_for(cfg.num_layers, policy.cache_split))
    acts["device"] += max((max(step_transient(cfg, dtype, rows, tokens, slots, True, device_type),
                               step_transient(cfg, dtype, rows, 1, slots, decode_here,
                                              device_type))
                           for rows, slots in set(micro_batches)), default=0)
    return acts


class Executor:
    def __init__(self, model: ModelFamily, source, policy: Policy, model_id: str,
                 here: Resolved) -> None:
        device, dtype, activations = here.device, here.dtype, here.activations
        self.model = model
        self.batch_invariant = here.batch_invariant  # (kernels.set_activations)
        self.cfg = model.cfg
        self.dtype = dtype
        self.device = device
        self.policy = policy
        self.budgets = here.budgets.for_tensors(device.type)
        self.weight_plan = WeightPlan.make(model, dtype, self.policy, device, source)
        self.weight_plan.size_expert_cache(self.policy, self.budgets.host)
        integer = activations == "int8" and any(  # (packed matrices the int8 kernels take)
            t in INTEGER_TYPES for layer in self.weight_plan.blocks
            for parts in layer.values() for t, _ in parts)
        self.kv_dtype = cache_dtype(model.cfg, dtype, device.type, integer)
        # how packed products treat their inputs; int8 only where the int8 kernels take some,
        # since it also moves a long prompt's attention to AMX tiles in bfloat16 (the integer
        # path's arithmetic): a float model keeps the float path's
        self.activations = "float32" if activations == "int8" and not integer else activations
        self.budgets.check(self.weight_plan.needs(), "the model's weights under this policy", {
            "device": "put a smaller share of weights on the device (--percent) or raise "
                      "--device-memory",
            "host": "put more weights on disk (--percent), or raise --host-memory"})
        self.weights = TieredWeights(model, source, dtype, device, self.policy, self.weight_plan,
                                     model_id, expert_rates=here.expert_rates)
        self.globals = self.weights.globals
        self._chains: dict[tuple, _Chain] = {}  # see _chained
        if self.policy.keep_tiles and device.type == "cpu" and activations != "float32":
            host = self.budgets.host if self.budgets.host is not None else available_ram()
            self.weights.tile_allowance = self.weight_plan.host_left(host or 0) // 2
            self.weights.allow_tiles(self.globals)  # the LM head first: the largest product
        self.cache_tiers = tiers_for(self.cfg.num_layers, self.policy.cache_split)
        self.spill_dir = offload_root(self.policy) / "spill"
        self._cache_io = ThreadPoolExecutor(1, thread_name_prefix="tiergen-cache")  # FIFO
        self.stats = RunStats(self.cfg.num_layers)

    def start_run(self) -> RunStats:
        """Begin measuring a run (reported by the LLM facade when it ends)."""
        self.stats = RunStats(self.cfg.num_layers)
        reset_peak_resident_set()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.stats

    def finish_run(self) -> RunStats:
        self.stats.peak_rss = resident_set()[1]
        self.stats.peak_device = device_peak(self.device)
        return self.stats

    def _block_needs(self, micro_batches: list[tuple[int, int]], tokens: int):
        return block_needs(self.weight_plan, self.cfg, self.dtype, self.policy, micro_batches,
                           tokens, self.kv_dtype)

    def fits(self, micro_batches: list[tuple[int, int]], tokens: int) -> bool:
        """Whether a block of micro-batches given as (rows, capacity) fits the budgets with
        steps of ``tokens`` per row."""
        return self.budgets.fits(self._block_needs(micro_batches, tokens))

    def step_tokens(self, micro_batches: list[tuple[int, int]], tokens: int) -> int:
        """The prefill chunk for a block: the most tokens per row per step, at most
        ``tokens``, with which each step fits the budgets (at least 1: check_block then
        says what does not fit)."""
        return max(1, largest_step(lambda n: self.fits(micro_batches, n), tokens))

    def check_block(self, micro_batches: list[tuple[int, int]], tokens: int,
                    what: str | None = None) -> None:
        """Refuse, before it starts, a block whose steps of ``tokens`` per row do not fit:
        its cache, hidden states and largest transient beside the weights."""
        needs = self._block_needs(micro_batches, tokens)
        what = what or f"a block of {sum(r for r, _ in micro_batches)} sequences"
        if tokens > 1:
            what += f" in steps of {tokens} tokens"
        self.budgets.check(needs, what, {
            "device": "move KV cache off the device (--percent), use smaller micro-batches "
                      "(--gpu-batch-size) or fewer per block, a smaller prefill chunk, or "
                      "raise --device-memory",
            "host": "move KV cache to disk (--percent), use smaller blocks, or raise --host-memory"})
        self.stats.planned = {t: max(self.stats.planned.get(t, 0), n) for t, n in needs.items()}

    def new_cache(self, batch: int, capacity: int) -> TieredKV:
        return TieredKV(self.cfg, batch, capacity, self.kv_dtype, self.device, self.cache_tiers,
                        self.spill_dir, self.policy.pin_memory, self.policy.cpu_attention,
                        cache_compression(self.policy), self.policy.attn_sparsity)

    def forward(self, ids: torch.Tensor, meta: StepMeta, cache: TieredKV,
                all_positions: bool = False) -> torch.Tensor:
        """Run one micro-batch (B, T); return float32 logits of the last position (B, V), or
        of every position (B, T, V)."""
        return self.forward_block([MicroBatch(ids, meta, cache)], all_positions)[0]

    @torch.inference_mode()
    def forward_block(self, block: list[MicroBatch], all_positions: bool = False,
                      hidden: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Run every micro-batch of a block through all layers, layer by layer.

        A pipeline stage (:class:`tiergen.parallel.stage.Stage`) that does not begin the
        model starts from ``hidden``, the hidden states the stage before it returned, and
        one that does not end the model returns its hidden states instead of logits.
        """
        # on this thread, which computes the block
        with activations_set(self.activations, self.batch_invariant):
            return self._forward_block(block, all_positions, hidden)

    def _forward_block(self, block: list[MicroBatch], all_positions: bool,
                       hidden: list[torch.Tensor] | None) -> list[torch.Tensor]:
        model, t, clock = self.model, self.stats, self._clock
        started = clock()
        # callers may build ids and metadata on the CPU: bring them to the device (no-op there)
        block = [replace(mb, ids=mb.ids.to(self.device), meta=mb.meta.to(self.device))
                 for mb in block]
        acts = HiddenStates(tiers_for(len(block), self.policy.hidden_split),
                           self.device, self.spill_dir)
        shared = [model.prepare(mb.meta, self.dtype) for mb in block]
        amx = [mb.amx_rows() for mb in block]
        for k, mb in enumerate(block):
            acts.put(k, model.embed(self.globals, mb.ids) if hidden is None
                     else hidden[k].to(self.device))
        self.weights.prefetch(0)
        stored: list[Future | None] = [None] * len(block)
        try:
            chained = self._chained(block, shared, acts)
            for j in range(0 if chained else self.cfg.num_layers):
                t0 = clock()
                w = self.weights.take(j)
                self.weights.prefetch(j + 1)
                t.wait_weights[j] += clock() - t0
                loading = self._load_cache(block, 0, j)
                for k, mb in enumerate(block):
                    t0 = clock()
                    kv = loading.result() if isinstance(loading, Future) else loading
                    if k + 1 < len(block):
                        loading = self._load_cache(block, k + 1, j)
                    t1 = clock()
                    with rows_on_amx(amx[k]):
                        h = model.layer(j, w, acts.take(k), mb.meta, kv, shared[k])
                    acts.put(k, h)
                    moves = mb.cache.moves(j, mb.is_prompt)
                    if moves and self._inline(mb.cache, j):
                        mb.cache.store(j, kv, mb.meta)
                    elif moves:
                        stored[k] = self._cache_io.submit(mb.cache.store, j, kv, mb.meta)
                    t.wait_cache[j] += t1 - t0
                    t.compute[j] += clock() - t1
                self.weights.release(j)
            for f in stored:
                if f is not None:
                    f.result()
            last = slice(None) if all_positions else -1
            if isinstance(model, Stage) and not model.last:
                logits = [acts.take(k) for k in range(len(block))]
            else:
                logits = []
                for k, mb in enumerate(block):
                    h = acts.take(k)
                    with rows_on_amx(amx[k]):
                        if mb.positions is not None:
                            self._position_logits(h, mb.positions)
                        logits.append(self._head(h[:, last]))
                    if mb.positions is not None and amx[k] is not None and not all_positions:
                        self._last_on_amx(h, logits[-1], mb.positions.rows, amx[k])
            seconds = clock() - started
            is_prompt = [mb.is_prompt and not mb.checks for mb in block]
            t.prefill_tokens += sum(mb.ids.numel() for mb, p in zip(block, is_prompt) if p)
            t.decode_tokens += sum(mb.ids.shape[0] for mb, p in zip(block, is_prompt) if not p)
            if all(is_prompt):  # a block mixing both (continuous batching) counts as decode
                t.prefill_seconds += seconds
            else:
                t.decode_seconds += seconds
            return logits
        except BaseException:
            self.weights.abort()
            raise
        finally:
            acts.close()

    def _chained(self, block: list[MicroBatch], shared: list, acts: HiddenStates) -> bool:
        """Run a decode step's layers natively, all of a micro-batch's in one call
        (kernels.layer.run_steps), where the weights and caches all stay where they are
        and every layer takes the native layer; False, having run nothing, where not. The
        numbers are those of the layers run one by one: the same native layer computes
        them, with the same arguments; only the Python between the layers (a third of a
        small model's batch-1 step) is saved. A micro-batch's layers are described once
        and kept (:class:`_Chain`) while its weights and cache views stay the same."""
        decode_step = getattr(self.model, "decode_step", None)
        if (decode_step is None or self.device.type != "cpu" or not self.weights.in_place()
                or any(mb.is_prompt and not mb.checks for mb in block)):
            return False
        n, start = self.cfg.num_layers, self._clock()
        hs = [acts.take(k) for k in range(len(block))]
        chains = []
        for k, (mb, h, sh) in enumerate(zip(block, hs, shared)):
            key = (k, h.shape[:2], kernels.activations(), kernels.batch_invariant())
            known = self._chains.get(key)
            chain = _Chain([], [], [])
            for j in range(n):
                if mb.cache.moves(j):
                    break
                w, kv = self.weights.take(j), mb.cache.load(j, mb.meta.start)
                same = known is not None and known.holds(j, w, kv)
                step = decode_step(j, w, h, mb.meta, kv, sh, known.steps[j] if same else None)
                if step is None:
                    break
                chain.add(w, kv, step)
            if len(chain.steps) < n:
                for k2, h2 in enumerate(hs):
                    acts.put(k2, h2)
                return False
            if len(self._chains) > 16:
                self._chains.clear()
            self._chains[key] = chain
            chains.append(chain)
        for k, (h, chain) in enumerate(zip(hs, chains)):
            acts.put(k, run_steps(chain.steps, h))
        spent = (self._clock() - start) / n
        for j in range(n):
            self.stats.compute[j] += spent
        return True

    def _position_logits(self, hidden: torch.Tensor, want: PositionLogits) -> None:
        rows = hidden[want.rows.to(hidden.device)]
        step = max(1, POSITION_LOGITS_BYTES // (4 * rows.shape[0] * self.cfg.vocab_size))
        for at in range(0, rows.shape[1], step):
            want.take(self._head(rows[:, at:at + step]), at)

    def _last_on_amx(self, hidden: torch.Tensor, logits: torch.Tensor, wanting: torch.Tensor,
                     amx: torch.Tensor) -> None:
        """The last logits of the rows that want position logits and run on AMX tiles, taken
        there as their position logits are (a 2-D row takes the integer kernels): a shared
        prefix's last logits score the next prompt token of the rows sharing it, and must be
        what those rows' own position logits would be. Other rows keep the integer kernels'
        last logits, cheaper for a prompt alone (the head decoded onto the tiles for a row)."""
        rows = wanting[amx[wanting.to(amx.device)].to(wanting.device)].to(hidden.device)
        if len(rows):
            with rows_on_amx(torch.ones(len(rows), dtype=torch.bool)):
                logits[rows] = self._head(hidden[rows][:, -1:])[:, 0]

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Float logits of some positions' hidden states, made contiguous first: a slice of
        several rows' positions is not where one row's is, and a row's final norm then runs
        as when it is alone."""
        return self.model.head(self.globals, h.contiguous()).float()

    def _load_cache(self, block: list[MicroBatch], k: int, j: int) -> Future[KVView] | KVView:
        """Micro-batch k's cache of layer j: loaded here, or its load started on the cache
        thread (queued after its previous store)."""
        mb = block[k]
        if not mb.cache.moves(j, mb.is_prompt) or self._inline(mb.cache, j):
            return mb.cache.load(j, mb.meta.start, mb.is_prompt)
        return self._cache_io.submit(mb.cache.load, j, mb.meta.start, mb.is_prompt)

    def _clock(self) -> float:
        """Seconds for RunStats: on a GPU once the compute stream has done what was queued
        on it (copy streams go on), so that a layer's compute and waits are the GPU's and
        add up to the wall time; on a CPU the plain clock."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _inline(self, cache: TieredKV, j: int) -> bool:
        """Whether layer j's cache work runs on the compute thread: on a CPU, unpacking a
        compressed cache held in RAM is compute, and a second thread would only fight the
        matmuls for the same cores. Disk and host-to-GPU traffic go to the cache thread."""
        return self.device.type == "cpu" and not cache.on_disk(j)
