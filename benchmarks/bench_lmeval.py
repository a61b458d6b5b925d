"""lm-evaluation-harness against `tiergen serve` on a few-shot-style multiple-choice task, with
shared prefixes and without, same run.

The task (written to a temporary directory): --docs questions after one preamble of about
--prefix tokens (the text of tests/data/perplexity.txt, as few-shot examples are), each with
four choices, scored by log-likelihood, the way MMLU-style tasks are. The harness's
`local-completions` model drives the server (tokenizing through /tokenize, scoring through
/v1/completions with echo and logprobs, --batch-size prompts a request). tiergen serves it
with its defaults (prompts admitted together share their prefix, and the prefix cache keeps
it for the next requests), then with ``--no-share-prefixes --prefix-cache 0`` on the first
--baseline-docs questions (enough for a rate: each costs the same). Reports questions per
second, the ratio, both accuracies over the baseline's questions, and the largest difference
between the two runs' log-likelihood of a choice.

With --hf, the harness's own `hf` model (transformers on the same GGUF, dequantised, in
bfloat16 where this CPU has it natively, else float32) runs the first --baseline-docs questions
too, in the same run; it needs the harness beside this checkout's torch and transformers:

    python -m venv .peers/lmeval-hf-venv
    echo $PWD/.venv/lib/python3.11/site-packages > .peers/lmeval-hf-venv/lib/python3.11/site-packages/tiergen-venv.pth
    .peers/lmeval-hf-venv/bin/pip install lm-eval==0.4.13

    make .peers/lmeval-venv/.installed           # once: the harness, in its own virtualenv
    python benchmarks/bench_lmeval.py [--docs 256] [--prefix 1000] [--baseline-docs 16] [--exact] [--hf]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LM_EVAL = ROOT / ".peers" / "lmeval-venv" / "bin" / "lm_eval"
LM_EVAL_HF = ROOT / ".peers" / "lmeval-hf-venv" / "bin" / "lm_eval"
TEXT = ROOT / "tests" / "data" / "perplexity.txt"
CHOICES = ["red", "green", "blue", "yellow", "north", "south", "east", "west", "one", "two",
           "three", "four"]


def write_task(directory: Path, docs: int, prefix_tokens: int) -> None:
    from tiergen import LLM

    words = TEXT.read_text().split()
    tokenizer = LLM("smollm2").tokenizer
    preamble = " ".join(words[:prefix_tokens])
    while len(tokenizer.encode(preamble, False)) > prefix_tokens:
        preamble = preamble.rsplit(" ", 1)[0]
    rows = []
    for i in range(docs):
        question = " ".join(words[(11 * i) % (len(words) - 8):][:8])
        rows.append({"preamble": preamble, "question": f"Which word comes next after: {question}?",
                     "choices": [CHOICES[(i + j) % len(CHOICES)] for j in range(4)],
                     "answer": i % 4})
    (directory / "fewshot.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "fewshot.yaml").write_text(f"""task: tiergen_fewshot
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / 'fewshot.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{preamble}}}}\\nQuestion: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")


def harness(tasks: Path, out: Path, model: list[str], limit: int | None, batch_size: int,
            lm_eval: Path = LM_EVAL) -> tuple[float, list[dict]]:
    """One run of the harness over the task: its seconds and its samples by doc."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(out / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(lm_eval), *model, "--batch_size", str(batch_size), "--include_path", str(tasks),
           "--tasks", "tiergen_fewshot", "--output_path", str(out), "--log_samples",
           *(["--limit", str(limit)] if limit else [])]
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if done.returncode:
        sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
    (path,) = glob.glob(str(out / "*" / "samples_tiergen_fewshot_*.jsonl"))
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    return seconds, sorted(rows, key=lambda r: r["doc_id"])


def run(tasks: Path, out: Path, serve_args: list[str], limit: int | None,
        batch_size: int) -> tuple[float, list[dict]]:
    """Serve, run the harness over the task; its seconds and its samples by doc."""
    log = out / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tiergen.cli", "serve", "--model",
                                 "smollm2", "--port", "0", *serve_args],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=f, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not (match := re.search(r"http://\S+", log.read_text())):
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(log.read_text())
            time.sleep(0.1)
        model_args = (f"base_url={match.group(0)}/v1/completions,model=smollm2,"
                      "tokenizer_backend=remote")
        return harness(tasks, out, ["--model", "local-completions", "--model_args", model_args],
                       limit, batch_size)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--baseline-docs", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--exact", action="store_true", help="serve on the float path")
    ap.add_argument("--hf", action="store_true", help="the harness's hf model too")
    args = ap.parse_args()
    if not LM_EVAL.exists():
        sys.exit(f"{LM_EVAL} not found: make .peers/lmeval-venv/.installed builds it")
    if args.hf and not LM_EVAL_HF.exists():
        sys.exit(f"{LM_EVAL_HF} not found: see this script's docstring")
    from tiergen.bench import cpu_description

    cpu = cpu_description()
    print(f"{cpu['cpu']} ({' '.join(cpu['simd'])})", flush=True)
    extra = ["--exact"] if args.exact else []
    with tempfile.TemporaryDirectory() as tmp:
        tasks, shared_out, alone_out, hf_out = (Path(tmp) / n
                                                for n in ("tasks", "shared", "alone", "hf"))
        for d in (tasks, shared_out, alone_out, hf_out):
            d.mkdir()
        write_task(tasks, args.docs, args.prefix)
        shared_s, shared = run(tasks, shared_out, extra, None, args.batch_size)
        n = min(args.baseline_docs, args.docs)
        alone_s, alone = run(tasks, alone_out, [*extra, "--no-share-prefixes", "--prefix-cache",
                                                "0"], n, args.batch_size)
        if args.hf:
            from tiergen._platform import cpu_has_fast_bfloat16
            from tiergen.weights import _packaged_file

            gguf = _packaged_file("smollm2")
            dtype = "bfloat16" if cpu_has_fast_bfloat16() else "float32"
            hf_s, hf = harness(tasks, hf_out, [
                "--model", "hf", "--model_args",
                f"pretrained={gguf.parent},gguf_file={gguf.name},dtype={dtype}"], n,
                args.batch_size, LM_EVAL_HF)
    rate_shared, rate_alone = args.docs / shared_s, n / alone_s
    diff = max(abs(float(a[0]) - float(b[0])) for x, y in zip(shared, alone)
               for a, b in zip(x["filtered_resps"], y["filtered_resps"]))
    acc = [sum(r["acc"] for r in rows[:n]) / n for rows in (shared, alone)]
    print(f"{args.docs} questions of 4 choices after a preamble of about {args.prefix} tokens; "
          f"batch size {args.batch_size}; {'float' if args.exact else 'integer'} path")
    print("| run | questions | seconds | questions/s | vs without | accuracy on the first "
          f"{n} |")
    print("|---|---|---|---|---|---|")
    print(f"| shared prefixes | {args.docs} | {shared_s:.1f} | {rate_shared:.2f} | "
          f"{rate_shared / rate_alone:.1f}x | {acc[0]:.3f} |")
    print(f"| without | {n} | {alone_s:.1f} | {rate_alone:.3f} | - | {acc[1]:.3f} |")
    if args.hf:
        hf_acc = sum(r["acc"] for r in hf[:n]) / n
        print(f"| lm-eval hf ({dtype}) | {n} | {hf_s:.1f} | {n / hf_s:.3f} | "
              f"shared: {rate_shared / (n / hf_s):.1f}x | {hf_acc:.3f} |")
    print(f"largest difference in a choice's log-likelihood between the runs: {diff:.2e}")


if __name__ == "__main__":
    main()
