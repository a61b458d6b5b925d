"""A prompt prefix shared by a block's sequences is computed once and copied into each row's
cache: the same tokens, log-probabilities and prompt log-probabilities as computing it per
row, for every architecture, through a disk policy, in micro-batches, and in the server's
scheduler."""

from __future__ import annotations

import pytest

from tiergen import LLM, SamplingParams
from tiergen.engine.generate import MIN_SHARED_PREFIX
from tiergen.engine.scheduler import Scheduler
from tiergen.offload.policy import Policy

from tiny_models import CASES, build

PREFIX = [(7 * i) % 97 + 3 for i in range(MIN_SHARED_PREFIX + 9)]
RESTS = [[11], [20, 21, 22, 23, 24], [30, 31, 32], list(range(40, 52))]  # lengths differ
SAME = [[11, 12, 13], [20, 21, 22], [30, 31, 32], [41, 42, 43]]  # lengths equal


def run(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    return llm.generate(prompts, params)


def assert_same(got: list, want: list, tol: float = 1e-4) -> None:
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for pos_g, pos_w in zip(g.prompt_logprobs[1:] + g.logprobs,
                                w.prompt_logprobs[1:] + w.logprobs):
            assert pos_g.keys() == pos_w.keys()
            for token in pos_g:
                assert abs(pos_g[token].logprob - pos_w[token].logprob) < tol
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(w.prompt_logprobs)


def windows_below(llm: LLM, slots: int) -> bool:
    cfg = llm.config
    return any(w and w < slots for w in map(cfg.window, range(cfg.num_layers)))


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    build(request.param, directory)
    return directory


@pytest.mark.parametrize("rests", [RESTS, SAME], ids=["rests-differ", "rests-equal"])
def test_shared_prefix_is_exact(model_dir, rests):
    prompts = [PREFIX + r for r in rests]
    llm = LLM(model_dir, dtype="float32")
    shared = run(llm, prompts)
    saved = llm.last_stats.shared_prompt_tokens
    llm.share_prefixes = False
    alone = run(llm, prompts)
    assert llm.last_stats.shared_prompt_tokens == 0
    assert_same(shared, alone)
    longest = max(map(len, prompts)) + 12
    if rests is RESTS and (windows_below(llm, longest) or llm.config.keeps_states):
        # the padding after the prefix would sit inside a ring's window, or a
        # linear-attention layer's convolution
        assert saved == 0
    else:
        assert saved == len(PREFIX) * (len(prompts) - 1)


def test_shared_prefix_through_a_disk_policy_and_micro_batches(tmp_path):
    directory = tmp_path / "model"
    build("llama-gqa-tied", directory)
    policy = Policy(weights=(0, 0), cache=(0, 0), hidden=(0, 0), gpu_batch_size=2,
                    num_gpu_batches=2, offload_dir=tmp_path / "offload")
    prompts = [PREFIX + r for r in RESTS]
    llm = LLM(directory, dtype="float32", policy=policy)
    shared = run(llm, prompts)
    assert llm.last_stats.shared_prompt_tokens == len(PREFIX) * (len(prompts) - 1)
    plain = LLM(directory, dtype="float32", share_prefixes=False)
    assert_same(shared, run(plain, prompts))


def test_prompts_without_a_long_common_prefix_compute_their_own(tmp_path):
    build("llama-mha", tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    run(llm, [PREFIX[:MIN_SHARED_PREFIX - 1] + r for r in SAME])
    assert llm.last_stats.shared_prompt_tokens == 0
    run(llm, [PREFIX[:MIN_SHARED_PREFIX] + r for r in SAME])
    assert llm.last_stats.shared_prompt_tokens == MIN_SHARED_PREFIX * (len(SAME) - 1)


def test_the_server_scheduler_shares_a_prefix_and_counts_it(tmp_path):
    build("qwen3", tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    prompts = [PREFIX + r for r in RESTS]
    want = [r.token_ids for r in llm.generate(prompts, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))]
    scheduler = Scheduler(llm)  # not started: the requests wait, then are admitted together
    requests = [scheduler.submit(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                for p in prompts]
    scheduler.start()
    try:
        got = [[ev.token_id for ev in r.events(timeout=60) if ev.token_id >= 0] for r in requests]
    finally:
        scheduler.stop()
    assert got == want
    m = scheduler.snapshot()
    assert m.prefix_cache_hits == 0
    assert m.shared_prompt_tokens == len(PREFIX) * (len(prompts) - 1)


def one_at_a_time(scheduler: Scheduler, prompts: list[list[int]], params: SamplingParams) -> list:
    """Each request submitted once the one before has finished: nothing to share but what the
    prefix cache kept."""
    out = []
    for p in prompts:
        events = list(scheduler.submit(p, params).events(timeout=60))
        out.append(([ev.token_id for ev in events if ev.token_id >= 0],
                    [ev.logprobs for ev in events if ev.token_id >= 0]))
    return out


@pytest.mark.parametrize("case", ["llama-gqa-tied", "deepseek-v2", "mistral-window"])
def test_the_prefix_cache_serves_later_requests(tmp_path, case):
    build(case, tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    # the first prompt's entry holds 4 tokens past PREFIX, which the second does not share
    prompts = [PREFIX + r for r in (RESTS[1], RESTS[0], RESTS[2], RESTS[3], RESTS[1])]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    llm.share_prefixes = False
    want = [(r.token_ids, r.logprobs) for r in llm.generate(prompts, params)]
    llm.share_prefixes = True
    scheduler = Scheduler(llm, prefix_cache=1 << 26).start()
    try:
        got = one_at_a_time(scheduler, prompts, params)
    finally:
        scheduler.stop()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        for a, b in zip(logprobs, want_logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    m = scheduler.snapshot()
    if case == "mistral-window":
        # a ring holds an entry's last slots, not its first: the second request cannot take
        # part of the first's entry and leaves one of its own (PREFIX), which the next two
        # take whole; the repeat takes the first's whole
        assert m.prefix_cache_hits == len(prompts) - 2
    else:  # every request after the first takes PREFIX, the repeat all but its last token
        assert m.prefix_cache_hits == len(prompts) - 1
        assert m.shared_prompt_tokens == len(PREFIX) * 3 + len(prompts[-1]) - 1
    assert 0 < m.prefix_cache_bytes <= 1 << 26
    assert scheduler.prefixes is not None and len(scheduler.prefixes) == 0  # closed at stop


def test_a_cached_prefix_gives_the_rows_prompt_logprobs_of_their_own_tokens(tmp_path):
    """A row that shares only part of a cached entry, up to a token where it differs, gets
    the log-probability of its own token there (the entry scored its own)."""
    build("llama-gqa-tied", tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    prompts = [PREFIX + r for r in (RESTS[1], RESTS[0], RESTS[2])]
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    llm.share_prefixes = False
    want = [r.prompt_logprobs for r in llm.generate(prompts, params)]
    llm.share_prefixes = True
    scheduler = Scheduler(llm, prefix_cache=1 << 26).start()
    try:
        got = []
        for p in prompts:
            request = scheduler.submit(p, params)
            list(request.events(timeout=60))
            got.append(request.seq.prompt_logprobs)
    finally:
        scheduler.stop()
    assert scheduler.snapshot().prefix_cache_hits == len(prompts) - 1
    for prompt, ours, ref in zip(prompts, got, want):
        assert len(ours) == len(prompt) and ours[0] is None
        for token, a, b in zip(prompt[1:], ours[1:], ref[1:]):
            assert token in a and abs(a[token].logprob - b[token].logprob) < 1e-4


def test_the_prefix_cache_stays_within_its_budget(tmp_path):
    build("llama-mha", tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    one = llm.executor.new_cache(1, len(PREFIX) + 12)
    budget = int(2.5 * one.nbytes)  # room for two entries of about this size
    one.close()
    scheduler = Scheduler(llm, prefix_cache=budget).start()
    try:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        distinct = [[(i * 13 + j) % 90 + 5 for j in range(len(PREFIX) + 5)] for i in range(5)]
        one_at_a_time(scheduler, distinct, params)
        assert len(scheduler.prefixes) == 2 and scheduler.prefixes.used <= budget
        assert scheduler.snapshot().prefix_cache_hits == 0
    finally:
        scheduler.stop()


def test_on_the_integer_path_sharing_equals_chunks_that_end_where_the_prefix_ends():
    """The packaged model's packed weights on the integer path: sharing a prefix gives what a
    run that computes it per row in a prefill chunk of its own gives, within the path's float
    rounding (the 8-bit tiles round at about a unit of each activation block's scale, so a
    last-bit difference in attention moves a log-probability by up to about 1e-3; against
    another chunking, the 8-bit rounding of activations can turn it into whole steps)."""
    llm = LLM("smollm2", activations="int8")
    prefix = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)
    # rests of one length: without sharing, the rows' chunks then all end where the prefix does
    prompts = [prefix + llm.tokenizer.encode(q, add_special_tokens=False)[:3]
               for q in (" Why did it?", " What did the fox do", " Who saw it then")]
    assert len({len(p) for p in prompts}) == 1
    shared = run(llm, prompts)
    assert llm.last_stats.shared_prompt_tokens == len(prefix) * 2
    plain = LLM("smollm2", activations="int8", share_prefixes=False,
                prefill_chunk_size=len(prefix))
    alone = run(plain, prompts)
    assert_same(shared, alone, tol=5e-3)


def test_a_cached_prefix_a_little_shorter_than_the_rows_share_is_taken(tmp_path):
    """Rows sharing two tokens more than an entry holds copy the entry and compute those two
    each: cheaper than computing their whole common prefix again."""
    build("qwen2", tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = [PREFIX + [60, 61, i] for i in range(4)]
    second = [PREFIX + [62, 63, i] for i in range(4)]
    llm.share_prefixes = False
    want = [r.token_ids for r in llm.generate(first + second, params)]
    llm.share_prefixes = True
    scheduler = Scheduler(llm, prefix_cache=1 << 26).start()
    got = []
    try:
        for group in (first, second):
            with scheduler._lock:  # all four wait together, so they are admitted together
                requests = [scheduler.submit(p, params) for p in group]
            got += [[ev.token_id for ev in r.events(timeout=60) if ev.token_id >= 0]
                    for r in requests]
    finally:
        scheduler.stop()
    assert got == want
    m = scheduler.snapshot()
    assert m.prefix_cache_hits == 1  # the second group took the first's prefix
    assert m.shared_prompt_tokens == (len(PREFIX) + 2) * 3 + len(PREFIX) * 4


def test_prefixes_that_leave_the_prefix_cache_are_served_from_spill_files(tmp_path):
    build("qwen3", tmp_path / "model")
    policy = Policy(offload_dir=tmp_path / "offload")
    llm = LLM(tmp_path / "model", dtype="float32", policy=policy)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    first, second = PREFIX + [60, 61], [p + 1 for p in PREFIX] + [62, 63]
    prompts = [first, second, first[:-1] + [70]]  # the last takes the first's, from disk
    llm.share_prefixes = False
    want = [(r.token_ids, r.logprobs) for r in llm.generate(prompts, params)]
    llm.share_prefixes = True
    one = llm.executor.new_cache(1, len(first))
    scheduler = Scheduler(llm, prefix_cache=int(1.5 * one.nbytes), prefix_cache_disk=1 << 26)
    one.close()
    scheduler.start()
    try:
        got = one_at_a_time(scheduler, prompts, params)
        m = scheduler.snapshot()
        spill = list((tmp_path / "offload").rglob("spill-*.bin"))
        assert len(spill) > 0  # the first's entry, moved on when the second's came
    finally:
        scheduler.stop()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        for a, b in zip(logprobs, want_logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert m.prefix_cache_hits == 1 and m.prefix_cache_disk_bytes > 0
    assert not list((tmp_path / "offload").rglob("spill-*.bin"))  # removed at stop
