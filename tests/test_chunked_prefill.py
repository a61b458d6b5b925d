"""Chunked prefill gives what whole-prompt prefill gives, for every architecture."""

from __future__ import annotations

import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.engine.generate import MicroBatchState, make_sequences
from tiny_models import CASES, build

PROMPTS = [[5], list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 70))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CASES))
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build(request.param, d)
    return d


def first_logits(llm: LLM) -> torch.Tensor:
    """Logits that pick the first new token, through the engine's own prefill loop."""
    seqs = make_sequences(PROMPTS, [GREEDY] * len(PROMPTS), [], None)
    state = MicroBatchState(llm.executor, seqs, llm.prefill_chunk_size)
    steps = 0
    while True:
        logits = llm.executor.forward(*vars(state.work()).values())
        steps += 1
        if state.start + state.num_tokens >= state.prompt.shape[1]:
            state.cache.close()
            return logits, steps
        list(state.advance(logits))


@pytest.mark.parametrize("chunk", [1, 3, 16, 1000])
def test_chunked_equals_whole(model_dir, chunk, tmp_path):
    whole = LLM(model_dir, dtype="float32", prefill_chunk_size=None)
    chunked = LLM(model_dir, dtype="float32", prefill_chunk_size=chunk)
    expected, one_step = first_logits(whole)
    got, steps = first_logits(chunked)
    assert one_step == 1 and steps == -(-max(map(len, PROMPTS)) // chunk)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    want = [r.token_ids for r in whole.generate(PROMPTS, GREEDY)]
    assert [r.token_ids for r in chunked.generate(PROMPTS, GREEDY)] == want
    # and through a policy that streams weights and cache from disk
    offloaded = LLM(model_dir, dtype="float32", prefill_chunk_size=chunk,
                    policy=Policy(weights=(0, 0), cache=(0, 0), offload_dir=tmp_path))
    assert [r.token_ids for r in offloaded.generate(PROMPTS, GREEDY)] == want


def test_sliding_window_cache_stops_growing(tmp_path):
    """A windowed layer keeps W slots however long the sequence: KV bytes are flat past W."""
    build("mistral-window", tmp_path)
    ex = LLM(tmp_path, dtype="float32").executor

    def kv_bytes(capacity: int) -> int:
        cache = ex.new_cache(2, capacity)
        try:
            return sum(t.nbytes for t in cache.layers)
        finally:
            cache.close()

    per_slot = kv_bytes(1)
    assert kv_bytes(4) == 4 * per_slot
    assert kv_bytes(8) == kv_bytes(9) == kv_bytes(5000) == 8 * per_slot
