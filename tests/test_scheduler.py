"""Continuous batching: requests joining a running block get what LLM.generate gives them."""

from __future__ import annotations

import threading
import time

import pytest

from tiergen import LLM, Policy, SamplingParams, TiergenError
from tiergen.engine.scheduler import CANCELLED, QueueFull, Scheduler
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
