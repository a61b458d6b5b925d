"""Pipeline parallelism over processes on loopback (gloo): the same tokens and likelihoods as
one process, for every architecture, and faults that stop every rank with a clear error."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tiergen import LLM, SamplingParams
from tiergen.errors import TiergenError
from tiergen.offload.policy import Policy
from tiergen.parallel.stage import split_layers

from tiny_models import CASES, build

PROMPTS = [[5], list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 70)), [100, 3, 17]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SAMPLED = [SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=s, ignore_eos=True)
           for s in range(len(PROMPTS))]
TEXT = list(range(1, 60))
# small micro-batches (three per block, dealt to the stages) and chunked prompts
OPTIONS = dict(dtype="float32", max_batch_size=2, prefill_chunk_size=8)


def disk(tmp_path) -> Policy:
    """Weights and KV cache on disk."""
    return Policy(weights=(0, 0), cache=(0, 0), offload_dir=tmp_path)


def reference(name: str, directory) -> tuple[LLM, list, list]:
    """A tiny model built in ``directory``, loaded in one process, with its greedy and
    sampled tokens for PROMPTS: what the parallel runs must match."""
    build(name, directory)
    one = LLM(directory, **OPTIONS)
    return one, [r.token_ids for r in one.generate(PROMPTS, GREEDY)], \
        [r.token_ids for r in one.generate(PROMPTS, SAMPLED)]


@pytest.fixture(scope="session", params=sorted(CASES))
def case(request, tmp_path_factory):
    """Every tiny architecture with its one-process reference (shared with the
    tensor-parallel tests, which import this fixture)."""
    directory = tmp_path_factory.mktemp(request.param)
    return directory, *reference(request.param, directory)


def test_two_ranks_match_one_process(case, tmp_path):
    """Rank 1 holds its weights and cache on disk; rank 0 everything in memory."""
    directory, one, greedy, sampled = case
    perplexity = one.perplexity(TEXT)
    with LLM(directory, **OPTIONS, pipeline_parallel=2, policy=[Policy(), disk(tmp_path)]) as llm:
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == greedy
        assert [r.token_ids for r in llm.generate(PROMPTS, SAMPLED)] == sampled
        assert llm.perplexity(TEXT) == pytest.approx(perplexity, rel=1e-5)
        workers = llm.group.workers
    assert all(p.poll() is not None for p in workers), "a rank outlived close()"


def _logprobs(seqs) -> list:
    """Each sequence's tokens, and its token and prompt log-probabilities as (token, rank)
    pairs and the values apart."""
    def flat(entries):
        return [None if e is None else sorted((t, p.rank) for t, p in e.items())
                for e in entries or ()]

    def values(entries):
        return [p.logprob for e in entries or () if e is not None for _, p in sorted(e.items())]
    return [(s.token_ids, flat(s.logprobs), flat(s.prompt_logprobs),
             values(s.logprobs) + values(s.prompt_logprobs)) for s in seqs]


@pytest.mark.parametrize("server", [False, True], ids=["offline", "server"])
def test_log_probabilities_come_back_from_the_last_stage(server, tmp_path):
    """The last stage samples and sees the logits; rank 0 reports the same log-probabilities
    of sampled and prompt tokens as one process, prompts chunked, rows asking or not, and
    through a server's step-by-step scheduler."""
    build("llama-gqa-tied", tmp_path / "model")
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2) if i % 2 else GREEDY
              for i in range(len(PROMPTS))]
    expected = _logprobs(LLM(tmp_path / "model", **OPTIONS).generate(PROMPTS, params))
    assert len(expected[1][2]) == 37 and expected[0][1] == []  # a long prompt; one not asking
    with LLM(tmp_path / "model", **OPTIONS, pipeline_parallel=2) as llm:
        if server:
            from tiergen.engine.scheduler import Scheduler

            sched = Scheduler(llm).start()
            try:
                requests = [sched.submit(p, q) for p, q in zip(PROMPTS, params)]
                for r in requests:
                    list(r.events(timeout=60))
                got = _logprobs([r.seq for r in requests])
            finally:
                sched.stop()
        else:
            got = _logprobs(llm.generate(PROMPTS, params))
    for g, e in zip(got, expected, strict=True):
        assert g[:3] == e[:3] and g[3] == pytest.approx(e[3], abs=1e-5)


@pytest.mark.parametrize("name", ["deepseek-v2", "gemma3-window8-linear", "qwen2-window"])
def test_three_ranks_match_one_process(name, tmp_path):
    build(name, tmp_path / "model")
    one = LLM(tmp_path / "model", **OPTIONS)
    expected = [r.token_ids for r in one.generate(PROMPTS, GREEDY)]
    with LLM(tmp_path / "model", **OPTIONS, pipeline_parallel=3,
             policy=[Policy(), disk(tmp_path / "disk"), Policy()]) as llm:
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected
        assert llm.perplexity(TEXT) == pytest.approx(one.perplexity(TEXT), rel=1e-5)


def test_layers_are_split_so_the_costliest_stage_is_cheapest():
    def worst(spans, costs, head):
        return max(sum(costs[j] for j in r) + (head if r.stop == len(costs) else 0) for r in spans)

    assert split_layers([1.0] * 6, 2, head=2.0) == [range(0, 4), range(4, 6)]
    assert split_layers([5.0, 1.0, 1.0, 1.0], 2) == [range(0, 1), range(1, 4)]
    assert split_layers([1.0] * 4, 4, head=9.0) == [range(i, i + 1) for i in range(4)]
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    spans = split_layers(costs, 3, head=4.0)
    assert [j for r in spans for j in r] == list(range(8)) and all(len(r) for r in spans)
    assert worst(spans, costs, 4.0) == 14.0  # the best of every way to cut (checked by hand)
    for bad in (0, 9, 2.0):
        with pytest.raises(TiergenError, match="pipeline_parallel must be"):
            split_layers(costs, bad)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build("llama-gqa-tied", directory)
    return directory


def test_bad_settings_are_refused_before_any_rank_starts(llama):
    with pytest.raises(TiergenError, match="from 1 to the model's 2 layers"):
        LLM(llama, pipeline_parallel=3)
    with pytest.raises(TiergenError, match="one per rank"):
        LLM(llama, pipeline_parallel=2, policy=[Policy()] * 3)
    with pytest.raises(TiergenError, match="must cut the batch alike"):
        LLM(llama, pipeline_parallel=2, policy=[Policy(), Policy(gpu_batch_size=2)])
    with pytest.raises(TiergenError, match="is for pipeline_parallel or tensor_parallel > 1"):
        LLM(llama, policy=[Policy()])
    with pytest.raises(TiergenError, match="parallel_timeout"):
        LLM(llama, pipeline_parallel=2, parallel_timeout=0)


def test_the_ranks_load_from_the_whole_config(llama, monkeypatch):
    """Every rank gets rank 0's EngineConfig whole (share_prefixes included), the model as
    rank 0 opened it."""
    from tiergen.engine import pipeline
    from tiergen.engine.config import EngineConfig
    from tiergen.engine.runner import serve_rank

    started = []

    def launch(size, tensor, timeout, worker, threads):
        started.append(worker)
        raise TiergenError("no rank started")

    monkeypatch.setattr(pipeline, "launch", launch)
    settings = dict(OPTIONS, pipeline_parallel=2, share_prefixes=False, host_memory="1G",
                    activations="float32", parallel_timeout=20)
    with pytest.raises(TiergenError, match="no rank started"):
        LLM(llama, **settings)
    (worker,) = started
    assert worker.func is serve_rank
    assert worker.args == (EngineConfig(str(llama.resolve()), **settings),)


def test_a_rank_that_cannot_load_stops_all_with_its_reason(llama, tmp_path):
    """Rank 1 streams from disk and its buffers do not fit its host budget."""
    with pytest.raises(TiergenError, match="parallel rank 1: .*host budget"):
        LLM(llama, pipeline_parallel=2, host_memory="20K", policy=[Policy(), disk(tmp_path)])


@pytest.mark.parametrize("held", [False, True], ids=["collected", "held"])
def test_a_stream_left_early_keeps_the_ranks_in_step(llama, held, monkeypatch):
    """Closing the stream finishes its run on every rank at once, also where something
    still holds the run (on CUDA something did, and the ranks fell out of step)."""
    from tiergen.engine.runner import RankedRunner

    held_runs, run = [], RankedRunner.run

    def held_run(self, seqs):
        held_runs.append(run(self, seqs))
        return held_runs[-1]

    if held:
        monkeypatch.setattr(RankedRunner, "run", held_run)
    with LLM(llama, **OPTIONS, pipeline_parallel=2, parallel_timeout=20) as llm:
        expected = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
        stream = llm.stream(PROMPTS, GREEDY)
        next(stream)
        stream.close()
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected


def _when_running(llm: LLM, act) -> threading.Thread:
    """Do ``act`` to rank 1 once the run is under way."""
    def wait_then_act():
        time.sleep(1.0)
        act(llm.group.workers[0].pid)
    thread = threading.Thread(target=wait_then_act)
    thread.start()
    return thread


LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


def test_a_killed_rank_stops_the_others_with_its_name(llama):
    llm = LLM(llama, dtype="float32", pipeline_parallel=2)
    thread = _when_running(llm, lambda pid: os.kill(pid, signal.SIGKILL))
    started = time.monotonic()
    with pytest.raises(TiergenError, match="parallel rank 1 was killed by signal 9"):
        while True:  # until the kill lands
            llm.generate(PROMPTS * 4, LONG)
    thread.join()
    assert time.monotonic() - started < 30
    assert all(p.poll() is not None for p in llm.group.workers)
    with pytest.raises(TiergenError, match="parallel ranks have stopped"):
        llm.generate(PROMPTS, GREEDY)


def test_a_rank_that_stops_answering_times_out(llama):
    llm = LLM(llama, dtype="float32", pipeline_parallel=2, parallel_timeout=3)
    thread = _when_running(llm, lambda pid: os.kill(pid, signal.SIGSTOP))
    started = time.monotonic()
    with pytest.raises(TiergenError, match="parallel rank 1 did not answer within 3 s"):
        while True:
            llm.generate(PROMPTS * 4, LONG)
    thread.join()
    assert time.monotonic() - started < 30
    assert all(p.poll() is not None for p in llm.group.workers), "the stopped rank was left"


@pytest.mark.parametrize("sig,message", [(signal.SIGKILL, "was killed by signal 9"),
                                         (signal.SIGSTOP, "did not answer within 3 s")])
def test_a_rank_lost_between_runs_is_named_at_the_next(llama, sig, message):
    """Lost while rank 0 waits for the user: the next run's command and agreement notice it
    within the timeout, rather than wait for ever."""
    llm = LLM(llama, dtype="float32", pipeline_parallel=2, parallel_timeout=3)
    llm.generate(PROMPTS, GREEDY)
    os.kill(llm.group.workers[0].pid, sig)
    started = time.monotonic()
    with pytest.raises(TiergenError, match=f"parallel rank 1 {message}"):
        llm.generate(PROMPTS, GREEDY)
    assert time.monotonic() - started < 30
    assert all(p.poll() is not None for p in llm.group.workers), "the lost rank was left"
    with pytest.raises(TiergenError, match="parallel ranks have stopped"):
        llm.generate(PROMPTS, GREEDY)


def test_the_command_line_runs_a_pipeline(capsys):
    from tiergen import cli

    args = ["generate", "--json", "--max-tokens", "6", "The capital of France is", "Hello"]
    assert cli.main(args) == 0
    one = capsys.readouterr().out
    assert cli.main(args + ["--pipeline-parallel", "2"]) == 0
    assert capsys.readouterr().out == one


def test_prefill_is_cut_so_that_stages_overlap(llama):
    """A pipelined block prefills in chunks small enough that later chunks go through the
    first stage while earlier ones are in the last; the tokens stay those of one process
    prefilling whole prompts."""
    from tiergen.engine.pipeline import pipeline_chunk

    assert pipeline_chunk(512, 128, 1) == 512 and pipeline_chunk(None, 128, 1) is None
    assert pipeline_chunk(512, 128, 2) == 32 and pipeline_chunk(None, 128, 2) == 32
    assert pipeline_chunk(512, 20, 2) == 16  # never below MIN_CHUNK
    assert pipeline_chunk(8, 128, 2) == 8  # never above the run's own chunk
    long = [list(range(3, 90)), list(range(10, 50)), [5, 6, 7]]
    one = LLM(llama, dtype="float32", prefill_chunk_size=512)
    expected = [r.token_ids for r in one.generate(long, GREEDY)]
    with LLM(llama, dtype="float32", prefill_chunk_size=512, pipeline_parallel=2) as llm:
        assert [r.token_ids for r in llm.generate(long, GREEDY)] == expected


def test_a_rank_that_fails_to_start_is_reported_at_once(monkeypatch):
    """A worker function the new interpreter cannot import: the rank exits while unpickling
    its arguments, and rank 0 says so without waiting out the timeout."""
    import sys
    import types

    from tiergen.parallel.group import launch

    module = types.ModuleType("tiergen_test_absent_module")

    def work(group) -> None:
        pass

    work.__module__, work.__qualname__ = module.__name__, "work"
    module.work = work
    monkeypatch.setitem(sys.modules, module.__name__, module)
    started = time.monotonic()
    with pytest.raises(TiergenError, match="parallel rank 1 .* failed to start"):
        launch(2, 1, timeout=120, worker=work, threads=1)
    assert time.monotonic() - started < 30
