"""Continuous batching: requests that arrive while the engine runs join the running block at
the next step boundary, and a finished sequence frees its place for a waiting one.

Each admission of waiting requests becomes a new micro-batch of the block (its prefill runs
in the same forward pass as the others' decode, chunk by chunk, the chunks sized by a
:class:`Pacer` so that the decoding streams keep their pace); once its prompts are in, it
merges with another decoding micro-batch when both fit in one; a micro-batch leaves when all
its sequences have stopped or been cancelled.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from tiergen.engine.executor import MicroBatch
from tiergen.engine.generate import (MIN_SHARED_PREFIX, MicroBatchState, Sequence, SharedPrefix,
                                     StepEvent, capacity, shared_length)
from tiergen.engine.prefix_cache import PrefixCache
from tiergen.engine.llm import LLM, Prompt, StreamEvent
from tiergen.engine.sampler import SamplingParams
from tiergen.errors import TiergenError

CANCELLED = "cancelled"
TIMED_OUT = "timeout"  # waited in the queue longer than the scheduler's queue_timeout


class QueueFull(TiergenError):
    """The scheduler's waiting queue is at its limit; try again later."""


@dataclass
class Request:
    """One submitted prompt: its sequence, its timings, and the events it has produced."""

    id: int
    seq: Sequence
    on_event: Callable[[StreamEvent], None] | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    _events: queue.Queue = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def finish_reason(self) -> str | None:
        return self.seq.finish_reason

    def cancel(self) -> None:
        """Stop generating for this request; its place is freed at the next step."""
        self._cancel.set()

    def events(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """Block and yield this request's events until it finishes."""
        while True:
            ev = self._events.get(timeout=timeout)
            yield ev
            if ev.finish_reason is not None:
                return

    def _emit(self, ev: StreamEvent) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if ev.finish_reason is not None:
            self.finished_at = time.perf_counter()
        self._events.put(ev)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # a listener's failure must not stop the engine for everyone
                self.on_event = None


@dataclass
class Pacer:
    """Sizes the prompt chunks that share a step with decoding streams, from measured step
    times, so that such a step takes about ``stretch`` decode steps: a long prompt then goes
    in over many steps and never freezes the streams for its whole prefill."""

    stretch: float = 1.3  # the streams' p99 gap is about twice their p50 already: 1.3 keeps
    # it near 3x their p50 alone (benchmarks/bench_mixed.py; docs/BENCHMARKS-HISTORY.md)
    min_tokens: int = 8  # below this a chunk's matmuls waste more than the streams gain (the
    # packed kernels multiply 8 rows at ~80 % of their per-row speed at 32)
    decode_s: float | None = None  # a step of only decoding rows
    token_s: float | None = None  # one prompt token beside them

    def budget(self, decoding_rows: int) -> int | None:
        """Prompt tokens the next step may feed (None: as many as the chunk size allows)."""
        if not decoding_rows or self.decode_s is None:
            return None
        if self.token_s is None:  # first guess: a prompt token costs what a decoding row does
            return max(self.min_tokens, decoding_rows)
        return max(self.min_tokens, int((self.stretch - 1) * self.decode_s / self.token_s))

    def observe(self, seconds: float, prompt_tokens: int, decoding_rows: int) -> None:
        if not prompt_tokens:
            self.decode_s = _ema(self.decode_s, seconds)
            return
        beside = (self.decode_s or 0.0) if decoding_rows else 0.0
        self.token_s = _ema(self.token_s, max(seconds - beside, seconds / 10) / prompt_tokens)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else 0.5 * old + 0.5 * new


@dataclass
class SchedulerMetrics:
    requests_total: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_rejected: int = 0
    requests_timed_out: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_cache_hits: int = 0  # micro-batches that took a prompt prefix from the prefix cache
    shared_prompt_tokens: int = 0  # prompt tokens copied from a shared prefix, not computed
    prefix_cache_bytes: int = 0  # what the prefix cache holds where the policy keeps caches
    prefix_cache_disk_bytes: int = 0  # what it holds in spill files
    steps: int = 0
    merges: int = 0  # micro-batches merged into another
    proposed_tokens: int = 0  # speculative decoding's (RunStats')
    accepted_tokens: int = 0
    checking_steps: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)  # sequences per step -> steps
    queue_depth: int = 0
    running: int = 0


class Scheduler:
    """Runs an :class:`LLM` on a background thread for requests submitted from any thread:
    the LLM checks and encodes each request, and its runner runs each step.

    Admission respects the LLM's memory budgets: a request whose cache and activations could
    never fit is refused at submission, and one that does not fit beside the running
    sequences waits for them to finish; ``queue_timeout`` (seconds) bounds that wait.
    """

    def __init__(self, llm: LLM, max_queue: int = 256, max_running: int | None = None,
                 queue_timeout: float | None = None, prefix_cache: int = 0,
                 prefix_cache_disk: int = 0) -> None:
        self.llm, self.runner = llm, llm.runner
        # prompt prefixes kept for the requests that follow: up to ``prefix_cache`` bytes
        # where the policy keeps caches, then up to ``prefix_cache_disk`` in spill files
        self.prefixes = PrefixCache(prefix_cache, prefix_cache_disk,
                                    self.runner.executor.spill_dir / "prefixes") \
            if prefix_cache and self.runner.prefixes_shared else None
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.max_running = max_running or self.runner.block_size
        self.metrics = SchedulerMetrics()
        self._waiting: deque[Request] = deque()
        self._requests: dict[int, Request] = {}  # by id(Sequence)
        self._states: list[MicroBatchState] = []
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tiergen-scheduler", daemon=True)
        self._error: BaseException | None = None
        self._pacer = Pacer()
        self._replay: list[tuple] = []  # what other ranks replay before the next step

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self, cancel: bool = True, timeout: float | None = 30) -> None:
        """Stop the loop: cancel (or finish) running requests, cancel waiting ones."""
        with self._lock:
            self._stopping = True
            if cancel:
                for r in self._requests.values():
                    r.cancel()
            self._lock.notify_all()
        self._thread.join(timeout)

    def snapshot(self) -> SchedulerMetrics:
        """A consistent copy of the metrics, safe to read while the loop runs."""
        with self._lock:
            return replace(self.metrics, batch_sizes=Counter(self.metrics.batch_sizes))

    def submit(self, prompt: Prompt, params: SamplingParams | None = None,
               on_event: Callable[[StreamEvent], None] | None = None) -> Request:
        """Queue a prompt; raises TiergenError on bad input and QueueFull when full."""
        params = params or SamplingParams()
        _, (seq,) = self.llm.prepare([prompt], [params])
        # alone in the block, could it ever run? (raises, saying what does not fit)
        self.runner.executor.check_block([(1, capacity([seq]))], self._step_tokens([seq]),
                                         f"a request of {len(seq.prompt_ids)} prompt tokens "
                                         f"and max_tokens={params.max_tokens}")
        with self._lock:
            if self._stopping:
                raise TiergenError("the scheduler is shutting down")
            if self._error is not None:
                raise TiergenError(f"the engine failed: {self._error}")
            if len(self._waiting) >= self.max_queue:
                self.metrics.requests_rejected += 1
                raise QueueFull(f"the queue holds {self.max_queue} waiting requests; retry later")
            req = Request(next(self._ids), seq, on_event)
            self._waiting.append(req)
            self._requests[id(seq)] = req
            self.metrics.requests_total += 1
            self.metrics.prompt_tokens += len(seq.prompt_ids)
            self.metrics.queue_depth = len(self._waiting)
            self._lock.notify_all()
        return req

    # -- the loop --------------------------------------------------------------------------
    def _gather(self) -> None:
        """When idle, let a burst of arrivals finish (a pause of 20 ms, at most 200 ms) so that
        it becomes one micro-batch rather than several small ones."""
        deadline = time.monotonic() + 0.2
        while not self._stopping and len(self._waiting) < self.max_running:
            seen = len(self._waiting)
            self._lock.wait(0.02)
            if len(self._waiting) == seen or time.monotonic() > deadline:
                return

    def _step_tokens(self, seqs: list[Sequence]) -> int:
        """Most tokens per row a step of these sequences feeds (their prefill chunk)."""
        longest = max(len(s.prompt_ids) for s in seqs)
        return self.runner.prefill_chunk(longest)

    def _fits(self, group: list[Sequence], merging: tuple[MicroBatchState, ...] = ()) -> bool:
        """Whether the running micro-batches, with a new one of ``group`` or with the two of
        ``merging`` merged into one, fit the budgets."""
        shapes = [(len(s.live), s.slots) for s in self._states if s not in merging]
        shapes.append(merging[0].merged_shape(merging[1]) if merging else
                      (len(group), capacity(group)))
        tokens = self._step_tokens([q for s in self._states for q in s.live] + group)
        return self.runner.executor.fits(shapes, tokens)

    def _merge(self) -> None:
        """Merge decoding micro-batches while two fit in one: requests that joined at
        different times end up sharing fewer, fuller micro-batches (smallest first)."""
        while True:
            decoding = sorted((s for s in self._states if s.decoding), key=lambda s: len(s.live))
            pair = next(((a, b) for i, a in enumerate(decoding) for b in decoding[i + 1:]
                         if len(a.live) + len(b.live) <= self.runner.micro_batch
                         and self._fits([], (a, b))), None)
            if pair is None:
                return
            pair[1].merge(pair[0])
            self._states.remove(pair[0])
            self._replay.append(("merge", pair[1].key, pair[0].key))
            self.metrics.merges += 1

    def _expire(self) -> None:
        """Answer the requests that have waited longer than queue_timeout."""
        if self.queue_timeout is None:
            return
        now = time.perf_counter()
        for req in [r for r in self._waiting if now - r.created > self.queue_timeout]:
            self._waiting.remove(req)
            req.seq.finish_reason = TIMED_OUT
            self.metrics.requests_timed_out += 1
            req._emit(StreamEvent(req.id, -1, "", TIMED_OUT))
            del self._requests[id(req.seq)]

    def _admit(self) -> None:
        """Move waiting requests into new micro-batches while there is room in the block and
        in the memory budgets."""
        self._expire()
        running = sum(len(s.live) for s in self._states)
        while self._waiting and running < self.max_running:
            take = min(self.runner.micro_batch, self.max_running - running, len(self._waiting))
            while take and not self._fits([self._waiting[i].seq for i in range(take)]):
                take -= 1
            if not take:  # wait for running sequences to finish and free memory
                break
            group = [self._waiting.popleft() for _ in range(take)]
            group = [r for r in group if not self._finish_if_cancelled(r)]
            if group:
                state = self._start(group)
                self._states.append(state)
                self._replay.append(("admit", state.key, [(r.id, r.seq.prompt_ids, r.seq.params)
                                                          for r in group]))
                running += len(group)
        self.metrics.queue_depth = len(self._waiting)
        self.metrics.running = running

    def _start(self, group: list[Request]) -> MicroBatchState:
        """A micro-batch for ``group``. Its rows copy the prompt prefix they share from the
        prefix cache where it holds one. Else, when nothing else runs, the prefix is computed
        here, once; a prompt alone has all its tokens but the last computed so, for the prefix
        cache to keep. (Beside running streams a prompt goes in chunk by chunk between their
        steps instead: computing a prefix here would hold them up for all of it.) On one rank
        only: over several, every row computes its own prompt."""
        seqs, key = [r.seq for r in group], group[0].id
        ex, chunk = self.runner.executor, self.runner.prefill_chunk_size
        if not self.runner.prefixes_shared:
            return MicroBatchState(ex, seqs, chunk, key=key)
        found = self.prefixes.find(ex.cfg, seqs) if self.prefixes is not None else None
        idle = not self._states
        n = shared_length(ex, seqs) if idle else 0
        # a cached prefix a little shorter than the one the rows share beats computing theirs:
        # each row then computes the tokens between the two itself
        if found is not None and (found[1] >= n or (n - found[1]) * len(seqs) <= n):
            (shared, n), computed = found, False
        elif n:
            shared, computed = SharedPrefix.common(ex, seqs, n, chunk), True
        elif (idle and self.prefixes is not None and len(seqs) == 1
              and len(seqs[0].prompt_ids) > MIN_SHARED_PREFIX):
            s = seqs[0]
            shared = SharedPrefix(ex, s.prompt_ids[:-1], s.params.prompt_logprobs, chunk,
                                  s.tokenizer, len(s.prompt_ids))
            n, computed = shared.length, True
        else:
            return MicroBatchState(ex, seqs, chunk, key=key)
        try:
            state = MicroBatchState(ex, seqs, chunk, key=key, shared=shared, shared_tokens=n)
        finally:
            if computed and not (self.prefixes is not None and self.prefixes.add(shared)):
                shared.close()
        if not computed:
            self.metrics.prefix_cache_hits += 1
        self.metrics.shared_prompt_tokens += n * (len(seqs) - computed)
        if self.prefixes is not None:
            self.metrics.prefix_cache_bytes = self.prefixes.used
            self.metrics.prefix_cache_disk_bytes = self.prefixes.spilled
        return state

    def _finish_if_cancelled(self, req: Request) -> bool:
        if not req._cancel.is_set() or req.seq.finish_reason is not None:
            return False
        req.seq.finish_reason = CANCELLED
        self._replay.append(("cancel", req.id))
        self.metrics.requests_cancelled += 1
        req._emit(StreamEvent(req.id, -1, "", CANCELLED))
        del self._requests[id(req.seq)]
        return True

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    for req in [self._requests[id(q)] for s in self._states for q in s.live
                                if id(q) in self._requests]:
                        self._finish_if_cancelled(req)
                    if self._stopping:
                        for r in list(self._waiting):
                            r.cancel()
                            self._finish_if_cancelled(r)
                        self._waiting.clear()
                    self._states = [s for s in self._states if not s.done]
                    self._merge()
                    if not self._states and self._waiting:
                        self._gather()
                    self._admit()
                    if not self._states:
                        if self._stopping:
                            if self.prefixes is not None:
                                self.prefixes.close()
                            return
                        self._lock.wait()
                        continue
                    states = list(self._states)
                decoding = sum(len(s.live) for s in states if s.decoding)
                start = time.perf_counter()
                chunk = self._chunk(states, decoding)
                works = [s.work(chunk) for s in states]
                prompt_tokens = sum(s.prompt_tokens for s in states)
                rows = sum(len(s.live) for s in states)
                run = self.runner.executor.stats
                before = run.proposed_tokens, run.accepted_tokens, run.checking_steps
                events = self._step(states, works, chunk)
                self._pacer.observe(time.perf_counter() - start, prompt_tokens, decoding)
                with self._lock:
                    self.metrics.steps += 1
                    self.metrics.batch_sizes[rows] += 1
                    m = self.metrics
                    m.proposed_tokens += run.proposed_tokens - before[0]
                    m.accepted_tokens += run.accepted_tokens - before[1]
                    m.checking_steps += run.checking_steps - before[2]
                for ev in events:
                    self._deliver(ev)
        except BaseException as e:  # the engine broke: fail every request, refuse new ones
            logging.getLogger("tiergen").error("tiergen: the engine failed: %s", e, exc_info=e)
            with self._lock:
                self._error = e
                for r in list(self._requests.values()) + list(self._waiting):
                    r.seq.finish_reason = r.seq.finish_reason or "error"
                    r._emit(StreamEvent(r.id, -1, "", "error"))
                self._requests.clear()
                self._waiting.clear()

    def _chunk(self, states: list[MicroBatchState], decoding: int) -> int | None:
        """Prompt tokens per row of the next step: within the pacer's budget when prompt
        chunks share the step with decoding rows (None: as many as the prefill chunk)."""
        budget = self._pacer.budget(decoding)
        prefilling = sum(len(s.live) for s in states if not s.decoding)
        return None if budget is None or not prefilling else max(1, budget // prefilling)

    def _step(self, states: list[MicroBatchState], works: list[MicroBatch],
              chunk: int | None) -> list[StepEvent]:
        """Run one step of ``states``, handing the runner what this loop did since the last
        (admissions, merges, cancellations: over several ranks, every rank replays them)."""
        replay, self._replay = self._replay, []
        return self.runner.step(states, works, chunk, replay)

    def _deliver(self, ev: StepEvent) -> None:
        seq = ev.seq
        req = self._requests.get(id(seq))
        if req is None:
            return
        self.metrics.generated_tokens += ev.token_id >= 0
        req._emit(StreamEvent(req.id, ev.token_id, ev.delta, seq.finish_reason, ev.logprobs))
        if seq.finish_reason is not None:
            self.metrics.requests_finished += 1
            with self._lock:
                self._requests.pop(id(seq), None)
