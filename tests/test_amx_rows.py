"""Which rows of a step run on AMX tiles (integer path, where AMX works): those of prompts of
AMX_PROMPT tokens or more, in every prompt step of theirs, whatever the rows beside them and
however the prompt is cut in chunks; never a decode step's. A shared prompt prefix is computed
for, and serves, prompts of one kind only. The decisions are checked on every machine (AMX
taken as working; nothing is multiplied here); the products and attention that follow them are
tests/test_int8_kernels.py's."""

from __future__ import annotations

import pytest
import torch

from tiergen import LLM, SamplingParams, kernels
from tiergen.engine.generate import MIN_SHARED_PREFIX, MicroBatchState, shared_length


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", device="cpu", activations="int8")


@pytest.fixture(autouse=True)
def amx_works(monkeypatch):
    monkeypatch.setattr(kernels, "amx_usable", lambda: True)


def sequences(llm, lengths, prefix=()):
    prompts = [list(prefix) + [100 + (7 * i + n) % 900 for i in range(n - len(prefix))]
               for n in lengths]
    return llm.runner.sequences(prompts, [SamplingParams(max_tokens=2)] * len(prompts))


def test_a_rows_prompt_steps_take_the_tiles_by_its_whole_prompt(llm):
    ex = llm.runner.executor
    long = kernels.AMX_PROMPT
    state = MicroBatchState(ex, sequences(llm, [11, 186, long]), chunk_size=64)
    steps = 0
    with kernels.activations_set("int8"):
        while not state.samples:  # chunks of 64: the first ones hold no token of the 11
            assert state.work().amx_rows().tolist() == [False, True, True]
            for _ in state.apply(None):
                pass
            steps += 1
        assert state.work().amx_rows().tolist() == [False, True, True]
        for _ in state.apply(torch.tensor([5, 6, 7])):
            pass
        assert state.decoding and state.work().amx_rows() is None
        short = MicroBatchState(ex, sequences(llm, [long - 1, 3]), chunk_size=64)
        assert short.work().amx_rows() is None
    assert steps == 2
    with kernels.activations_set("int16"):  # 16-bit activations: the integer kernels
        assert MicroBatchState(ex, sequences(llm, [200]), 64).work().amx_rows() is None


def test_a_shared_prefix_is_computed_for_prompts_of_one_kind(llm, monkeypatch):
    # the threshold above the shortest prompts that share a prefix, so that both kinds do
    monkeypatch.setattr(kernels, "AMX_PROMPT", MIN_SHARED_PREFIX + 40)
    ex, prefix = llm.runner.executor, list(range(200, 200 + MIN_SHARED_PREFIX + 8))
    long, short = kernels.AMX_PROMPT + 20, MIN_SHARED_PREFIX + 20
    assert shared_length(ex, sequences(llm, [short, short + 3], prefix)) == len(prefix)
    assert shared_length(ex, sequences(llm, [long, long + 3], prefix)) == len(prefix)
    assert shared_length(ex, sequences(llm, [short, long], prefix)) == 0
    ex_float = LLM("smollm2", device="cpu", activations="float32").runner.executor
    assert shared_length(ex_float, sequences(llm, [short, long], prefix)) == len(prefix)
