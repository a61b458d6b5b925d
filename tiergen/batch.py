"""``tiergen run-batch``: a file of requests in OpenAI's batch format, run by the offline engine.

Each input line is one request, ``{"custom_id", "method": "POST", "url", "body"}``, to
/v1/completions or /v1/chat/completions. Each output line is its result, ``{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``, whose body
is what ``tiergen serve`` answers for that body (the server's validation and response code
build it): the completion, or an error object under a 4xx status. A line that is no request
(not JSON, no custom_id, another method or url) gets ``"response": null`` and an ``error``.

Requests run many at a time through ``LLM.generate``, grouped by prompt length, a block of
sequences per group. Each group's results are written and synced to disk before the next
group starts, so an interrupted run loses nothing finished; the same command then resumes,
skipping the custom_ids the output already has. Results come in the order they finish.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm import tqdm

from tiergen.engine.llm import LLM
from tiergen.errors import TiergenError
from tiergen.server.endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoints, Prepared
from tiergen.server.errors import APIError, bad_request
from tiergen.server.protocol import sampling_error

URLS = (COMPLETIONS, CHAT_COMPLETIONS)
WINDOW = 4096  # requests tokenised and sorted by length at a time (bounds the memory held)


@dataclass
class Line:
    """One request line of the input; ``error`` (code, message) when it is no request."""

    number: int  # from 1
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: tuple[str, str] | None = None


def parse_line(number: int, text: str) -> Line:
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        return Line(number, None, error=("invalid_json_line", f"line {number} is not valid JSON: {e}"))
    if not isinstance(item, dict):
        return Line(number, None, error=("invalid_json_line", f"line {number} is not a JSON object"))
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, error=("missing_required_parameter",
                                         f"line {number} has no 'custom_id' (a non-empty string)"))
    line = Line(number, custom_id, url, body)
    if method != "POST":
        line.error = ("invalid_method", f"line {number}: 'method' must be \"POST\", got {method!r}")
    elif url not in URLS:
        line.error = ("invalid_url", f"line {number}: 'url' must be {' or '.join(URLS)}, "
                                     f"got {url!r}")
    elif not isinstance(body, dict):
        line.error = ("missing_required_parameter",
                      f"line {number}: 'body' must be the request's body, a JSON object")
    return line


def read_input(path: Path) -> list[Line]:
    """The input's request lines (blank lines skipped); a custom_id given twice is an error."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [parse_line(n, text) for n, text in enumerate(f, 1) if text.strip()]
    except OSError as e:
        raise TiergenError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise TiergenError(f"cannot read {path}: it is not UTF-8 text") from None
    first: dict[str, int] = {}
    for line in lines:
        if line.custom_id is None:
            continue
        if line.custom_id in first:
            raise TiergenError(f"custom_id {line.custom_id!r} is on lines {first[line.custom_id]} "
                               f"and {line.number} of {path}; every request needs its own")
        first[line.custom_id] = line.number
    return lines


def read_done(path: Path) -> tuple[set[str], set[int]]:
    """The custom_ids the output already answers, and the line numbers of the id-less lines it
    reports. A last line cut short (a crash mid-write) is removed: its request runs again."""
    ids: set[str] = set()
    numbers: set[int] = set()
    if not path.exists():
        return ids, numbers
    try:
        with open(path, "rb+") as f:
            good = 0  # bytes of whole records
            for n, raw in enumerate(f, 1):
                record = _record_of(raw)
                if record is None:
                    if f.read(1):  # not the last line: not ours to repair
                        raise TiergenError(f"line {n} of {path} is not a result record; remove "
                                           "it, or write the results to another file")
                    print(f"tiergen: dropped the unfinished last line of {path}; its request "
                          "runs again", file=sys.stderr)
                    f.truncate(good)
                    break
                good += len(raw)
                if record["custom_id"] is not None:
                    ids.add(record["custom_id"])
                elif isinstance(record.get("error"), dict) and "line" in record["error"]:
                    numbers.add(record["error"]["line"])
    except OSError as e:
        raise TiergenError(f"cannot read {path}: {e.strerror or e}") from None
    return ids, numbers


def _record_of(raw: bytes) -> dict | None:
    """A whole output line's record, or None for a line that is not one."""
    if not raw.endswith(b"\n"):
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "custom_id" in record else None


def record(custom_id: str | None, status: int | None = None, body: dict | None = None,
           error: dict | None = None) -> dict:
    """One output line: a response (``status``, ``body``) or an ``error``."""
    response = None if status is None else \
        {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response,
            "error": error}


def line_error(line: Line) -> dict:
    code, message = line.error
    return record(line.custom_id, error={"code": code, "message": message, "line": line.number})


def api_error(line: Line, e: APIError) -> dict:
    return record(line.custom_id, e.status, e.body())


class Results:
    """The output file, appended to; ``commit`` puts what was written on the disk."""

    def __init__(self, f: IO[str]) -> None:
        self.f = f

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())


@dataclass
class Summary:
    total: int = 0  # request lines in the input
    skipped: int = 0  # already answered in the output
    ok: int = 0  # answered now with status 200
    failed: int = 0  # answered now with an error
    generated_tokens: int = 0


def prepare(endpoints: Endpoints, line: Line) -> Prepared:
    """A line's request, validated as the server validates it; a stream is refused (the
    results are whole answers)."""
    job = endpoints.prepare(line.url, json.dumps(line.body).encode())
    if job.body.stream:
        raise bad_request("'stream' is not supported in a batch: every result is written "
                          "whole; leave it out", "stream", "unsupported_parameter")
    return job


def groups(jobs: list[tuple[Line, Prepared]], size: int) -> Iterator[list[tuple[Line, Prepared]]]:
    """The requests, longest prompts first, cut into groups of about ``size`` sequences (a
    request's choices stay together)."""
    jobs = sorted(jobs, key=lambda j: max(len(p) for p in j[1].prompts), reverse=True)
    group: list[tuple[Line, Prepared]] = []
    count = 0
    for job in jobs:
        if group and count + job[1].num_sequences > size:
            yield group
            group, count = [], 0
        group.append(job)
        count += job[1].num_sequences
    if group:
        yield group


def run_group(llm: LLM, group: list[tuple[Line, Prepared]]) -> list[tuple[dict, int]]:
    """Run a group in one ``LLM.generate`` call: each request's record and its generated
    tokens. A request the engine refuses (as the server's scheduler would) gets a 400
    without holding back the others."""
    prompts, params = [], []
    for _, job in group:
        p, q = job.inputs()
        prompts += p
        params += q
    try:
        results = llm.generate(prompts, params)
    except TiergenError as e:
        if len(group) > 1:
            return [out for job in group for out in run_group(llm, [job])]
        line, job = group[0]
        return [(api_error(line, sampling_error(e, job.param)), 0)]
    out, at = [], 0
    for line, job in group:
        mine, at = results[at:at + job.num_sequences], at + job.num_sequences
        tokens = sum(r.num_generated_tokens for r in mine)
        body = job.response(mine, tokens)
        out.append((record(line.custom_id, 200, body), tokens))
    return out


def run_batch(llm: LLM, lines: list[Line], output: Path, *, model_names: list[str] | None = None,
              default_max_tokens: int = 256, chat_template: str | None = None,
              progress: bool = True) -> Summary:
    """Answer every line the output does not answer yet, appending to it (see the module's
    docstring). ``model_names``, ``default_max_tokens`` and ``chat_template`` are as
    ``tiergen serve`` takes them."""
    done_ids, done_lines = read_done(output)
    todo = [line for line in lines if (line.custom_id not in done_ids if line.custom_id is not None
                                       else line.number not in done_lines)]
    summary = Summary(total=len(lines), skipped=len(lines) - len(todo))
    endpoints = Endpoints(llm, model_names or [], default_max_tokens, chat_template)
    started = time.perf_counter()
    try:
        f = open(output, "a", encoding="utf-8")
    except OSError as e:
        raise TiergenError(f"cannot write {output}: {e.strerror or e}") from None
    with f, tqdm(total=len(todo), unit="req", disable=not progress, desc="run-batch",
                 dynamic_ncols=True) as bar:
        results = Results(f)
        for start in range(0, len(todo), WINDOW):
            jobs = []
            for line in todo[start:start + WINDOW]:
                try:
                    if line.error is not None:
                        results.write(line_error(line))
                    else:
                        jobs.append((line, prepare(endpoints, line)))
                        continue
                except APIError as e:
                    results.write(api_error(line, e))
                summary.failed += 1
                bar.update()
            results.commit()
            for group in groups(jobs, llm.block_size):
                for rec, tokens in run_group(llm, group):
                    results.write(rec)
                    summary.ok += rec["response"]["status_code"] == 200
                    summary.failed += rec["response"]["status_code"] != 200
                    summary.generated_tokens += tokens
                results.commit()
                bar.update(len(group))
                rate = summary.generated_tokens / max(time.perf_counter() - started, 1e-9)
                bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=True)
    return summary


def planning_texts(lines: list[Line]) -> list[str]:
    """Roughly the prompts of the requests, for a planned policy's workload."""
    texts = []
    for line in lines:
        body = line.body if isinstance(line.body, dict) else {}
        prompt, messages = body.get("prompt"), body.get("messages")
        if isinstance(prompt, str):
            texts.append(prompt)
        elif isinstance(prompt, list):
            texts += [p for p in prompt if isinstance(p, str)]
        elif isinstance(messages, list):
            texts.append("\n".join(str(m.get("content", "")) for m in messages
                                   if isinstance(m, dict)))
    return texts
