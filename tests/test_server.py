import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# The HTTP server: the real app on uvicorn in a thread on a free loopback port, driven with the
# official openai client (completions and chat, streaming or not) and raw httpx for bad input.
# Expected outputs come from LLM.generate, computed before the server starts (the server's
# scheduler owns the model while it runs).

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tiergen import LLM, SamplingParams
from tiergen.server import create_app
from live_server import serving

MODEL = "smollm2"
PARIS = "The capital of France is"
STORY = "Once upon a time"
QUESTIONS = [f"Question {i}: what is {i} plus {2 * i}? Answer:" for i in range(8)]
CHATS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three."]


def concurrent_cases() -> list[dict]:
    """64 streaming requests: completions and chats, greedy and seeded, of different lengths."""
    cases = []
    for i in range(64):
        chat = i % 3 == 2
        cases.append({"chat": chat, "text": CHATS[i % len(CHATS)] if chat else QUESTIONS[i % 8],
                      "max_tokens": 3 + i % 9, "temperature": 0.0 if i % 2 == 0 else 0.8,
                      "seed": None if i % 2 == 0 else 1000 + i})
    return cases


CASES = concurrent_cases()
LONG = " ".join(f"Line {i}: the {('red', 'green', 'blue')[i % 3]} box holds {i * 37 % 101} stones."
                for i in range(110))  # about 1,500 tokens
MIXED = QUESTIONS[:4]  # streams decoding while LONG arrives


def params_of(case: dict) -> SamplingParams:
    return SamplingParams(max_tokens=case["max_tokens"], temperature=case["temperature"],
                          seed=case["seed"])


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 and the float path: in bfloat16 the logits move with the batch a request shares
    # (by ~1e-2), enough to flip an occasional seeded sample or greedy token between the
    # server's batches and generate()'s; on the integer path a float rounding that differs
    # with the batch can move an activation across an 8-bit step, which does the same.
    return LLM(MODEL, dtype="float32", activations="float32")


@pytest.fixture(scope="module")
def expected(llm) -> dict:
    """Every output the tests compare with, from LLM.generate in one batch."""
    greedy = SamplingParams(max_tokens=12, temperature=0)
    prompts = [PARIS, llm.encode(PARIS), llm.chat_prompt([{"role": "user", "content": CHATS[0]}])]
    params = [greedy] * 3
    for case in CASES:
        text = case["text"]
        prompts.append(llm.chat_prompt([{"role": "user", "content": text}]) if case["chat"] else text)
        params.append(params_of(case))
    for seed in (7, 8):
        prompts.append(STORY)
        params.append(SamplingParams(max_tokens=6, temperature=1.0, seed=seed))
    texts = [r.text for r in llm.generate(prompts, params)]
    mixed = [r.text for r in llm.generate(MIXED + [LONG], [greedy_n(24)] * 4 + [greedy_n(4)])]
    return {"paris": texts[0], "paris_ids": texts[1], "chat": texts[2],
            "cases": texts[3:3 + len(CASES)], "story_seeds": texts[3 + len(CASES):5 + len(CASES)],
            "mixed": mixed[:4], "long": mixed[4]}


def greedy_n(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def app(llm, expected):
    return create_app(llm, [MODEL], default_max_tokens=8)


@pytest.fixture(scope="module")
def base_url(app):
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics").text
    return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.M)}


# ---- the happy paths ---------------------------------------------------------------------------

def test_models_and_health(base_url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(base_url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_equals_generate(client, expected):
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=12, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == expected["paris"]
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_request_asks_for_speculative_decoding_in_extra_body(base_url, client, llm):
    """On a server without a speculative_config, a request's num_speculative_tokens decodes
    it by prompt lookup: the same text as without, and /metrics counts the checking steps."""
    prompt = "Copy the list: red, green, blue, red, green, blue, red, green, blue. Copy:"
    want = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0].text
    before = metrics(base_url)["tiergen_speculative_checking_steps_total"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"num_speculative_tokens": 4})
    assert r.choices[0].text == want
    assert metrics(base_url)["tiergen_speculative_checking_steps_total"] > before


def test_completion_of_token_ids_and_of_a_batch(client, llm, expected):
    ids = llm.encode(PARIS)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected["paris_ids"]
    r = client.completions.create(model=MODEL, prompt=[PARIS, ids], max_tokens=12, temperature=0,
                                  n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expected["paris"]] * 2 + [expected["paris_ids"]] * 2
    assert r.usage.prompt_tokens == 2 * len(ids)


def test_streamed_completion_equals_generate(client, expected):
    chunks = list(client.completions.create(model=MODEL, prompt=PARIS, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected["paris"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens >= 1


def test_continuous_usage_counts_every_token_as_it_streams(client, expected):
    chunks = list(client.completions.create(
        model=MODEL, prompt=PARIS, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[0] >= 1
    assert counts[-1] == chunks[-1].usage.completion_tokens  # the last chunk: the total
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["paris"]


def test_chat_streamed_and_not(client, expected):
    messages = [{"role": "user", "content": CHATS[0]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected["chat"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seeds_stop_and_default_max_tokens(client, expected):
    r = client.completions.create(model=MODEL, prompt=STORY, max_tokens=6, temperature=1.0,
                                  seed=7, n=2)
    assert [c.text for c in r.choices] == expected["story_seeds"]  # choice i gets seed + i
    stop = expected["paris"][3:6]
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=12, temperature=0,
                                  stop=[stop, "never"])
    assert r.choices[0].text == expected["paris"][:expected["paris"].index(stop)]
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt=STORY, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8  # the server's default_max_tokens


# ---- many at once ----------------------------------------------------------------------------

async def _stream_case(client: openai.AsyncOpenAI, case: dict) -> tuple[str, str]:
    common = dict(model=MODEL, max_tokens=case["max_tokens"], temperature=case["temperature"],
                  seed=case["seed"], stream=True)
    pieces, reason = [], None
    if case["chat"]:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": case["text"]}], **common)
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
    else:
        async for chunk in await client.completions.create(prompt=case["text"], **common):
            pieces.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
    return "".join(pieces), reason


def test_64_concurrent_streams_are_batched_and_correct(base_url, expected):
    before = metrics(base_url)

    async def run() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*[_stream_case(client, c) for c in CASES])

    results = asyncio.run(run())
    assert [text for text, _ in results] == expected["cases"]
    assert all(reason in ("stop", "length") for _, reason in results)
    after = metrics(base_url)
    assert after["tiergen_requests_finished_total"] - before["tiergen_requests_finished_total"] == 64
    batched = after["tiergen_batch_size_count"] - after['tiergen_batch_size_bucket{le="1"}']
    assert batched > before["tiergen_batch_size_count"] - before['tiergen_batch_size_bucket{le="1"}']
    assert after["tiergen_running_sequences"] == 0 and after["tiergen_queue_depth"] == 0


def test_a_long_prompt_arriving_while_streams_decode(base_url, expected):
    """Mixed load: a long prompt sent while four streams decode goes in chunk by chunk beside
    their steps; the streams keep producing tokens meanwhile, and every output equals
    LLM.generate's."""
    arrivals: list[float] = []

    async def stream(client: openai.AsyncOpenAI, prompt: str, n: int, log: bool) -> tuple[str, float]:
        pieces, first = [], 0.0
        async for chunk in await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                pieces.append(chunk.choices[0].text)
                first = first or time.perf_counter()
                if log:
                    arrivals.append(time.perf_counter())
        return "".join(pieces), first

    async def run() -> tuple[list[tuple[str, float]], tuple[str, float], float]:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as client:
            streams = [asyncio.create_task(stream(client, p, 24, True)) for p in MIXED]
            while len(arrivals) < 8:
                await asyncio.sleep(0.005)
            sent = time.perf_counter()
            long = await stream(client, LONG, 4, False)
            return await asyncio.gather(*streams), long, sent

    streams, (long_text, long_first), sent = asyncio.run(run())
    assert [text for text, _ in streams] == expected["mixed"]
    assert long_text == expected["long"]
    assert sum(sent < t < long_first for t in arrivals) >= 8  # not frozen by the prefill


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_has_its_request_cancelled(base_url, client, stream):
    cancelled = metrics(base_url)["tiergen_requests_cancelled_total"]
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 4000, "stream": stream,
            "ignore_eos": True}
    if stream:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base_url + "/v1/completions", json=body, timeout=1)
    deadline = time.monotonic() + 20
    while True:
        m = metrics(base_url)
        if m["tiergen_requests_cancelled_total"] > cancelled and m["tiergen_running_sequences"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    r = client.completions.create(model=MODEL, prompt=PARIS, max_tokens=2, temperature=0)
    assert r.choices[0].text


def test_metrics_are_prometheus_text(base_url, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt=PARIS, max_tokens=2)
    r = httpx.get(base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}  # a scraper's parser
    assert families["tiergen_requests"].type == "counter"
    assert families["tiergen_queue_depth"].type == "gauge"
    for name in ("tiergen_batch_size", "tiergen_request_latency_seconds"):
        assert families[name].type == "histogram"
        counts = [s.value for s in families[name].samples if s.name.endswith("_bucket")]
        assert counts == sorted(counts) and counts[-1] >= 1  # cumulative, +Inf last
    m = metrics(base_url)
    for name in ("tiergen_requests_total", "tiergen_generated_tokens_total", "tiergen_queue_depth",
                 "tiergen_running_sequences", 'tiergen_batch_size_bucket{le="+Inf"}',
                 "tiergen_request_latency_seconds_count", "tiergen_time_to_first_token_seconds_sum"):
        assert name in m, name
    assert m["tiergen_request_latency_seconds_count"] >= 1
    assert "# TYPE tiergen_request_latency_seconds histogram" in r.text


# ---- tokens ----------------------------------------------------------------------------------

def test_tokenize_and_detokenize_round_trip(base_url, llm):
    r = httpx.post(base_url + "/tokenize", json={"model": MODEL, "prompt": PARIS})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": llm.encode(PARIS), "count": 5,
                        "max_model_len": llm.config.context_length}
    r = httpx.post(base_url + "/detokenize", json={"tokens": r.json()["tokens"]})
    assert r.json() == {"prompt": PARIS}

    messages = [{"role": "user", "content": CHATS[0]}]
    tokens = httpx.post(base_url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert tokens == llm.chat_prompt(messages)  # what the chat endpoint runs
    shorter = httpx.post(base_url + "/tokenize", json={"messages": messages,
                                                       "add_generation_prompt": False}).json()
    assert shorter["tokens"] == tokens[:shorter["count"]] and shorter["count"] < len(tokens)
    text = httpx.post(base_url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == llm.tokenizer.apply_chat_template(messages)  # special tokens kept


def test_tokenizer_info(base_url, llm):
    """vLLM's /tokenizer_info: with /tokenize and /detokenize, what lm-evaluation-harness's
    remote tokenizer reads (it tokenizes through the server when this route answers)."""
    r = httpx.get(base_url + "/tokenizer_info")
    assert r.status_code == 200, r.text
    info, tokenizer = r.json(), llm.tokenizer
    assert info["eos_token"] == "<|im_end|>"
    eos = httpx.post(base_url + "/tokenize", json={"prompt": info["eos_token"],
                                                   "add_special_tokens": False}).json()["tokens"]
    assert eos == tokenizer.eos_token_ids[:1]
    assert info["bos_token"] == tokenizer.token_text(tokenizer.bos_token_id)
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == llm.config.context_length


@pytest.mark.parametrize("path, body, status, param, match", [
    ("/tokenize", {}, 400, "prompt", "give either 'prompt' (a string) or 'messages'"),
    ("/tokenize", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, 400,
     "messages", "not both"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "'prompt' must be a string"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "no"}, 400, "add_special_tokens",
     "valid boolean"),
    ("/tokenize", {"messages": []}, 400, "messages", "'messages' is empty"),
    ("/tokenize", {"model": "gpt-4", "prompt": "Hi"}, 404, "model", "does not exist"),
    ("/tokenize", b"{not json", 400, None, "not valid JSON"),
    ("/detokenize", {}, 400, "tokens", "'tokens' is required"),
    ("/detokenize", {"tokens": [1, "a"]}, 400, "tokens[1]", "valid integer"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens[1]", "is no token id"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", "ids 0..49151"),
])
def test_bad_token_requests_get_an_openai_error(base_url, path, body, status, param, match):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(base_url + path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["param"] == param


# ---- bad input -------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.mark.parametrize("path, body, status, param, match", [
    (COMPLETIONS, b"{not json", 400, None, "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", 400, None, "must be a JSON object"),
    (COMPLETIONS, {"prompt": "Hi"}, 400, "model", "'model' is required"),
    (COMPLETIONS, {**OK, "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    (COMPLETIONS, {**OK, "max_tokens": 0}, 400, "max_tokens", "must be a positive integer"),
    (COMPLETIONS, {**OK, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    (COMPLETIONS, {**OK, "max_tokens": 9000}, 400, "max_tokens", "beyond the model's context"),
    (COMPLETIONS, {**OK, "prompt": "word " * 8200}, 400, "prompt", "the prompt is too long"),
    (COMPLETIONS, {**OK, "prompt": "word " * 8000, "max_tokens": 500}, 400, "max_tokens",
     "exceed the model's context"),
    (COMPLETIONS, {**OK, "prompt": 5}, 400, "prompt", "'prompt' must be a string"),
    (COMPLETIONS, {**OK, "prompt": []}, 400, "prompt", "'prompt' is empty"),
    (COMPLETIONS, {**OK, "prompt": [10 ** 9]}, 400, "prompt", "outside the vocabulary"),
    (COMPLETIONS, {**OK, "temperature": -1}, 400, "temperature", "'temperature' must be between 0 and 2"),
    (COMPLETIONS, {**OK, "temperature": 3}, 400, "temperature", "'temperature' must be between 0 and 2"),
    (COMPLETIONS, {**OK, "top_p": 1.5}, 400, "top_p", "'top_p' must be between 0 and 1"),
    (COMPLETIONS, {**OK, "presence_penalty": 2.5}, 400, "presence_penalty",
     "'presence_penalty' must be between -2 and 2"),
    (COMPLETIONS, {**OK, "frequency_penalty": -3}, 400, "frequency_penalty",
     "'frequency_penalty' must be between -2 and 2"),
    (COMPLETIONS, {**OK, "logit_bias": {"5": 150}}, 400, "logit_bias", "between -100 and 100"),
    (COMPLETIONS, {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4 sequences"),
    (COMPLETIONS, {**OK, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    (COMPLETIONS, {**OK, "stop": [""]}, 400, "stop", "stop strings must be non-empty"),
    (COMPLETIONS, {**OK, "stop": 3}, 400, "stop", "'stop' must be a string"),
    (COMPLETIONS, {**OK, "n": 0}, 400, "n", "'n' must be between"),
    (COMPLETIONS, {**OK, "logprobs": 21}, 400, "logprobs", "between 0 and 20"),
    (COMPLETIONS, {**OK, "stream": "yes"}, 400, "stream", "valid boolean"),
    (COMPLETIONS, {**OK, "num_speculative_tokens": -1}, 400, "num_speculative_tokens",
     "from 0 (off) to 64"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages", "'messages' is empty"),
    (CHAT, {"model": MODEL}, 400, "messages", "'messages' is required"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages[0]",
     "each message must be"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0]", "only text is supported"),
    (CHAT, {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]}, 400,
     "messages[0].role", "must be one of system, user, assistant"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"},
                                         {"role": "", "content": "Hi"}]}, 400,
     "messages[1].role", "must be one of"),
])
def test_bad_input_gets_an_openai_error(base_url, path, body, status, param, match):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(base_url + path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert match in error["message"]
    assert error["param"] == param
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_oversized_body_unknown_route_and_method(base_url):
    big = json.dumps({**OK, "prompt": "a" * (2 << 20)}).encode()
    r = httpx.post(base_url + COMPLETIONS, content=big)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    r = httpx.post(base_url + COMPLETIONS, content=iter([big[:600_000], big[600_000:]]))  # chunked
    assert r.status_code == 413
    assert httpx.get(base_url + "/v2/nothing").json()["error"]["message"] == "no route GET /v2/nothing"
    assert httpx.get(base_url + COMPLETIONS).status_code == 405


def test_queue_full_is_429_and_the_server_keeps_serving(app, base_url, client):
    scheduler = app.state.server.scheduler
    scheduler.max_queue = 0
    try:
        r = httpx.post(base_url + COMPLETIONS, json=OK)
    finally:
        scheduler.max_queue = 256
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "queue_full"
    assert client.completions.create(model=MODEL, prompt=PARIS, max_tokens=2).choices[0].text


def test_a_developer_message_is_a_system_message(client, llm):
    messages = [{"role": "developer", "content": "Answer in one word."},
                {"role": "user", "content": CHATS[1]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    system = [{**messages[0], "role": "system"}, messages[1]]
    want = llm.generate([llm.chat_prompt(system)], SamplingParams(max_tokens=4, temperature=0))
    assert r.choices[0].message.content == want[0].text


def test_a_role_the_template_names_is_accepted():
    from tiergen.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model=MODEL, messages=[{"role": "tool", "content": "42"}])
    assert body.conversation("{% if m.role == 'tool' %}...{% endif %}") == \
        [{"role": "tool", "content": "42"}]
    with pytest.raises(Exception, match="must be one of"):
        body.conversation("{{ messages }}")


def test_api_key(llm):
    """With a key, every /v1/ route needs it as a bearer token (401 in OpenAI's shape otherwise);
    /health and /metrics stay open. The scheduler is not started: no route here reaches it."""
    from starlette.testclient import TestClient

    http = TestClient(create_app(llm, [MODEL], api_key="s3cret"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401, headers
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert http.post(COMPLETIONS, json=OK, headers=headers).status_code == 401
        assert http.post("/tokenize", json={"prompt": "Hi"}, headers=headers).status_code == 401
        assert http.get("/tokenizer_info", headers=headers).status_code == 401
    assert "Authorization: Bearer" in http.get("/v1/models").json()["error"]["message"]
    assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200


def test_queue_timeout_is_503(app, base_url, client):
    """A request that cannot be admitted within the queue timeout gets a 503, streamed or not;
    the request that held the place finishes normally."""
    scheduler = app.state.server.scheduler
    running = scheduler.max_running
    scheduler.max_running, scheduler.queue_timeout = 1, 0.2
    try:
        with httpx.stream("POST", base_url + COMPLETIONS, timeout=60, json={
                **OK, "prompt": STORY, "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)  # the long request runs
            for stream in (False, True):
                late = httpx.post(base_url + COMPLETIONS, json={**OK, "stream": stream}, timeout=60)
                assert late.status_code == 503, late.text
                assert late.json()["error"]["code"] == "queue_timeout"
            assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        scheduler.max_running, scheduler.queue_timeout = running, None
    assert client.completions.create(model=MODEL, prompt=PARIS, max_tokens=2).choices[0].text


# ---- a real process ----------------------------------------------------------------------------

def test_serve_command_stops_cleanly_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "tiergen.cli", "serve", "--port", "0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        url = re.search(r"http://\S+", line).group(0)
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": MODEL, "prompt": STORY, "max_tokens": 40, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            streamed = [line for line in lines if line]
        assert streamed[-1] == "data: [DONE]"  # the request in flight finished first
        finished = time.monotonic()
        _, err = proc.communicate(timeout=30)
        # and then the process exits at once, not after the 10 s grace period
        assert time.monotonic() - finished < 5
    finally:
        proc.kill()
    assert proc.returncode in (0, -signal.SIGTERM), err
    assert "Traceback" not in err and "error" not in err.lower(), err
