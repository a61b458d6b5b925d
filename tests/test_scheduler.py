"""Continuous batching: requests joining a running block get what LLM.generate gives them."""

from __future__ import annotations

import threading
import time

import pytest

from tiergen import LLM, Policy, SamplingParams, TiergenError
from tiergen.engine.scheduler import CANCELLED, TIMED_OUT, Pacer, QueueFull, Scheduler
from tiny_models import build


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    build("llama-gqa-tied", d)
    return LLM(d, dtype="float32", policy=Policy(gpu_batch_size=4, num_gpu_batches=2))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_staggered_requests_match_offline(llm):
    prompts = [[5 + i] * (1 + 3 * i) for i in range(12)]
    lengths = [4 + (i % 5) * 3 for i in range(12)]
    expected = [llm.generate([p], greedy(n))[0].token_ids for p, n in zip(prompts, lengths)]
    sched = Scheduler(llm).start()
    try:
        requests = []
        for p, n in zip(prompts, lengths):  # arrive while others run
            requests.append(sched.submit(p, greedy(n)))
            time.sleep(0.005)
        for req, want in zip(requests, expected):
            events = list(req.events(timeout=60))
            assert [e.token_id for e in events] == want
            assert events[-1].finish_reason == "length"
        assert max(sched.metrics.batch_sizes) > 1  # they shared steps
        assert sched.metrics.requests_finished == 12
        assert sched.metrics.running == 0 or all(r.done for r in requests)
    finally:
        sched.stop()


def test_each_step_hands_the_runner_what_the_loop_did(llm, monkeypatch):
    """The scheduler drives the LLM's runner: each step gets the admissions, merges and
    cancellations made since the last one (other ranks replay them), and none pile up."""
    replays, step = [], llm.runner.step

    def recording(states, works, chunk, replay):
        replays.append(replay)
        return step(states, works, chunk, replay)

    monkeypatch.setattr(llm.runner, "step", recording)
    sched = Scheduler(llm).start()
    try:
        for req in [sched.submit([1, 2, 3 + i], greedy(4)) for i in range(3)]:
            list(req.events(timeout=60))
    finally:
        sched.stop()
    admitted = [r[0] for replay in replays for op, *args in replay if op == "admit"
                for r in args[1]]
    assert sorted(admitted) == [0, 1, 2] and sched._replay == []


def test_block_limit_is_kept_and_places_are_reused(llm):
    sched = Scheduler(llm, max_running=3).start()
    try:
        reqs = [sched.submit([1, 2, 3], greedy(5)) for _ in range(7)]
        for r in reqs:
            list(r.events(timeout=60))
        assert max(sched.metrics.batch_sizes) <= 3
        assert sched.metrics.requests_finished == 7
    finally:
        sched.stop()


def test_cancel_frees_the_sequence(llm):
    sched = Scheduler(llm).start()
    try:
        long = sched.submit([4, 5, 6], greedy(200))
        first = next(long.events(timeout=60))
        assert first.finish_reason is None
        long.cancel()
        assert list(long.events(timeout=60))[-1].finish_reason == CANCELLED
        assert sched.metrics.requests_cancelled == 1
        after = sched.submit([7, 8], greedy(3))
        assert len(list(after.events(timeout=60))) == 3
    finally:
        sched.stop()


def test_queue_limit_and_bad_input(llm):
    sched = Scheduler(llm, max_queue=2)  # not started: nothing leaves the queue
    sched.submit([1], greedy(2))
    sched.submit([2], greedy(2))
    with pytest.raises(QueueFull, match="the queue holds 2 waiting requests"):
        sched.submit([3], greedy(2))
    with pytest.raises(TiergenError, match="exceeds the model's context"):
        sched.submit([1] * 10, greedy(10_000))
    sched.start()
    sched.stop()  # cancels what waits, and returns
    assert sched.metrics.requests_rejected == 1


def test_events_are_delivered_to_callbacks_from_the_loop(llm):
    seen: list[int] = []
    done = threading.Event()

    def on_event(ev):
        seen.append(ev.token_id)
        if ev.finish_reason:
            done.set()

    sched = Scheduler(llm).start()
    try:
        req = sched.submit([9, 9], greedy(6), on_event=on_event)
        assert done.wait(60)
        assert seen == req.seq.token_ids
    finally:
        sched.stop()


def test_a_failing_listener_does_not_stop_the_engine(llm):
    sched = Scheduler(llm).start()
    try:
        bad = sched.submit([1, 2], greedy(3), on_event=lambda ev: 1 / 0)
        assert [e.finish_reason for e in bad.events(timeout=60)][-1] == "length"
        good = sched.submit([3, 4], greedy(3))
        assert len(list(good.events(timeout=60))) == 3
    finally:
        sched.stop()


def test_a_burst_becomes_one_micro_batch(llm):
    sched = Scheduler(llm).start()
    try:
        reqs = []
        for i in range(4):  # arrivals 5 ms apart while the engine is idle
            reqs.append(sched.submit([i + 1] * 3, greedy(4)))
            time.sleep(0.005)
        for r in reqs:
            list(r.events(timeout=60))
        assert sched.snapshot().batch_sizes[4] >= 3  # all four decoded together
    finally:
        sched.stop()


def test_a_long_prompt_joins_decoding_streams_chunk_by_chunk(tmp_path):
    """A long prompt arriving while streams decode is fed one chunk per step beside their
    decode steps: the streams keep producing tokens during its prefill, and every output
    equals LLM.generate's."""
    build("llama-gqa-tied", tmp_path)
    llm = LLM(tmp_path, dtype="float32", prefill_chunk_size=16)
    short = [[3, 4, 5], [6, 7]]
    long_prompt = [(7 * i) % 120 + 1 for i in range(100)]
    want = [llm.generate([p], greedy(40))[0].token_ids for p in short]
    want_long = llm.generate([long_prompt], greedy(5))[0].token_ids
    sched = Scheduler(llm).start()
    try:
        streams = [sched.submit(p, greedy(40)) for p in short]
        first = next(streams[0].events(timeout=60))
        late = sched.submit(long_prompt, greedy(5))
        times: list[float] = []
        for ev in streams[0].events(timeout=60):
            times.append(time.perf_counter())
        assert [e.token_id for e in late.events(timeout=60)] == want_long
        assert [first.token_id] + streams[0].seq.token_ids[1:] == want[0]
        assert streams[1].seq.token_ids == want[1]
        during = [t for t in times if late.created < t < late.first_token_at]
        assert len(during) >= 100 // 16 - 1  # a stream token for (about) every prompt chunk
    finally:
        sched.stop()


def test_the_pacer_sizes_prompt_chunks_from_measured_steps():
    """Prompt tokens beside decoding rows are budgeted so that the step takes about
    `stretch` decode steps, following the measured costs as they change, and never fewer
    than `min_tokens`."""
    pacer = Pacer(stretch=2.0, min_tokens=8)
    assert pacer.budget(decoding_rows=0) is None  # nothing decodes: full chunks
    pacer.observe(2.0, prompt_tokens=1000, decoding_rows=0)  # a pure prefill: 2 ms a token
    assert pacer.budget(decoding_rows=32) is None  # no decode step measured yet
    pacer.observe(0.4, prompt_tokens=0, decoding_rows=32)
    assert pacer.budget(decoding_rows=32) == 200  # one more decode step's worth: 0.4 s
    pacer.observe(0.4 + 200 * 0.004, prompt_tokens=200, decoding_rows=32)  # attention grew
    assert pacer.budget(decoding_rows=32) == 133  # ema: 3 ms a token
    pacer.observe(0.02, prompt_tokens=0, decoding_rows=1)  # one short stream left
    pacer.observe(0.02 + 10 * 0.1, prompt_tokens=10, decoding_rows=1)
    assert pacer.budget(decoding_rows=1) == 8  # the floor
    fresh = Pacer(min_tokens=8)
    fresh.observe(0.4, prompt_tokens=0, decoding_rows=32)
    assert fresh.budget(decoding_rows=32) == 32  # before any prompt was measured


def test_admission_keeps_to_the_memory_budget(tmp_path):
    """With room for one request's cache beside the weights but not two, the second waits for
    the first to finish (or gives up after queue_timeout); one that could never fit is refused
    when it is submitted, saying why."""
    from tiergen.engine.executor import block_needs

    build("llama-gqa-tied", tmp_path)
    ex = LLM(tmp_path, dtype="float32").executor
    prompt, n = [5, 6, 7, 8], 30
    one, two = (block_needs(ex.weight_plan, ex.cfg, ex.dtype, ex.policy, [(1, 34)] * k, 4)["device"]
                for k in (1, 2))
    llm = LLM(tmp_path, dtype="float32", device_memory=(one + two) // 2)
    want = llm.generate([prompt], greedy(n))[0].token_ids
    sched = Scheduler(llm).start()
    try:
        with pytest.raises(TiergenError, match="device budget"):
            sched.submit(prompt, greedy(200))
        first, second = sched.submit(prompt, greedy(n)), sched.submit(prompt, greedy(n))
        assert [e.token_id for e in first.events(timeout=60)] == want
        assert [e.token_id for e in second.events(timeout=60)] == want
        assert max(sched.snapshot().batch_sizes) == 1  # never both at once
        forward = llm.executor.forward_block

        def slow_step(*args, **kwargs):  # running outlasts the queue timeout on a fast machine
            time.sleep(0.005)
            return forward(*args, **kwargs)

        llm.executor.forward_block = slow_step
        sched.queue_timeout = 0.05
        running = sched.submit(prompt, greedy(n))
        waiting = sched.submit(prompt, greedy(n))
        assert list(waiting.events(timeout=60))[-1].finish_reason == TIMED_OUT
        assert [e.token_id for e in running.events(timeout=60)] == want
        assert sched.snapshot().requests_timed_out == 1
    finally:
        sched.stop()


@pytest.mark.parametrize("case, policy", [
    ("llama-gqa-tied", {}),
    ("mistral-window", {"cache": (0, 0)}),  # rings of 8 slots, in spill files on disk
    ("deepseek-v2-lite", {}),  # latent rows
])
def test_micro_batches_that_joined_apart_are_merged(tmp_path, case, policy):
    """Requests arriving one by one become micro-batches at different points of the timeline;
    once their prompts are in they merge into one (the later ones shifted), and every output
    (greedy, seeded, with a repetition penalty) stays what LLM.generate gives."""
    build(case, tmp_path)
    llm = LLM(tmp_path, dtype="float32",
              policy=Policy(gpu_batch_size=4, offload_dir=tmp_path / "offload", **policy))
    prompts = [[3 + i] * (2 + 5 * i) for i in range(4)]
    params = [greedy(24), SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3,
                             ignore_eos=True), greedy(30)]
    want = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    sched = Scheduler(llm).start()
    try:
        requests = []
        for p, q in zip(prompts, params):  # each one is decoding before the next arrives
            requests.append(sched.submit(p, q))
            next(requests[-1].events(timeout=60))
        for r in requests:
            list(r.events(timeout=60))
        assert [r.seq.token_ids for r in requests] == want
        m = sched.snapshot()
        assert m.merges == 3 and m.batch_sizes[4] > 0
    finally:
        sched.stop()
