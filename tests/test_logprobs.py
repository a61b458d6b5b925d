import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# Log-probabilities, penalties and logit bias: in the sampler, through LLM.generate, and
# through the server. Reference log-probabilities are the log-softmax of LLM.logits on the
# float path (float32 activations), where a batch gives each row the logits it has alone.

import json

import httpx
import openai
import pytest
import torch

from tiergen import LLM, SamplingParams
from tiergen.engine import executor
from tiergen.engine.sampler import Sampler
from tiergen.errors import TiergenError
from tiergen.server import create_app
from live_server import serving

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
def test_logprobs_equal_the_log_softmax_of_the_logits(llm, chunk, monkeypatch):
    """Batched prompts of different lengths and one alone; whole prompts or chunks of 4,
    their logits handed over a position or a few at a time."""
    if chunk:
        monkeypatch.setattr(executor, "POSITION_LOGITS_BYTES", 3 * 4 * llm.config.vocab_size)
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


# ---- the server ------------------------------------------------------------------------------

SERVED = "served"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PENALISED = dict(max_tokens=8, temperature=0, presence_penalty=1.5, frequency_penalty=0.5)


@pytest.fixture(scope="module")
def expected(llm) -> dict:
    """What the server should answer, computed before it starts (its scheduler then owns the
    model): greedy continuations and the reference log-probabilities of their tokens."""
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    chat_ids = llm.chat_prompt(CHAT)
    results = llm.generate(PROMPTS[:2] + [chat_ids], greedy)
    refs = [reference(llm, r.prompt_token_ids + r.token_ids) for r in results]
    penalised = llm.generate(PROMPTS[1], SamplingParams(**PENALISED))[0].text
    return {"results": results, "refs": refs, "penalised": penalised}


@pytest.fixture(scope="module")
def base_url(llm, expected):
    with serving(create_app(llm, [SERVED])) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/{path}", json={"model": SERVED, **body}, timeout=60)


def check_legacy(logprobs: dict, ids: list[int], ref: torch.Tensor, first: int, k: int) -> None:
    """Legacy logprobs of tokens ids[first:], against the reference rows."""
    values = logprobs["token_logprobs"]
    assert len(values) == len(logprobs["tokens"]) == len(ids) - first
    for i, (value, top) in enumerate(zip(values, logprobs["top_logprobs"]), start=first):
        if i == 0:
            assert value is None and top is None
            continue
        assert value == pytest.approx(ref[i - 1, ids[i]].item(), abs=TOL)
        tops = list(top.values())
        assert tops == sorted(tops, reverse=True) and k <= len(tops) <= k + 1
        assert tops[:k] == pytest.approx(ref[i - 1].topk(k).values.tolist(), abs=TOL)
        assert any(abs(v - value) < 1e-6 for v in tops)  # the chosen token is there
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets)


def test_completion_logprobs_with_echo_for_a_batch(base_url, expected):
    results, refs = expected["results"], expected["refs"]
    r = post(base_url, "completions", {"prompt": PROMPTS[:2], "max_tokens": 4, "temperature": 0,
                                       "ignore_eos": True, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    for choice, result, ref in zip(r.json()["choices"], results, refs):
        ids = result.prompt_token_ids + result.token_ids
        assert choice["text"] == result.prompt + result.text
        check_legacy(choice["logprobs"], ids, ref, 0, 2)
    # without echo: the generated tokens only, their offsets counted from the text's start
    r = post(base_url, "completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                       "ignore_eos": True, "logprobs": 0})
    choice, result = r.json()["choices"][0], results[0]
    assert choice["text"] == result.text
    check_legacy(choice["logprobs"], result.prompt_token_ids + result.token_ids, refs[0],
                 len(result.prompt_token_ids), 0)
    assert choice["logprobs"]["text_offset"][0] == 0


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_scoring_as_lm_evaluation_harness_sends_it(base_url, expected, max_tokens):
    """Token-id prompts, echo, logprobs=1, max_tokens 0 or 1 (lm-eval 0.4's local-completions
    sends 1 and drops the last position), and the seed it always sends."""
    results, refs = expected["results"], expected["refs"]
    prompts = [r.prompt_token_ids + r.token_ids for r in results[:2]]
    r = post(base_url, "completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                       "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)
    for choice, ids, ref in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts, refs):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + max_tokens
        check_legacy({k: v[:len(ids)] for k, v in logprobs.items()}, ids, ref, 0, 1)
        assert choice["finish_reason"] == "length"


def test_streamed_logprobs_equal_the_whole_answer(base_url, client):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 2}
    whole = post(base_url, "completions", body).json()["choices"][0]
    pieces = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=60,
                      json={"model": SERVED, **body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            for key, values in (choice["logprobs"] or {}).items():
                pieces[key] += values
    assert text == whole["text"]
    assert pieces == whole["logprobs"]


def test_chat_logprobs(client, expected):
    result, ref = expected["results"][2], expected["refs"][2]
    kwargs = dict(model=SERVED, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                  top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    n = len(result.prompt_token_ids)
    assert len(content) == 4
    for j, (item, token) in enumerate(zip(content, result.token_ids)):
        row = ref[n + j - 1]
        assert item.logprob == pytest.approx(row[token].item(), abs=TOL)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(row.topk(2).values.tolist(),
                                                                       abs=TOL)
    streamed = [item for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs
                for item in chunk.choices[0].logprobs.content]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in content]
    plain = client.chat.completions.create(**{**kwargs, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_penalties_and_logit_bias_through_the_server(client, llm, expected):
    r = client.completions.create(model=SERVED, prompt=PROMPTS[1], **PENALISED)
    assert r.choices[0].text == expected["penalised"]
    first = expected["results"][0].token_ids[0]
    r = client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                  logit_bias={str(first): -100}, logprobs=0)
    assert llm.tokenizer.token_string(first) not in r.choices[0].logprobs.tokens
    r = client.completions.create(model=SERVED, prompt=PROMPTS[0], max_tokens=3, temperature=1.0,
                                  seed=5, logit_bias={"1234": 100}, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [llm.tokenizer.token_string(1234)] * 3


@pytest.mark.parametrize("path, body, param, match", [
    ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs", "between 0 and 20"),
    ("completions", {"prompt": "Hi", "presence_penalty": 3}, "presence_penalty",
     "'presence_penalty' must be between -2 and 2"),
    ("completions", {"prompt": "Hi", "frequency_penalty": -2.5}, "frequency_penalty",
     "between -2 and 2"),
    ("completions", {"prompt": "Hi", "logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("completions", {"prompt": "Hi", "logit_bias": {"99999999": 1}}, "logit_bias",
     "outside the vocabulary"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", "0 only with echo"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "between 0 and 20"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs",
     "needs 'logprobs': true"),
])
def test_bad_values_get_400(base_url, path, body, param, match):
    r = post(base_url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["param"] == param
