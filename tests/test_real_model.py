"""The packaged SmolLM2-135M-Instruct GGUF against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from tiergen import LLM, SamplingParams
from tiergen.cache.step import StepMeta
from tiergen.weights import _packaged_file

pytestmark = pytest.mark.slow

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2", dtype="float32", activations="float32")  # the float path


@pytest.fixture(scope="module")
def hf():
    import transformers

    path = _packaged_file("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def test_logits_match_transformers(llm, hf):
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is")
    cache = llm.executor.new_cache(1, len(ids))
    valid = torch.ones(1, len(ids), dtype=torch.bool)
    ours = llm.executor.forward(torch.tensor([ids]), StepMeta.build(valid, 0, len(ids)), cache)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)


def test_greedy_matches_transformers(llm, hf):
    ids = llm.chat_prompt(PARIS)
    ours = llm.generate([ids], SamplingParams(max_tokens=32, temperature=0))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    assert ours.token_ids == ref[0, len(ids):].tolist()
    assert ours.token_ids[-1] in llm.eos_token_ids


def test_answers_paris(llm):
    answer = llm.chat(PARIS, SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop"  # ends on the chat's end-of-turn token


def test_seeded_sampling_is_reproducible(llm):
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    first = llm.chat(PARIS, p)
    # The same seed gives the same tokens, also when other prompts share the batch.
    again = llm.generate([llm.chat_prompt(PARIS), "Hello there"], [p, SamplingParams(max_tokens=5)])
    assert first.token_ids == again[0].token_ids
    other = llm.chat(PARIS, SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=99))
    assert other.token_ids != first.token_ids


def test_stop_strings_and_streaming(llm):
    p = SamplingParams(max_tokens=40, temperature=0)
    full = llm.chat(PARIS, p).text
    word = full.split()[2]
    stopped = llm.chat(PARIS, SamplingParams(max_tokens=40, temperature=0, stop=[word]))
    assert stopped.finish_reason == "stop" and stopped.text == full[:full.index(word)]
    streamed = "".join(e.text for e in llm.stream([llm.chat_prompt(PARIS)], p))
    assert streamed == full


def test_batch_equals_single(llm):
    prompts = ["Hi", "Tell me a long story about a dragon who lives in a castle by the sea.", "1+1="]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = llm.generate(prompts, p)
    for prompt, r in zip(prompts, batched):
        assert llm.generate(prompt, p)[0].token_ids == r.token_ids


def test_default_dtype_answers_alike_alone_and_in_a_padded_batch():
    """The default path (bfloat16 on CPUs that have it, 8-bit activations) keeps a float32
    residual stream, so padding a prompt does not flip a near-tie in its answer: this one's
    first token is one ("The" against "L" on the float path, whose answer, Paris, is
    test_answers_paris's)."""
    llm = LLM("smollm2")
    other = [{"role": "user", "content": "Write a haiku about the sea, then explain each line."}]
    assert len(llm.chat_prompt(other)) > len(llm.chat_prompt(PARIS))  # PARIS is the padded one
    p = SamplingParams(max_tokens=16, temperature=0)
    alone = llm.chat(PARIS, p)
    padded = llm.chat([PARIS, other], p)[0]
    assert padded.token_ids == alone.token_ids
