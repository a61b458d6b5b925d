import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# Log-probabilities, penalties and logit bias: in the sampler, through LLM.generate, and
# through the server. Reference log-probabilities are the log-softmax of LLM.logits on the
# float path (float32 activations), where a batch gives each row the logits it has alone.

import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from tiergen import LLM, SamplingParams
from tiergen.engine.sampler import Sampler
from tiergen.errors import TiergenError
from tiergen.server import create_app, listen

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived",
           "1, 2, 3,"]
TOL = 1e-4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, dtype="float32", activations="float32")


def reference(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) for every i, as (len(ids), vocab) rows."""
    return torch.log_softmax(llm.logits(ids).float(), dim=-1)


def check_position(entry: dict, token: int, row: torch.Tensor, k: int) -> None:
    """One position's {id: Logprob}: the chosen token's value and rank, and the k best."""
    assert entry[token].logprob == pytest.approx(row[token].item(), abs=TOL)
    assert entry[token].rank == int((row > row[token]).sum()) + 1
    best = row.topk(k)
    top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
    assert [t for _, t, _ in top] == best.indices.tolist()
    assert [v for _, _, v in top] == pytest.approx(best.values.tolist(), abs=TOL)
    assert set(entry) == {token, *best.indices.tolist()}


def check_result(llm: LLM, result, k: int, prompt_k: int | None) -> None:
    ids = result.prompt_token_ids + result.token_ids
    ref = reference(llm, ids)
    n = len(result.prompt_token_ids)
    assert len(result.logprobs) == len(result.token_ids)
    for j, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        check_position(entry, token, ref[n + j - 1], k)
        assert entry[token].decoded_token == llm.tokenizer.token_string(token)
    if prompt_k is None:
        assert result.prompt_logprobs is None
        return
    assert len(result.prompt_logprobs) == n and result.prompt_logprobs[0] is None
    for i in range(1, n):
        check_position(result.prompt_logprobs[i], ids[i], ref[i - 1], prompt_k)


@pytest.mark.parametrize("chunk", [None, 4])
def test_logprobs_equal_the_log_softmax_of_the_logits(llm, chunk):
    """Batched prompts of different lengths and one alone; whole prompts or chunks of 4."""
    saved, llm.prefill_chunk_size = llm.prefill_chunk_size, chunk
    try:
        params = [SamplingParams(max_tokens=5, temperature=0, logprobs=3, prompt_logprobs=2),
                  SamplingParams(max_tokens=4, temperature=0.8, seed=1, logprobs=0),
                  SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=0)]
        results = llm.generate(PROMPTS, params)
        alone = llm.generate(PROMPTS[0], params[0])[0]
    finally:
        llm.prefill_chunk_size = saved
    for result, p in zip(results + [alone], params + params[:1]):
        check_result(llm, result, p.logprobs, p.prompt_logprobs)
    assert alone.token_ids == results[0].token_ids


def test_rows_that_do_not_ask_get_none(llm):
    results = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, temperature=0),
                                         SamplingParams(max_tokens=2, temperature=0, logprobs=2)])
    assert results[0].logprobs is None and results[0].prompt_logprobs is None
    assert len(results[1].logprobs) == 2


def test_max_tokens_0_scores_the_prompt_only(llm):
    result = llm.generate(PROMPTS[1], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert result.token_ids == [] and result.text == "" and result.finish_reason == "length"
    ref = reference(llm, result.prompt_token_ids)
    got = [e[t].logprob for e, t in zip(result.prompt_logprobs[1:], result.prompt_token_ids[1:])]
    want = ref[range(len(got)), result.prompt_token_ids[1:]].tolist()
    assert got == pytest.approx(want, abs=TOL)


def test_logit_bias_bans_and_forces_tokens(llm):
    greedy = SamplingParams(max_tokens=3, temperature=0)
    first = llm.generate(PROMPTS[0], greedy)[0].token_ids[0]
    banned = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0,
                                                     logit_bias={first: -100}))[0]
    assert first not in banned.token_ids
    forced = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.7, seed=3,
                                                     logit_bias={1234: 100}))[0]
    assert forced.token_ids == [1234] * 3
    with pytest.raises(TiergenError, match="outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10 ** 7: 1}))


@pytest.mark.parametrize("bad, match", [
    (dict(logprobs=21), "logprobs must be an integer from 0 to 20"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be an integer from 0 to 20"),
    (dict(presence_penalty=3), "presence_penalty must be between -2 and 2"),
    (dict(frequency_penalty=-2.5), "frequency_penalty must be between -2 and 2"),
    (dict(logit_bias={5: 101}), "logit_bias must map token ids"),
    (dict(max_tokens=-1), "max_tokens must be an integer >= 0"),
])
def test_bad_sampling_params(bad, match):
    with pytest.raises(TiergenError, match=match):
        SamplingParams(**bad)


# ---- the sampler's adjustments, against a direct computation -------------------------------

def test_penalties_and_bias_adjust_the_logits_as_defined():
    vocab = 7
    params = [SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25,
                             logit_bias={3: 2.0}),
              SamplingParams(temperature=0),  # asks for nothing: unchanged
              SamplingParams(temperature=0, repetition_penalty=2.0, frequency_penalty=-1.0)]
    prompts = [[1, 1], [2], [4, 5]]
    sampler = Sampler(params, prompts, vocab, torch.device("cpu"))
    generated = [[0, 0, 6], [1, 2, 3], [4, 0, 0]]
    for step in range(3):  # logits that leave no choice: these tokens are generated
        forced = torch.full((3, vocab), -50.0)
        forced[range(3), [g[step] for g in generated]] = 50.0
        assert sampler(forced).tolist() == [g[step] for g in generated]
    logits = torch.linspace(-3, 3, vocab).repeat(3, 1)
    got = sampler.adjusted(logits)
    want = logits.clone()
    for row, (p, gen) in enumerate(zip(params, generated)):
        counts = torch.bincount(torch.tensor(gen), minlength=vocab).float()
        want[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        for token, bias in (p.logit_bias or {}).items():
            want[row, token] += bias
    seen = set(prompts[2]) | set(generated[2])
    for t in seen:  # repetition penalty: on the logit as it comes, before the others
        x = logits[2, t]
        want[2, t] += (x / 2.0 if x > 0 else x * 2.0) - x
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[1], logits[1])


def test_a_batch_that_asks_for_nothing_keeps_no_state():
    sampler = Sampler([SamplingParams(), SamplingParams(temperature=0)], [[1], [2]], 9,
                      torch.device("cpu"))
    assert sampler.state == {}
    logits = torch.randn(2, 9)
    assert sampler.adjusted(logits) is logits
    assert sampler.logprobs(logits, sampler(logits)) is None


def test_merging_samplers_keeps_each_rows_state():
    cpu = torch.device("cpu")
    a = Sampler([SamplingParams(presence_penalty=1.0)], [[0]], 5, cpu)
    b = Sampler([SamplingParams(logit_bias={2: -5.0})], [[0]], 5, cpu)
    a(torch.tensor([[0.0, 9.0, 0.0, 0.0, 0.0]]))  # row 0 generates token 1
    a.extend(b)
    got = a.adjusted(torch.zeros(2, 5))
    assert got.tolist() == [[0, -1, 0, 0, 0], [0, 0, -5, 0, 0]]
    a.keep_rows([1])
    assert a.adjusted(torch.zeros(1, 5)).tolist() == [[0, 0, -5, 0, 0]]
