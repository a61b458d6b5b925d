"""The README and the guides in docs/ say what runs: every relative link resolves (to the
heading it names, too), every ``tiergen`` command in their shell blocks is one the command
line accepts, and the short ones on the packaged models, and their short Python blocks, run as
written."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tiergen.cli import build_parser
from tiergen.weights import SHORT_NAMES

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# what runs as written: commands and Python on the packaged models, these commands, quick
# (`tiergen bench --against` has tests of its own: tests/test_bench.py)
RUNS = ("generate", "plan", "perplexity")
SHORT = 12  # lines of a Python block that runs
READERS_OWN = ("path/to/", "my-")  # files a command names that the reader brings: parsed only


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    text = BLOCK.sub("", path.read_text())  # (a "#" in a code block is no heading)
    for line in text.splitlines():
        if m := re.match(r"#+ (.*)", line):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def code_blocks(lang: str) -> list[tuple[str, str]]:
    """(where, text) of every ``lang`` block of the docs."""
    return [(f"{p.relative_to(ROOT)}:{p.read_text()[:m.start()].count(chr(10)) + 1}", m.group(2))
            for p in DOCS for m in BLOCK.finditer(p.read_text()) if m.group(1) == lang]


def tiergen_commands() -> list[tuple[str, list[str]]]:
    """Every ``tiergen ...`` line of the shell blocks (continuations joined, comments cut)."""
    out = []
    for where, text in code_blocks("sh"):
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, w in enumerate(words):  # up to a shell operator (&, |, >, ...)
                if w in ("&", "&&", "|", "||", ">", ">>", "<", ";"):
                    words = words[:i]
                    break
            if words[:1] == ["tiergen"]:
                out.append((where, words[1:]))
    return out


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(BLOCK.sub("", doc.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_tiergen_command_is_one_the_command_line_takes(capsys):
    commands = tiergen_commands()
    assert len(commands) >= 10  # (the reader finds them)
    refused = []
    for where, words in commands:
        try:
            build_parser().parse_args(words)
        except SystemExit as e:
            if e.code == 0:  # --help
                continue
            refused.append(f"{where}: tiergen {shlex.join(words)}: {capsys.readouterr().err}")
    assert not refused, "\n".join(refused)


def _runs(words: list[str]) -> bool:
    """A command that runs as written here: one of RUNS on a packaged model (the default one
    when none is named), not waiting on the terminal."""
    if "--help" in words or any(w.startswith(READERS_OWN) for w in words):
        return False
    args = build_parser().parse_args(words)
    return args.command in RUNS and args.model in SHORT_NAMES


PROMPTS = "The capital of France is\nWrite a haiku about the sea.\n"  # the docs' prompts.txt
TEXT = ROOT / "tests" / "data" / "perplexity.txt"  # ... and their text.txt


@pytest.mark.slow
def test_the_short_commands_run_as_written(tmp_path):
    (tmp_path / "prompts.txt").write_text(PROMPTS)
    (tmp_path / "text.txt").write_text(TEXT.read_text())
    ran = 0
    for where, words in tiergen_commands():
        if not _runs(words):
            continue
        proc = subprocess.run([sys.executable, "-m", "tiergen.cli", *words], cwd=tmp_path,
                              capture_output=True, text=True, timeout=900,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"{where}: tiergen {shlex.join(words)}\n{proc.stderr[-2000:]}"
        ran += 1
    assert ran >= 3


def _short_python() -> list[tuple[str, str]]:
    """Python blocks that run as written here: short, on a packaged model, no server."""
    return [(where, text) for where, text in code_blocks("python")
            if len(text.splitlines()) <= SHORT and "openai" not in text
            and not re.search(r"LLM\(\s*[\"'](?!(" + "|".join(SHORT_NAMES) + r")[\"'])", text)]


@pytest.mark.slow
def test_the_short_python_blocks_run_as_written(tmp_path):
    blocks = _short_python()
    assert blocks
    for where, text in blocks:
        proc = subprocess.run([sys.executable, "-c", text], cwd=tmp_path, capture_output=True,
                              text=True, timeout=900, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"{where}:\n{text}\n{proc.stderr[-2000:]}"
