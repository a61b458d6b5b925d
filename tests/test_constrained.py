import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# Constrained output on the packaged SmolLM2: JSON schemas, json_object, regular expressions
# and Lark grammars through LLM.generate, and response_format through the server with the
# official openai client.

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tiergen import LLM, SamplingParams
from tiergen.engine.constraints import Constraint
from tiergen.errors import TiergenError
from tiergen.server import create_app
from live_server import serving

MODEL = "smollm2"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "Berlin", "Rome"]}}}
FREE = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32 on the float path, so that a row's logits do not move with its batch
    return LLM(MODEL, dtype="float32", activations="float32")


def ask(llm: LLM, text: str) -> str:
    return llm.chat_prompt([{"role": "user", "content": text}])


def test_schema_output_validates_greedy_and_sampled_beside_a_free_row(llm):
    prompt = ask(llm, "Describe a person as JSON: Bob, 42, lives in Rome.")
    free = SamplingParams(max_tokens=16, temperature=0)
    alone = llm.generate([FREE], [free])[0]
    constrained = [SamplingParams(max_tokens=60, temperature=0, json_schema=PERSON)] + [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, json_schema=json.dumps(PERSON))
        for s in range(3)]
    results = llm.generate([prompt] * 4 + [FREE], constrained + [free])
    for r in results[:4]:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), PERSON)
    assert results[4].text == alone.text and results[4].token_ids == alone.token_ids


def test_json_object_regex_and_grammar(llm):
    prompt = ask(llm, "Give me a phone number.")
    lark = 'start: "yes" | "no"'
    # \d would take any Unicode digit, as Python's re does
    results = llm.generate([ask(llm, "Say hello as a JSON object."), prompt,
                            ask(llm, "Is water wet?")], [
        SamplingParams(max_tokens=60, temperature=0, json_schema={"type": "object"}),
        SamplingParams(max_tokens=40, temperature=0.7, seed=3, regex=r"[0-9]{3}-[0-9]{4}"),
        SamplingParams(max_tokens=40, temperature=0, grammar=lark)])
    assert all(r.finish_reason == "stop" for r in results), results
    assert isinstance(json.loads(results[0].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", results[1].text)
    assert results[2].text in ("yes", "no")


@pytest.mark.parametrize("kwargs, match", [
    ({"json_schema": {"type": "fish"}}, "json_schema is not valid"),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": [1]}, "must be a JSON object"),
    ({"regex": "a(b"}, "regex is not valid"),
    ({"grammar": "start: nothing_here"}, "grammar is not valid"),
    ({"regex": "a", "grammar": 'start: "a"'}, "exclusive"),
])
def test_a_bad_constraint_is_refused(kwargs, match):
    with pytest.raises(TiergenError, match=match):
        SamplingParams(**kwargs)


# ---- compact JSON ------------------------------------------------------------------------------

# Four schemas whose answers have a longest compact form, beside that form.
SCHEMAS = [
    ({"type": "object", "additionalProperties": False, "required": ["colour", "n"],
      "properties": {"colour": {"enum": ["red", "green", "blue"]},
                     "n": {"type": "integer", "minimum": 0, "maximum": 9}}},
     {"colour": "green", "n": 9}),
    ({"type": "object", "additionalProperties": False, "required": ["pet", "ok"],
      "properties": {"pet": {"type": "object", "additionalProperties": False,
                             "required": ["kind", "age"],
                             "properties": {"kind": {"enum": ["cat", "dog", "hamster"]},
                                            "age": {"type": "integer", "minimum": 0,
                                                    "maximum": 30}}},
                     "ok": {"type": "boolean"}}},
     {"pet": {"kind": "hamster", "age": 30}, "ok": False}),
    ({"type": "object", "additionalProperties": False, "required": ["tags"],
      "properties": {"tags": {"type": "array", "maxItems": 3,
                              "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}}}},
     {"tags": ["abcdefgh"] * 3}),
    ({"type": "object", "additionalProperties": False, "required": ["low", "high"],
      "properties": {"low": {"type": "integer", "minimum": -50, "maximum": -10},
                     "high": {"type": "integer", "minimum": 100, "maximum": 999}}},
     {"low": -50, "high": 999}),
]


def compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


@pytest.mark.parametrize("options, flexible, accepts_spaces", [
    ({}, False, False), ({}, True, True),
    ({"x-guidance": {"whitespace_flexible": True}}, False, True),  # the schema's own choice wins
])
def test_json_is_compact_unless_asked(llm, options, flexible, accepts_spaces):
    schema, longest = SCHEMAS[0]
    params = SamplingParams(json_schema={**schema, **options}, flexible_json=flexible)

    def accepted(text: str) -> bool:
        tokens = llm.tokenizer.encode(text, add_special_tokens=False)
        matcher = Constraint(params.compiled_grammar, llm.tokenizer).matcher
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()

    assert accepted(compact(longest))
    assert accepted(json.dumps(longest, indent=2)) == accepts_spaces
    assert accepted('{"colour": "red", "n": 1}') == accepts_spaces


def test_flexible_json_needs_a_schema():
    with pytest.raises(TiergenError, match="flexible_json applies to a json_schema only"):
        SamplingParams(regex="a+", flexible_json=True)


@pytest.mark.slow
def test_sampled_json_answers_all_finish(llm):
    """200 answers at temperature 1.0, 50 per schema, each with twice its schema's longest
    compact answer in tokens: every one parses, validates and stops on its own."""
    prompts, params = [], []
    for i, (schema, longest) in enumerate(SCHEMAS):
        budget = 2 * len(llm.tokenizer.encode(compact(longest), add_special_tokens=False))
        prompt = ask(llm, f"Answer as JSON following this schema: {json.dumps(schema)}")
        prompts += [prompt] * 50
        params += [SamplingParams(max_tokens=budget, temperature=1.0, seed=100 * i + s,
                                  json_schema=schema) for s in range(50)]
    results = llm.generate(prompts, params)
    for r, p in zip(results, params):
        assert r.finish_reason == "stop", r.text
        assert r.text == compact(json.loads(r.text))
        jsonschema.validate(json.loads(r.text), p.json_schema)


# ---- the server --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_url(llm):
    with serving(create_app(llm, [MODEL], default_max_tokens=64)) as url:
        yield url


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: str


def test_openai_client_parses_into_a_pydantic_model(base_url):
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    done = client.chat.completions.parse(
        model=MODEL, response_format=Person, temperature=0, max_completion_tokens=60,
        messages=[{"role": "user", "content": "Bob is 42 and lives in Rome. As JSON."}])
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_completions_json_object_and_a_bad_schema(base_url):
    r = httpx.post(base_url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Q: a cat as JSON with its name and age.\nA:", "max_tokens": 60,
        "temperature": 0, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict)
    for body, match in [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "fish"}}},
         "json_schema is not valid"),
        ({"type": "xml"}, "'response_format.type' must be"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "a 'schema' object"),
    ]:
        r = httpx.post(base_url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "response_format": body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert match in error["message"] and error["param"].startswith("response_format"), error


def test_flexible_json_through_the_server(base_url):
    schema, _ = SCHEMAS[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A colour and a digit."}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    r = httpx.post(base_url + "/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text == compact(json.loads(text))
    r = httpx.post(base_url + "/v1/chat/completions", timeout=60,
                   json={**body, "flexible_json": True})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    r = httpx.post(base_url + "/v1/chat/completions", timeout=60,
                   json={**body, "response_format": None, "flexible_json": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "flexible_json", r.text
