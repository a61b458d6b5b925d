"""Compressed weights and KV cache, and sparse attention, through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.errors import TiergenError
from tiny_models import build
from test_offload import PROMPTS, prefill_and_decode_logits

TEXT = (Path(__file__).parent / "data" / "perplexity.txt").read_text()
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama-gqa-tied", "mistral-window", "deepseek-v2"])
def tiny(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    build(request.param, directory)
    return directory


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_policies_agree_across_tiers(tiny, bits, tmp_path):
    """The same compressed weights and cache give the same results wherever they live."""
    opts = dict(compress_weights=True, compress_cache=True, compress_bits=bits,
                compress_group_size=32, offload_dir=tmp_path)
    on_device = LLM(tiny, dtype="float32", policy=Policy(**opts))
    spread = LLM(tiny, dtype="float32", policy=Policy(weights=(20, 30), cache=(30, 30),
                                                      gpu_batch_size=2, num_gpu_batches=2, **opts))
    assert ([r.token_ids for r in spread.generate(PROMPTS, GREEDY)]
            == [r.token_ids for r in on_device.generate(PROMPTS, GREEDY)])
    for a, b in zip(prefill_and_decode_logits(spread), prefill_and_decode_logits(on_device)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compression_changes_logits_boundedly(tiny):
    """8-bit compression moves logits a little; 4-bit more; neither leaves them unchanged."""
    dense = prefill_and_decode_logits(LLM(tiny, dtype="float32"))[0]
    errors = {}
    for bits in (8, 4):
        policy = Policy(compress_weights=True, compress_cache=True, compress_bits=bits,
                        compress_group_size=32)
        errors[bits] = (prefill_and_decode_logits(LLM(tiny, dtype="float32", policy=policy))[0]
                        - dense).abs().max().item()
    assert 0 < errors[8] < errors[4]
    assert errors[8] < 0.05 * dense.abs().max().item()


def test_compressed_weights_take_a_quarter_of_the_bytes(tiny):
    dense = LLM(tiny, dtype="float32").executor.weight_plan
    packed = LLM(tiny, dtype="float32",
                 policy=Policy(compress_weights=True, compress_group_size=32)).executor
    plan = packed.weight_plan
    for j, layer in enumerate(packed.weights.resident):
        stored = sum(t.nbytes for t in layer.values())
        assert stored == sum(plan.nbytes(j, n) for n in plan.shapes[j])
    matrices = [(j, n) for j in range(len(plan.shapes)) for n in plan.shapes[j]
                if plan.compressed(j, n)]
    assert matrices
    ratio = sum(plan.nbytes(j, n) for j, n in matrices) / sum(dense.nbytes(j, n) for j, n in matrices)
    assert 0.125 < ratio < 0.2  # 4 bits of 32 plus a float32 scale and minimum per 32


def test_cache_compression_shrinks_the_cache(tiny):
    dense = LLM(tiny, dtype="float32").executor.new_cache(2, 16)
    packed = LLM(tiny, dtype="float32", policy=Policy(compress_cache=True)).executor.new_cache(2, 16)
    d = sum(t.nbytes for t in dense.layers)
    p = sum(t.nbytes for t in packed.layers)
    assert p < 0.3 * d
    dense.close()
    packed.close()


def test_sparsity_one_equals_dense_exactly(tiny):
    dense = prefill_and_decode_logits(LLM(tiny, dtype="float32"))
    full = prefill_and_decode_logits(LLM(tiny, dtype="float32", policy=Policy(attn_sparsity=1.0)))
    for a, b in zip(dense, full):
        assert torch.equal(a, b)


def test_sparse_attention_keeps_the_largest_weights():
    from tiergen.cache.attention import attention

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    dense = attention(q, k, v, None)
    assert torch.allclose(attention(q, k, v, None, sparsity=1.0), dense)
    # keeping every key (ceil(0.95 * 10) = 10) is dense again, up to rounding
    torch.testing.assert_close(attention(q, k, v, None, sparsity=0.95), dense)
    # keeping one key returns that key's value row exactly
    scores = (q.view(2, 2, 2, 8) @ k.transpose(-1, -2))
    best = scores.argmax(-1)  # (2, 2, 2)
    one = attention(q, k, v, None, sparsity=0.01).view(2, 2, 2, 8)
    expected = torch.stack([torch.stack([v[b, h, best[b, h]] for h in range(2)]) for b in range(2)])
    torch.testing.assert_close(one, expected)


def test_bad_compression_settings_are_refused():
    with pytest.raises(TiergenError, match="compress_bits must be 4 or 8"):
        Policy(compress_weights=True, compress_bits=3)
    with pytest.raises(TiergenError, match="compress_group_size"):
        Policy(compress_cache=True, compress_group_size=7)
    with pytest.raises(TiergenError, match="attn_sparsity"):
        Policy(attn_sparsity=0)
    with pytest.raises(TiergenError, match="choose one"):
        Policy(cache=(0, 100), cpu_attention=True, compress_cache=True)


@pytest.mark.slow
def test_smollm2_perplexity_under_compression_and_sparsity():
    """The packaged SmolLM2 (a Q4_1 GGUF: 4-bit blocks of 32) on a fixed public-domain text.

    Bounds: 8-bit weights and cache < 1 % above dense; 4-bit weights in groups of 32 (the
    checkpoint's own blocks) and a 4-bit cache < 10 %; sparse decode attention keeping half
    the weights < 15 % (measured token by token, the way decode runs).
    """
    base = LLM("smollm2", dtype="float32").perplexity(TEXT)
    eight = LLM("smollm2", dtype="float32", policy=Policy(
        compress_weights=True, compress_cache=True, compress_bits=8)).perplexity(TEXT)
    assert eight < base * 1.01
    four = LLM("smollm2", dtype="float32", policy=Policy(
        compress_weights=True, compress_cache=True, compress_group_size=32))
    assert four.perplexity(TEXT) < base * 1.10
    # the answer's first word is a near tie between two openings (about 0.05 nats apart, and
    # the integer path's rounding may pick either), so the answer is begun for the model
    prompt = four.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    prompt += four.tokenizer.encode("The capital of France is", add_special_tokens=False)
    answer = four.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].text
    assert "Paris" in answer
    head = TEXT[:1200]
    dense_decode = LLM("smollm2", dtype="float32", prefill_chunk_size=1).perplexity(head)
    sparse = LLM("smollm2", dtype="float32", prefill_chunk_size=1,
                 policy=Policy(attn_sparsity=0.5)).perplexity(head)
    assert dense_decode < sparse < dense_decode * 1.15
