import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# tiergen run-batch: OpenAI's batch format through the offline engine. Each result's body must
# be what the server answers for the same request body (ids and timestamps aside); results are
# written group by group, and a second run resumes where the first stopped.

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tiergen import LLM, TiergenError, cli
from tiergen.batch import read_input, run_batch
from tiergen.server import create_app

MODEL = "smollm2"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

REQUESTS = [
    (COMPLETIONS, {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10,
                   "temperature": 0}),
    (COMPLETIONS, {"model": MODEL, "prompt": ["Once upon a time", [504, 3458, 314]], "n": 2,
                   "max_tokens": 6, "temperature": 0}),
    (COMPLETIONS, {"model": MODEL, "prompt": "Count: one, two,", "stop": [","],
                   "temperature": 0}),  # the default max_tokens, a stop string
    (COMPLETIONS, {"model": MODEL, "prompt": "Roses are red,", "max_tokens": 5,
                   "temperature": 0.9, "seed": 3}),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0}),
    (CHAT, {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "What is 2 + 2?"}],
            "max_completion_tokens": 12, "temperature": 0}),
    # requests the server refuses
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "max_tokens": 0}),
    (COMPLETIONS, {"model": "gpt-4", "prompt": "Hi"}),
    (CHAT, {"model": MODEL, "messages": []}),
]


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(text + "\n" for text in lines), encoding="utf-8")
    return path


def read_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(t) for t in text.splitlines()]


def without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.fixture(scope="module")
def llm() -> LLM:
    # the float path in float32, as test_server: the server's batches and run-batch's groups
    # then give the same greedy tokens
    return LLM(MODEL, dtype="float32", activations="float32")


@pytest.mark.slow
def test_results_equal_the_servers_answers(llm, tmp_path):
    lines = [line(f"req-{i}", url, body) for i, (url, body) in enumerate(REQUESTS)]
    lines[3:3] = ["{not json", json.dumps({"custom_id": "get", "method": "GET", "url": COMPLETIONS,
                                           "body": {}}),
                  line("stream", COMPLETIONS, {"model": MODEL, "prompt": "Hi", "stream": True}),
                  line("embed", "/v1/embeddings", {"model": MODEL, "input": "Hi"})]
    source = write_lines(tmp_path / "requests.jsonl", lines)
    output = tmp_path / "results.jsonl"
    summary = run_batch(llm, read_input(source), output, model_names=[MODEL],
                        default_max_tokens=8, progress=False)
    records = read_records(output)
    assert (summary.total, summary.ok, summary.failed) == (13, 6, 7)
    assert len(records) == 13
    for r in records:
        assert set(r) == {"id", "custom_id", "response", "error"}
    by_id = {r["custom_id"]: r for r in records}

    malformed = by_id[None]
    assert malformed["response"] is None
    assert malformed["error"]["code"] == "invalid_json_line" and malformed["error"]["line"] == 4
    assert by_id["get"]["error"]["code"] == "invalid_method"
    assert by_id["embed"]["error"]["code"] == "invalid_url"
    stream = by_id["stream"]["response"]
    assert stream["status_code"] == 400 and stream["body"]["error"]["param"] == "stream"

    with TestClient(create_app(llm, [MODEL], default_max_tokens=8)) as http:
        for i, (url, body) in enumerate(REQUESTS):
            answer = http.post(url, json=body)
            got = by_id[f"req-{i}"]
            assert got["error"] is None
            assert got["response"]["status_code"] == answer.status_code, body
            assert got["response"]["request_id"].startswith("req_")
            assert without_ids(got["response"]["body"]) == without_ids(answer.json()), body
    assert by_id["req-7"]["response"]["status_code"] == 404


LOGPROB_REQUESTS = [
    (COMPLETIONS, {"model": MODEL, "prompt": ["The capital of France is", "1, 2, 3,"],
                   "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2,
                   "echo": True}),
    (COMPLETIONS, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 0, "echo": True,
                   "logprobs": 1}),  # scoring the prompt only, as lm-evaluation-harness asks
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
]


def assert_close(got, want, where: str = "body") -> None:
    """The same JSON, numbers within 1e-4 (log-probabilities from differently shaped batches)."""
    if isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, abs=1e-4), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_logprobs_and_echo_equal_the_servers_answers(llm, tmp_path):
    source = write_lines(tmp_path / "requests.jsonl", [
        line(f"lp-{i}", url, body) for i, (url, body) in enumerate(LOGPROB_REQUESTS)])
    output = tmp_path / "results.jsonl"
    summary = run_batch(llm, read_input(source), output, model_names=[MODEL], progress=False)
    assert (summary.ok, summary.failed) == (3, 0)
    by_id = {r["custom_id"]: r["response"] for r in read_records(output)}

    with TestClient(create_app(llm, [MODEL])) as http:
        for i, (url, body) in enumerate(LOGPROB_REQUESTS):
            answer = http.post(url, json=body)
            assert answer.status_code == 200, answer.text
            got = by_id[f"lp-{i}"]
            assert got["status_code"] == 200
            assert_close(without_ids(got["body"]), without_ids(answer.json()))
    completion, scored, chat = (by_id[f"lp-{i}"]["body"] for i in range(3))
    for choice, prompt in zip(completion["choices"], LOGPROB_REQUESTS[0][1]["prompt"]):
        assert choice["text"].startswith(prompt)
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) > 4
    assert scored["usage"]["completion_tokens"] == 0
    assert scored["choices"][0]["text"] == "Once upon a time"
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(item["top_logprobs"]) == 2 for item in content)


def test_resume_computes_only_the_missing_ids(llm, tmp_path, monkeypatch):
    prompts = ["Hello", "The sky is", "One, two,", "A cat", "Paris is", "Water is"]
    source = write_lines(tmp_path / "requests.jsonl", [
        line(f"r{i}", COMPLETIONS, {"model": MODEL, "prompt": p, "max_tokens": 4,
                                    "temperature": 0})
        for i, p in enumerate(prompts)] + ["[1, 2]"])
    done = [json.dumps({"id": f"batch_req_{i}", "custom_id": f"r{i}", "error": None,
                        "response": {"status_code": 200, "request_id": "x", "body": {"kept": i}}})
            for i in (0, 3)]
    cut = json.dumps({"id": "batch_req_1", "custom_id": "r1", "response": None, "error": None})
    output = tmp_path / "results.jsonl"
    output.write_text(done[0] + "\n" + done[1] + "\n" + cut[:25], encoding="utf-8")

    ran = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda p, params: ran.extend(p) or generate(p, params))
    summary = run_batch(llm, read_input(source), output, model_names=[MODEL], progress=False)

    assert (summary.skipped, summary.ok, summary.failed) == (2, 4, 1)
    assert sorted(ran) == sorted(llm.encode(prompts[i]) for i in (1, 2, 4, 5))
    records = read_records(output)
    assert [json.dumps(r) for r in records[:2]] == done  # untouched
    assert sorted(str(r["custom_id"]) for r in records) == ["None", "r0", "r1", "r2", "r3", "r4",
                                                            "r5"]
    assert records[2]["error"] == {"code": "invalid_json_line",
                                   "message": "line 7 is not a JSON object", "line": 7}

    ran.clear()  # a third run has nothing left to do, the id-less line included
    summary = run_batch(llm, read_input(source), output, model_names=[MODEL], progress=False)
    assert (summary.skipped, summary.ok, summary.failed, ran) == (7, 0, 0, [])
    assert len(read_records(output)) == 7


def test_an_interrupted_run_keeps_every_finished_group(llm, tmp_path, monkeypatch):
    source = write_lines(tmp_path / "requests.jsonl", [
        line(f"r{i}", COMPLETIONS, {"model": MODEL, "prompt": "word " * (i + 1), "max_tokens": 2,
                                    "temperature": 0}) for i in range(4)])
    output = tmp_path / "results.jsonl"
    monkeypatch.setattr(llm, "micro_batch", 1)  # a group per request
    calls = []
    generate = llm.generate

    def interrupted(prompts, params):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C while the third group runs
        return generate(prompts, params)

    monkeypatch.setattr(llm, "generate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_batch(llm, read_input(source), output, model_names=[MODEL], progress=False)
    # the longest prompts run first, one group at a time
    assert [r["custom_id"] for r in read_records(output)] == ["r3", "r2"]
    monkeypatch.setattr(llm, "generate", generate)
    summary = run_batch(llm, read_input(source), output, model_names=[MODEL], progress=False)
    assert (summary.skipped, summary.ok) == (2, 2)
    assert [r["custom_id"] for r in read_records(output)] == ["r3", "r2", "r1", "r0"]


def test_duplicate_ids_and_a_damaged_output_stop_the_run(llm, tmp_path):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    source = write_lines(tmp_path / "requests.jsonl",
                         [line("a", COMPLETIONS, body), "", line("b", COMPLETIONS, body),
                          line("a", COMPLETIONS, body)])
    with pytest.raises(TiergenError, match="custom_id 'a' is on lines 1 and 4"):
        read_input(source)
    source = write_lines(tmp_path / "requests.jsonl", [line("a", COMPLETIONS, body)])
    output = write_lines(tmp_path / "results.jsonl", ["garbage", json.dumps({"custom_id": "x"})])
    with pytest.raises(TiergenError, match="line 1 of .* is not a result record"):
        run_batch(llm, read_input(source), output, progress=False)


def test_run_batch_command(llm, tmp_path, capsys):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0}
    source = write_lines(tmp_path / "requests.jsonl", [line("only", COMPLETIONS, body)])
    output = tmp_path / "results.jsonl"
    argv = ["run-batch", "-i", str(source), "-o", str(output), "--exact", "--dtype", "float32"]
    assert cli.main(argv) == 0
    [got] = read_records(output)
    want = llm.generate([body["prompt"]], llm_params(body))[0].text
    assert got["response"]["body"]["choices"][0]["text"] == want
    assert "1 requests: 1 answered now, 0 with an error, 0 already in" in capsys.readouterr().err

    write_lines(source, [line("x", COMPLETIONS, body), line("x", COMPLETIONS, body)])
    assert cli.main(argv) == 2
    assert "custom_id 'x' is on lines 1 and 2" in capsys.readouterr().err


def llm_params(body: dict):
    from tiergen import SamplingParams

    return SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"])
