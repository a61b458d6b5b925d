"""Speculative decoding (prompt lookup and draft models): the output is the model's own,
greedy or sampled, through the policies and cache kinds, with the sampling options that
change picks; what cannot drop rejected proposals, or a draft of another vocabulary, is
refused."""

from __future__ import annotations

import random
import statistics
import time

import pytest

import tiergen.engine.generate as generate
from tiergen import LLM, Policy, SamplingParams, TiergenError
from tiergen.engine.scheduler import Scheduler
from tiergen.engine.speculative import AutoLength, SpeculativeConfig, lookup
from tiny_models import build

NGRAM = {"method": "ngram"}


def ngram(k: int = 8) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k}


def propose_from(monkeypatch, prompts, outputs, vocab=128):
    """Make the proposals those of a guesser that knows each prompt's output: right, but
    with every second step's third proposal wrong, so that rows keep all of some steps'
    proposals and part of others' (a random model's own text rarely repeats its prompt)."""
    known = {tuple(p): o for p, o in zip(prompts, outputs)}
    steps = []

    def guess(history, k, max_ngram=3):
        for prompt, out in known.items():
            if tuple(history[:len(prompt)]) == prompt and len(history) > len(prompt) - 1:
                done = len(history) - len(prompt)
                if history[len(prompt):] == out[:done]:
                    steps.append(None)
                    d = out[done:done + k]
                    if len(steps) % 2 and len(d) >= 3:
                        d[2] = (d[2] + 1) % vocab
                    return d
        return lookup(history, k)
    monkeypatch.setattr(generate, "lookup", guess)

# prompts that repeat themselves, so that lookup proposes (some kept, some not), of
# different lengths (left padding)
BASE = [3, 9, 17, 22, 40, 41, 42, 43, 9, 17, 22, 40, 5, 6, 7]
PROMPTS = [BASE * 3, [12, 6, 90, 12, 6, 90, 12, 6], [7, 8, 9, 10, 7, 8] * 2]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=11, ignore_eos=True,
                         logprobs=2)


def test_lookup_copies_what_followed_the_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]  # latest of the 3-gram
    assert lookup([4, 2, 3, 9, 7, 7, 2, 3], 3) == [9, 7, 7]  # the 2-gram when no 3-gram
    assert lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert lookup([5, 6, 5], 4) == [6, 5]  # what follows runs to the end of the text
    assert lookup([5, 6, 5], 0) == []


POLICIES = {
    "resident": dict(),
    "cache-on-disk": dict(policy="disk"),
    "micro-batches": dict(policy=Policy(gpu_batch_size=2, num_gpu_batches=2)),
}


@pytest.mark.parametrize("case", ["llama-gqa-tied", "deepseek-v3", "mixtral"])
@pytest.mark.parametrize("where", sorted(POLICIES))
def test_the_output_is_the_models_own(models, tmp_path, monkeypatch, case, where):
    """Greedy and seeded sampled rows give the tokens (and log-probabilities) of plain
    decoding, with proposals right, wrong and in between; the rows keep different numbers
    of them."""
    kwargs = POLICIES[where]
    if kwargs.get("policy") == "disk":
        kwargs = dict(policy=Policy(cache=(0, 0), offload_dir=tmp_path / "off"))
    plain = LLM(models(case), dtype="float32", **kwargs)
    spec = LLM(models(case), dtype="float32", speculative_config=ngram(3), **kwargs)
    for params in (GREEDY, SAMPLED):
        want = plain.generate(PROMPTS, params)
        propose_from(monkeypatch, PROMPTS, [w.token_ids for w in want])
        got = spec.generate(PROMPTS, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        stats = spec.last_stats
        assert 0 < stats.accepted_tokens < stats.proposed_tokens
        assert stats.decode_tokens == plain.last_stats.decode_tokens
        if params.logprobs:
            for w, g in zip(want, got):
                for a, b, t in zip(w.logprobs, g.logprobs, w.token_ids):
                    assert a.keys() == b.keys()
                    assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_penalties_bias_and_lengths_keep_their_meaning(models):
    """Picks after penalties and a bias that depend on the tokens before them, rows of
    different max_tokens (one ending inside a step of proposals), and a row that generates
    nothing."""
    path = models("llama-gqa-tied")
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                             frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True,
                             repetition_penalty=1.3, logit_bias={17: 4.0, 9: -3.0}),
              SamplingParams(max_tokens=13, temperature=0.7, seed=5, ignore_eos=True,
                             frequency_penalty=0.4)]
    want = LLM(path, dtype="float32").generate(PROMPTS, params)
    spec = LLM(path, dtype="float32", speculative_config=NGRAM)
    got = spec.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [len(g.token_ids) for g in got] == [20, 7, 13]
    assert spec.last_stats.proposed_tokens > 0


def test_a_prompt_turns_speculation_on_or_off_for_itself(models, monkeypatch):
    """num_speculative_tokens per prompt: 0 turns the LLM's off; k on an LLM without a
    speculative_config decodes that prompt by prompt lookup; rows of both in one batch."""
    path = models("llama-gqa-tied")
    plain = LLM(path, dtype="float32")
    want = plain.generate(PROMPTS, GREEDY)
    propose_from(monkeypatch, PROMPTS, [w.token_ids for w in want])
    off = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=0)
    spec = LLM(path, dtype="float32", speculative_config=ngram(3))
    assert [g.token_ids for g in spec.generate(PROMPTS, off)] == [w.token_ids for w in want]
    assert spec.last_stats.proposed_tokens == 0
    on = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, num_speculative_tokens=3)
    got = plain.generate(PROMPTS, [on, GREEDY, on])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert plain.last_stats.proposed_tokens > 0
    with pytest.raises(TiergenError, match="sliding window"):
        LLM(models("mistral-window"), dtype="float32").generate(PROMPTS[0], on)
    with pytest.raises(TiergenError, match="num_speculative_tokens must be"):
        SamplingParams(num_speculative_tokens=-1)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_continuous_batching_gives_each_request_its_own_output(models, method):
    """Requests arrive while others decode, so that micro-batches merge (a draft model's
    cache starts again from the merged timeline)."""
    path = models("llama-gqa-tied")
    plain = LLM(path, dtype="float32")
    expected = [plain.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(models("qwen2"))
    llm = LLM(path, dtype="float32", speculative_config=spec,
              policy=Policy(gpu_batch_size=4, num_gpu_batches=1))
    sched = Scheduler(llm).start()
    try:
        requests = []
        for p in PROMPTS:  # arrive while the others decode: their micro-batches merge
            requests.append(sched.submit(p, GREEDY))
            time.sleep(0.01)
        for req, want in zip(requests, expected):
            assert [e.token_id for e in req.events(timeout=60)] == want
        m = sched.snapshot()  # what /metrics reports
        assert m.checking_steps > 0 and m.proposed_tokens >= m.checking_steps
        assert 0 <= m.accepted_tokens <= m.proposed_tokens
    finally:
        sched.stop()


@pytest.mark.slow
def test_real_text_with_stops_and_a_grammar():
    """A real model on text that repeats: stop strings cut where plain decoding cuts, and a
    JSON schema constrains both the proposals' checks and the picks."""
    plain = LLM("smollm2", dtype="float32", activations="float32")
    spec = LLM("smollm2", dtype="float32", activations="float32", speculative_config=NGRAM)
    text = ("Copy the list exactly.\nList: apples, pears, plums, apples, pears, plums, "
            "apples, pears, plums.\nCopy: apples, pears,")
    kept = 0
    for params in (SamplingParams(max_tokens=40, temperature=0, stop=["\n"]),
                   SamplingParams(max_tokens=40, temperature=0, json_schema={
                       "type": "object", "properties": {"fruit": {"type": "string"}},
                       "required": ["fruit"]})):
        want, got = plain.generate([text], params)[0], spec.generate([text], params)[0]
        assert (got.text, got.token_ids, got.finish_reason) == \
            (want.text, want.token_ids, want.finish_reason)
        kept += spec.last_stats.accepted_tokens
    assert kept > 0


@pytest.mark.parametrize("case, kwargs, why", [
    ("mistral-window", {}, "sliding window"),
    ("qwen3-next", {}, "linear-attention states"),
    ("llama-gqa-tied", dict(batch_invariant=True), "batch invariance"),
])
def test_what_cannot_drop_proposals_is_refused(models, case, kwargs, why):
    with pytest.raises(TiergenError, match=why):
        LLM(models(case), dtype="float32", speculative_config=NGRAM, **kwargs)


@pytest.mark.parametrize("config, why", [
    ({"method": "medusa"}, "method must be one of"),
    ({"num_speculative_tokens": 4}, "needs a method"),
    (ngram(0), "num_speculative_tokens must be an integer from 1 to 64"),
    (ngram(1000), "num_speculative_tokens must be an integer from 1 to 64"),
    ({"method": "draft_model"}, "model names the draft model"),
    ({"method": "ngram", "model": "x"}, "model names the draft model"),
    ({"method": "ngram", "draft": 3}, "unknown keys draft"),
    ('{"method": "ngram",', "is not JSON"),
    ([1, 2], "must be an object"),
])
def test_a_bad_config_says_what_is_wrong(config, why):
    with pytest.raises(TiergenError, match=why):
        SpeculativeConfig.parse(config)


def test_the_config_reads_as_json():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5}') == \
        SpeculativeConfig("ngram", 5)


# ----------------------------------------------------------------------------- draft models

def draft_model(path, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("case, drafter", [
    ("llama-gqa-tied", "itself"),  # its proposals are mostly right: steps keep them all
    ("llama-gqa-tied", "qwen2"),  # a random model of its vocabulary: mostly wrong
    ("deepseek-v3", "itself"),  # a latent cache, drafted by one
    ("mixtral", "llama-gqa-tied"),
])
@pytest.mark.parametrize("where", sorted(POLICIES))
def test_a_draft_models_proposals_give_the_models_own_output(models, tmp_path, case, drafter,
                                                             where):
    """Greedy and seeded sampled rows of different prompt lengths and max_tokens give the
    tokens and log-probabilities of plain decoding: the draft's cache, which follows the
    target's timeline with its holes, stays right through steps that keep all, some or
    none of the proposals, and through rows that finish early and leave."""
    kwargs = POLICIES[where]
    if kwargs.get("policy") == "disk":
        kwargs = dict(policy=Policy(cache=(0, 0), offload_dir=tmp_path / "off"))
    draft = models(case if drafter == "itself" else drafter)
    plain = LLM(models(case), dtype="float32", **kwargs)
    # (fixed lengths, and "auto", whose lengths change from step to step)
    k = "auto" if where == "micro-batches" else 3
    spec = LLM(models(case), dtype="float32", speculative_config=draft_model(draft, k), **kwargs)
    lengths = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    for params in (GREEDY, SAMPLED, [GREEDY, lengths, SAMPLED]):
        want = plain.generate(PROMPTS, params)
        got = spec.generate(PROMPTS, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        stats = spec.last_stats
        assert stats.proposed_tokens > 0
        assert stats.decode_tokens == plain.last_stats.decode_tokens
        for w, g in zip(want, got):
            for a, b, t in zip(w.logprobs or [], g.logprobs or [], w.token_ids):
                assert abs(a[t].logprob - b[t].logprob) < 1e-4
    if drafter == "itself":  # (greedy rows of its own model: a proposal is rarely wrong)
        assert spec.last_stats.accepted_tokens > 0


def test_a_draft_model_of_another_vocabulary_is_refused(models, tmp_path):
    other = tmp_path / "other"
    build("llama-gqa-tied", other, vocab_size=256)
    with pytest.raises(TiergenError, match="another vocabulary"):
        LLM(models("llama-gqa-tied"), dtype="float32", speculative_config=draft_model(other))


def test_a_draft_model_that_cannot_drop_proposals_is_refused(models):
    with pytest.raises(TiergenError, match="the draft model .*sliding window"):
        LLM(models("llama-gqa-tied"), dtype="float32",
            speculative_config=draft_model(models("mistral-window")))


def test_the_draft_models_weights_come_out_of_the_budget(models):
    """What the target may hold is the budget less the draft's weights: a budget that fits
    the target alone with a little room does not fit both."""
    path = models("llama-gqa-tied")
    alone = LLM(path, dtype="float32")
    needs = alone.executor.weight_plan.needs()
    budget = needs["device"] + needs["device"] // 4
    LLM(path, dtype="float32", device_memory=budget)
    with pytest.raises(TiergenError, match="budget"):
        LLM(path, dtype="float32", device_memory=budget, speculative_config=draft_model(path))


@pytest.mark.slow
def test_a_quantised_copy_drafts_the_float_model():
    """The packaged SmolLM2 GGUF drafting its own float (dequantised) self: the output is the
    float model's, and most proposals are kept."""
    plain = LLM("smollm2", dtype="float32", activations="float32", packed=False)
    spec = LLM("smollm2", dtype="float32", activations="float32", packed=False,
               speculative_config=draft_model("smollm2"))
    prompts = ["The capital of France is", "Write a list of three fruits:"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.last_stats.accepted_tokens * 2 > spec.last_stats.proposed_tokens


# ----------------------------------------------------------------------------- "auto" length

def drive(auto: AutoLength, cost, accept: float, steps: int = 200) -> list[int]:
    """The lengths ``auto`` chooses over ``steps`` steps that cost ``cost(k)`` seconds and keep
    each proposal (after kept ones) with chance ``accept``, drawn from a fixed seed."""
    rng = random.Random(0)
    chosen = []
    for _ in range(steps):
        k = auto.choose()
        chosen.append(k)
        auto.timed(k, cost(k))
        if k:
            kept = next((j for j in range(k) if rng.random() > accept), k)
            auto.counted(k, kept)
    return chosen


def test_auto_takes_long_steps_where_checking_costs_what_a_step_costs():
    """An offloaded target: a step streams the weights whatever its length."""
    chosen = drive(AutoLength(16), lambda k: 0.2 + 0.001 * k, accept=0.9)
    assert chosen[:2] == [4, 16]  # the probes
    assert min(chosen[20:]) >= 12


def test_auto_stops_proposing_where_it_does_not_pay_and_tries_again():
    """Checking costs as much per token as decoding and proposals are mostly wrong: plain
    decoding, with a probe of one proposal now and then."""
    chosen = drive(AutoLength(16), lambda k: 0.01 * (1 + k), accept=0.2)
    late = chosen[50:]
    assert late.count(0) > 0.8 * len(late)
    assert 1 in late  # tried again after a pause


def test_auto_picks_a_length_between_where_cost_grows():
    chosen = drive(AutoLength(16), lambda k: 0.01 * (1 + 0.25 * k), accept=0.7)
    assert 2 <= statistics.median(chosen[50:]) <= 6
