"""tiergen against transformers on tiny random models: same greedy tokens, close logits."""

from __future__ import annotations

import pytest
import torch

from tiergen import LLM, SamplingParams
from tiergen.cache.step import StepMeta

from tiny_models import CASES, build

# Very different lengths, including a single token; the longest runs past llama3-rope's
# original context of 16.
PROMPTS = [[5], list(range(3, 40)), [7, 8, 9, 10, 11], list(range(50, 70)), [100, 3, 17]]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, directory)
    return request.param, directory, hf


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers generate on a left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def test_greedy_tokens_match_transformers(case):
    name, directory, hf = case
    llm = LLM(directory, dtype="float32")
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                   ignore_eos=True))
    expected = hf_greedy(hf, PROMPTS, NEW_TOKENS)
    for r, e in zip(results, expected):
        assert r.token_ids == e
        assert r.finish_reason == "length" and r.num_generated_tokens == NEW_TOKENS


def test_logits_match_transformers(case):
    """Prefill logits of the last prompt token and one decode step, for every prompt."""
    name, directory, hf = case
    llm = LLM(directory, dtype="float32")
    ex = llm.executor
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    valid = torch.zeros(len(PROMPTS), width + 1, dtype=torch.bool)
    for row, p in enumerate(PROMPTS):
        ids[row, width - len(p):] = torch.tensor(p)
        valid[row, width - len(p):] = True
    cache = ex.new_cache(len(PROMPTS), width + 1)
    prefill = ex.forward(ids, StepMeta.build(valid, 0, width), cache)
    nxt = torch.full((len(PROMPTS), 1), 42)
    decode = ex.forward(nxt, StepMeta.build(valid, width, 1), cache)
    for row, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p + [42]])).logits[0]
        torch.testing.assert_close(prefill[row].cpu(), ref[-2], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[row].cpu(), ref[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_batch1_matmuls_match_eager(tmp_path):
    from tiergen.models import layers

    build("llama-gqa-tied", tmp_path)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    eager = LLM(tmp_path, dtype="float32")
    expected = eager.generate([[5, 6, 7]], p)[0].token_ids
    try:
        compiled = LLM(tmp_path, dtype="float32", compile=True)
        assert layers._compiled_gemv is not None
        assert compiled.generate([[5, 6, 7]], p)[0].token_ids == expected
    finally:
        layers.use_compiled_gemv(False)


@pytest.mark.parametrize("name, extra", [
    ("Qwen2Config", dict(max_window_layers=2)),
    ("Qwen3Config", dict(max_window_layers=1)),
    ("Qwen2MoeConfig", dict(max_window_layers=3)),
    ("Qwen3MoeConfig", dict()),
    ("Qwen2Config", dict(max_window_layers=2, use_sliding_window=False)),
])
def test_qwen_sliding_layers_are_those_transformers_slides(name, extra):
    """use_sliding_window with max_window_layers: each layer's window as transformers sets it."""
    import transformers

    from tiergen.config import from_hf_config

    hf = getattr(transformers, name)(num_hidden_layers=5, **{
        "use_sliding_window": True, "sliding_window": 16, **extra})
    cfg = from_hf_config({**hf.to_dict(), "layer_types": None,
                          "architectures": [name.replace("Config", "ForCausalLM")]})
    want = [hf.sliding_window if getattr(hf, "layer_types", None) is None
            or hf.layer_types[i] == "sliding_attention" else None for i in range(5)]
    want = [w or None for w in want]  # Qwen2-MoE writes 0 for "no window"
    assert [cfg.window(i) for i in range(5)] == want
    assert any(want) == hf.use_sliding_window
