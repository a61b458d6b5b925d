import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# The command line: in-process through tiergen.cli.main (fast), plus a few real processes to
# check what a user sees on an error: status 2, one "tiergen: error:" line, no traceback.

import builtins
import io
import json
import re
import subprocess
import sys

import pytest

from tiergen import LLM, SamplingParams, cli
from tiny_models import build

PARIS = "What is the capital of France?"

COMMON_OPTIONS = ["--model", "--dtype", "--device", "--compile", "--dequantize", "--quantize",
                  "--activations", "--exact", "--batch-invariant", "--prefill-chunk-size",
                  "--no-share-prefixes", "--speculative-config",
                  "--max-batch-size", "--percent",
                  "--gpu-batch-size", "--num-gpu-batches", "--no-pin-memory", "--no-keep-tiles",
                  "--cpu-attention",
                  "--offload-dir", "--device-memory", "--host-memory", "--experts",
                  "--expert-cache", "--policy",
                  "--compress-weights", "--compress-cache", "--compress-bits",
                  "--compress-group-size", "--attn-sparsity", "--verbose",
                  "--max-tokens", "--temperature", "--top-p", "--top-k", "--repetition-penalty",
                  "--seed", "--stop", "--ignore-eos", "--json-schema", "--flexible-json", "--regex", "--grammar"]
PARALLEL_OPTIONS = ["--pipeline-parallel", "--tensor-parallel", "--parallel-timeout"]
GENERATE_OPTIONS = ["--file", "--chat", "--json", *COMMON_OPTIONS, *PARALLEL_OPTIONS]
CHAT_OPTIONS = ["--system", "--chat-template", *COMMON_OPTIONS, *PARALLEL_OPTIONS]
MODEL_OPTIONS = COMMON_OPTIONS[:COMMON_OPTIONS.index("--max-tokens")]
SERVE_OPTIONS = ["--host", "--port", "--max-queue", "--default-max-tokens", "--chat-template",
                 "--api-key", "--queue-timeout", "--prefix-cache", "--prefix-cache-disk",
                 *MODEL_OPTIONS, *PARALLEL_OPTIONS]
RUN_BATCH_OPTIONS = ["--input", "--output", "--default-max-tokens", "--chat-template",
                     *MODEL_OPTIONS, *PARALLEL_OPTIONS]


class _Tty(io.StringIO):
    """A standard input that is an interactive terminal with nothing typed."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def tty_stdin(monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Tty())


@pytest.fixture(scope="module")
def smol() -> LLM:
    """The packaged model exactly as the CLI loads it with its default options."""
    return cli._load(cli.build_parser().parse_args(["generate"]))


@pytest.fixture
def use_smol(smol, monkeypatch):
    """Make the CLI reuse the module's loaded smollm2 instead of loading it for every call."""

    def load(args, prompts=None):
        assert (args.model, args.dtype, args.device) == ("smollm2", "auto", None)
        return smol

    monkeypatch.setattr(cli, "_load", load)
    return smol


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A model directory without tokenizer files."""
    directory = tmp_path_factory.mktemp("cli") / "tiny"
    build("llama-mha", directory)
    return directory


def feed_input(monkeypatch, *lines: str) -> list[str]:
    """Make input() return these lines, then raise EOFError (Ctrl-D); returns the prompts shown."""
    shown, queue = [], list(lines)

    def fake_input(prompt: str = "") -> str:
        shown.append(prompt)
        if not queue:
            raise EOFError
        return queue.pop(0)

    monkeypatch.setattr(builtins, "input", fake_input)
    return shown


def one_error_line(err: str, match: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tiergen: error: ")
    assert match in lines[0]


# ---- errors: in-process --------------------------------------------------------------------

def test_missing_model_path(tmp_path, capsys):
    assert cli.main(["generate", "-m", str(tmp_path / "nope"), "Hello"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    one_error_line(err, "nope' not found")


def test_invalid_temperature(capsys):
    assert cli.main(["generate", "--temperature", "-1", "Hello"]) == 2
    one_error_line(capsys.readouterr().err, "temperature must be a number >= 0")


@pytest.mark.parametrize("option, value, match", [
    ("--top-p", "0", "top_p must be in (0, 1]"),
    ("--top-k", "-1", "top_k must be an integer >= 0"),
    ("--max-tokens", "0", "max_tokens must be a positive integer"),
    ("--repetition-penalty", "0", "repetition_penalty must be a number > 0"),
    ("--stop", "", "stop strings must be non-empty"),
])
def test_invalid_sampling_options(capsys, option, value, match):
    assert cli.main(["generate", option, value, "Hello"]) == 2
    one_error_line(capsys.readouterr().err, match)


def test_argparse_rejects_non_numbers(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--temperature", "hot", "Hello"])
    assert e.value.code == 2
    assert "invalid float value: 'hot'" in capsys.readouterr().err


def test_no_prompts(capsys):
    assert sys.stdin.isatty()
    assert cli.main(["generate"]) == 2
    one_error_line(capsys.readouterr().err, "no prompts: pass them as arguments, with --file")


def test_missing_prompts_file(tmp_path, capsys):
    assert cli.main(["generate", "--file", str(tmp_path / "prompts.txt")]) == 2
    one_error_line(capsys.readouterr().err, "cannot read prompts from")


def test_prompts_file_not_utf8(tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"fine\n\xff\xfe not utf-8\n")
    assert cli.main(["generate", "--file", str(path)]) == 2
    one_error_line(capsys.readouterr().err, "it is not UTF-8 text")


def test_generate_text_on_model_without_tokenizer(tiny_dir, capsys):
    assert cli.main(["generate", "-m", str(tiny_dir), "Hello"]) == 2
    one_error_line(capsys.readouterr().err, "has no tokenizer files")


def test_chat_on_model_without_tokenizer_fails_before_reading(tiny_dir, monkeypatch, capsys):
    shown = feed_input(monkeypatch, "Hello")
    assert cli.main(["chat", "-m", str(tiny_dir)]) == 2
    assert shown == []  # failed before asking the user anything
    one_error_line(capsys.readouterr().err, "has no tokenizer, so it cannot chat")


def test_chat_with_invalid_template_fails_before_reading(use_smol, monkeypatch, capsys):
    shown = feed_input(monkeypatch, "Hello")
    assert cli.main(["chat", "--chat-template", "{% if %}"]) == 2
    assert shown == []
    one_error_line(capsys.readouterr().err, "the chat template is not valid Jinja")


# ---- errors: real processes ------------------------------------------------------------------

@pytest.mark.parametrize("args, match", [
    (["generate", "-m", "{tmp}/nope", "Hello"], "not found"),
    (["generate", "--temperature", "-1", "Hello"], "temperature must be a number >= 0"),
    (["generate"], "no prompts"),  # standard input is empty and not a terminal
    (["generate", "--json-schema", "{not json", "Hello"], "json_schema is not valid JSON"),
    (["serve", "--prefix-cache", "lots"], "cannot read memory size 'lots'"),
])
def test_process_error_is_one_line_and_status_2(tmp_path, args, match):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run([sys.executable, "-m", "tiergen.cli", *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    one_error_line(proc.stderr, match)


# ---- help ------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, options", [("generate", GENERATE_OPTIONS),
                                              ("chat", CHAT_OPTIONS),
                                              ("serve", SERVE_OPTIONS),
                                              ("run-batch", RUN_BATCH_OPTIONS)])
def test_help_mentions_every_option(capsys, command, options):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in options:
        assert option in out, option
    # and the parser has no option the lists above forget
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices[command]
    declared = {s for a in sub._actions for s in a.option_strings if s.startswith("--")}
    assert declared - {"--help"} == set(options)


# ---- real runs with smollm2 ------------------------------------------------------------------

def test_generate_one_prompt_streams_text(use_smol, capsys):
    assert cli.main(["generate", "--max-tokens", "4", "--temperature", "0", "Hello"]) == 0
    out, err = capsys.readouterr()
    expected = use_smol.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert expected.text.strip()
    assert out == expected.text + "\n"


def test_generate_constrained_output(use_smol, capsys, tmp_path):
    """--json-schema (inline or a file) and --regex: what the command prints parses and
    matches, and equals the engine's output under the same constraint."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = "The capital of France as JSON:"
    for given in (json.dumps(schema), str(path)):
        assert cli.main(["generate", "--max-tokens", "32", "--temperature", "0",
                         "--json-schema", given, prompt]) == 0
        out = capsys.readouterr().out
        assert set(json.loads(out)) == {"city"}
        want = use_smol.generate([prompt], SamplingParams(max_tokens=32, temperature=0,
                                                          json_schema=schema))[0].text
        assert out == want + "\n"
    assert cli.main(["generate", "--max-tokens", "8", "--temperature", "0",
                     "--regex", "[0-9]{4}", "The year the war ended:"]) == 0
    assert re.fullmatch(r"[0-9]{4}\n", capsys.readouterr().out)


def test_generate_json_two_prompts(use_smol, capsys):
    prompts = ["The capital of France is", "1, 2, 3,"]
    assert cli.main(["generate", "--max-tokens", "4", "--json", *prompts]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in rows] == prompts
    for prompt, row in zip(prompts, rows):
        assert set(row) == {"prompt", "text", "finish_reason", "prompt_tokens",
                            "completion_tokens"}
        assert row["prompt_tokens"] == len(use_smol.tokenizer.encode(prompt))
        assert 1 <= row["completion_tokens"] <= 4
        assert row["finish_reason"] in ("stop", "length")
        assert isinstance(row["text"], str)


def test_generate_from_file(use_smol, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello\n\n   \nThe sky is\n", encoding="utf-8")
    assert cli.main(["generate", "--max-tokens", "3", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("### ") == 2  # blank lines are no prompts
    assert out.startswith("### Hello\n")
    assert "\n### The sky is\n" in out


def test_generate_from_piped_stdin(use_smol, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nThe sky is\n"))
    assert cli.main(["generate", "--max-tokens", "3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "The sky is"]


def test_chat_streams_a_reply(use_smol, monkeypatch, capsys):
    shown = feed_input(monkeypatch, PARIS)
    assert cli.main(["chat", "--max-tokens", "8", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert shown == ["> ", "> "]  # one question, then Ctrl-D
    expected = use_smol.chat([{"role": "user", "content": PARIS}],
                             SamplingParams(max_tokens=8, temperature=0))
    assert expected.text.strip()
    assert out == expected.text + "\n"
    assert "Chatting with" in err and "error" not in err


def test_chat_keeps_going_after_a_turn_fails(use_smol, monkeypatch, capsys):
    shown = feed_input(monkeypatch, PARIS, "/exit")
    # max_tokens alone is over the 8192-token context: every turn fails, the session survives
    assert cli.main(["chat", "--max-tokens", "9000"]) == 0
    assert shown == ["> ", "> "]
    err = capsys.readouterr().err
    assert "tiergen: error: " in err and "exceeds the model's context" in err


@pytest.mark.parametrize("flags, note", [(["--policy", "auto"], False), ([], True)])
def test_policy_auto_plans_within_the_budget(flags, note, monkeypatch, tmp_path, capsys):
    """--policy auto (or a model that does not fit the budget on the device) plans a policy,
    prints it, runs it, and reports predicted against measured."""
    from test_planner import CPU
    from tiergen.planner import calibrate

    monkeypatch.setattr(calibrate, "get", lambda device, **kw: CPU)
    code = cli.main(["generate", *flags, "--device-memory", "60M", "--max-tokens", "4",
                     "--offload-dir", str(tmp_path), "The capital of France is", "Two plus two is"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "plan for LlamaForCausalLM" in err and "--percent" in err
    assert "predicted decode" in err and "measured" in err
    assert ("does not fit the budgets" in err) == note


@pytest.mark.parametrize("flags, chunk", [([], 1024), (["--batch-invariant"], None),
                                          (["--batch-invariant", "--prefill-chunk-size", "64"], 64)])
def test_a_planned_policy_is_for_the_prompt_chunks_the_run_takes(flags, chunk, monkeypatch,
                                                                 tmp_path):
    """--policy auto plans each prefill step as the run will take it: chunks of 1,024 tokens
    on a CPU, or whole prompts batch invariant (EngineConfig), or the chunks asked for."""
    from test_planner import CPU
    from tiergen.planner import calibrate, search

    monkeypatch.setattr(calibrate, "get", lambda device, **kw: CPU)
    seen, real = [], search.choose_policy
    monkeypatch.setattr(search, "choose_policy",
                        lambda *a, **k: seen.append(k["prefill_chunk"]) or real(*a, **k))
    assert cli.main(["generate", "--policy", "auto", "--device", "cpu", *flags,
                     "--device-memory", "60M", "--max-tokens", "2", "--offload-dir",
                     str(tmp_path), "Hi"]) == 0
    assert seen == [chunk]
