import tiergen  # noqa: F401  (first: sets the CPU safety guard before torch runs a kernel)

# EleutherAI's lm-evaluation-harness, run for real against `tiergen serve` (its
# `local-completions` model, which tokenizes through the server's /tokenize and scores through
# /v1/completions with echo and logprobs) on the two local tasks in tests/data/lmeval. Its
# numbers must equal those computed here from the engine directly: for the multiple-choice task
# the summed log-likelihood of each choice from LLM.logits and the accuracy of their argmax, for
# the generation task the exact match of LLM.generate's greedy text.
#
# The harness lives in its own virtualenv, .peers/lmeval-venv (`make test` builds it: see the
# Makefile); without it this file is skipped.

import glob
import json
import os
import re
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tiergen import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = ROOT / ".peers" / "lmeval-venv" / "bin" / "lm_eval"
TASKS = ROOT / "tests" / "data" / "lmeval"
MODEL = "smollm2"
TOL = 1e-3  # the server batches the harness's requests; float32 sums move by ~1e-5 with a batch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not LM_EVAL.exists(),
    reason=f"lm-evaluation-harness is not installed in {LM_EVAL.parent.parent} "
           "(`make .peers/lmeval-venv/.installed` builds it)")]


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines() if line]


# The tasks' prompts, as their YAML files write them (doc_to_text, doc_to_choice, doc_to_target).
def mc_context(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"


def qa_context(doc: dict) -> str:
    return ("Answer each question with one word.\nQuestion: What colour is snow?\nAnswer: White\n"
            f"Question: {doc['question']}\nAnswer:")


def normalised(text: str) -> str:
    """exact_match with ignore_case and ignore_punctuation."""
    return text.lower().translate(str.maketrans("", "", string.punctuation))


def loglikelihood(llm: LLM, context: str, continuation: str) -> float:
    """log p(continuation | context), tokenized as the harness does it: the whole text, and the
    context alone; the continuation is what the whole has past the context's tokens."""
    encode = llm.tokenizer.encode
    whole, ctx = encode(context + continuation, False), encode(context, False)
    rows = torch.log_softmax(llm.logits(whole).float(), dim=-1)
    return sum(rows[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


@pytest.fixture(scope="module")
def expected() -> dict:
    llm = LLM(MODEL, dtype="float32", activations="float32")
    mc = []
    for doc in read_jsonl("mc.jsonl"):
        scores = [loglikelihood(llm, mc_context(doc), " " + c) for c in doc["choices"]]
        best = max(range(len(scores)), key=scores.__getitem__)
        mc.append({"scores": scores, "acc": float(best == doc["answer"])})
    docs = read_jsonl("qa.jsonl")
    greedy = SamplingParams(max_tokens=16, temperature=0, stop=["\n"])
    results = llm.generate([llm.tokenizer.encode(qa_context(d), False) for d in docs], greedy)
    qa = [{"text": r.text, "exact_match": float(normalised(r.text) == normalised(" " + a))}
          for a, r in zip((d["answer"] for d in docs), results)]
    return {"mc": mc, "qa": qa}


@pytest.fixture(scope="module")
def server(expected, tmp_path_factory):
    """`tiergen serve` in its own process, float32 on the float path, on a free port; its log
    goes to a file (a pipe nobody reads could fill and stop it)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tiergen.cli", "serve", "--model", MODEL,
                                 "--dtype", "float32", "--exact", "--port", "0"],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=f, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (match := re.search(r"http://\S+", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield match.group(0)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def harness(server, tmp_path_factory) -> Path:
    """One run of the harness over both tasks; its output directory."""
    out = tmp_path_factory.mktemp("lmeval")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(out / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    model_args = f"base_url={server}/v1/completions,model={MODEL},tokenizer_backend=remote"
    cmd = [str(LM_EVAL), "--model", "local-completions", "--model_args", model_args,
           "--batch_size", "16", "--include_path", str(TASKS),
           "--tasks", "tiergen_mc,tiergen_qa", "--output_path", str(out), "--log_samples"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "Using remote tokenizer" in run.stderr  # it tokenized through the server
    return out


def results(out: Path) -> dict:
    (path,) = glob.glob(str(out / "*" / "results_*.json"))
    return json.loads(Path(path).read_text())["results"]


def samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    return sorted(rows, key=lambda r: r["doc_id"])


def test_multiple_choice_equals_the_engines_loglikelihoods(harness, expected):
    rows = samples(harness, "tiergen_mc")
    assert len(rows) == len(expected["mc"]) == 12
    for row, want in zip(rows, expected["mc"]):
        got = [float(ll) for ll, _ in row["filtered_resps"]]
        assert got == pytest.approx(want["scores"], abs=TOL), row["doc"]
        assert row["acc"] == want["acc"], row["doc"]
    acc = sum(w["acc"] for w in expected["mc"]) / len(expected["mc"])
    assert 0 < acc < 1  # the task tells right from wrong
    assert results(harness)["tiergen_mc"]["acc,none"] == pytest.approx(acc)


def test_generation_equals_greedy_generate(harness, expected):
    rows = samples(harness, "tiergen_qa")
    assert len(rows) == len(expected["qa"]) == 6
    for row, want in zip(rows, expected["qa"]):
        assert row["filtered_resps"] == [want["text"]], row["doc"]
        assert row["exact_match"] == want["exact_match"], row["doc"]
    em = sum(w["exact_match"] for w in expected["qa"]) / len(expected["qa"])
    assert 0 < em < 1
    assert results(harness)["tiergen_qa"]["exact_match,none"] == pytest.approx(em)
