"""Gemma 3 (Gemma3ForCausalLM) against transformers: tiny random models with small windows,
a tiny GGUF written as llama.cpp would, and the packaged Gemma 3 270M Q4_K_M GGUF (slow);
plus the context length of models whose every layer is windowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tiergen import LLM, SamplingParams
from tiergen.config import UNLIMITED_CONTEXT, from_hf_config
from tiergen.cache.step import StepMeta
from tiergen.errors import TiergenError
from tiergen.weights.gguf_map import GEMMA3_LAYER_NAMES, GLOBAL_NAMES
from gguf_writer import write_gguf

PROSE = Path(__file__).with_name("data") / "perplexity.txt"
from test_parity import hf_greedy
from tiny_models import build

GEMMA_CASES = {"gemma3-window4": 4, "gemma3-window8-linear": 8}
# Shorter than both windows, and much longer (37 and 50 tokens); a batch of mixed lengths.
PROMPTS = [[5], list(range(3, 40)), [7, 8, 9], list(range(60, 110))]


@pytest.fixture(scope="module", params=sorted(GEMMA_CASES))
def case(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return GEMMA_CASES[request.param], directory, build(request.param, directory)


def test_config_windows_and_rope(case):
    window, directory, hf = case
    cfg = LLM(directory, dtype="float32").config
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert cfg.layer_types == hf.config.layer_types
    for i, kind in enumerate(hf.config.layer_types):
        assert cfg.window(i) == (window if kind == "sliding_attention" else None)
        want = hf.config.rope_parameters[kind]
        assert cfg.layer_rope(i).theta == want["rope_theta"]
        assert cfg.layer_rope(i).kind == want["rope_type"]
    assert cfg.context_length == hf.config.max_position_embeddings  # it has global layers


def test_greedy_runs_far_past_the_window(case):
    """Generation of 3x the window and more, from prompts on both sides of it, batched."""
    window, directory, hf = case
    new = 3 * window + 4
    results = LLM(directory, dtype="float32").generate(
        PROMPTS, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    assert [r.token_ids for r in results] == hf_greedy(hf, PROMPTS, new)


def test_logits_every_step(case):
    """Prefill and 3x-window decode steps of a left-padded batch: every step's logits within
    1e-4 of one transformers forward over the whole sequence."""
    window, directory, hf = case
    ex = LLM(directory, dtype="float32").executor
    steps = 3 * window
    fed = torch.randint(0, 128, (steps,), generator=torch.Generator().manual_seed(0)).tolist()
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    valid = torch.zeros(len(PROMPTS), width + steps, dtype=torch.bool)
    for row, p in enumerate(PROMPTS):
        ids[row, width - len(p):] = torch.tensor(p)
        valid[row, width - len(p):] = True
    cache = ex.new_cache(len(PROMPTS), width + steps)
    got = [ex.forward(ids, StepMeta.build(valid, 0, width), cache)]
    for s, token in enumerate(fed[:-1]):
        got.append(ex.forward(torch.full((len(PROMPTS), 1), token),
                              StepMeta.build(valid, width + s, 1), cache))
    got = torch.stack(got, dim=1).cpu()  # (B, steps, V)
    for row, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([p + fed[:-1]])).logits[0, len(p) - 1:]
        torch.testing.assert_close(got[row], ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_runs_close_to_float32(case):
    window, directory, hf = case
    prompts = [[5], list(range(3, 40))]
    p = SamplingParams(max_tokens=2 * window, temperature=0, ignore_eos=True)
    results = LLM(directory, dtype="bfloat16").generate(prompts, p)
    assert all(r.num_generated_tokens == 2 * window for r in results)


LEGACY = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=128,
              hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
              sliding_window=16, sliding_window_pattern=3, rope_theta=1000000.0,
              rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
              query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")


def test_legacy_config_follows_transformers():
    """A transformers-4 config.json (sliding_window_pattern, rope_local_base_freq, rope_scaling)
    reads as transformers 5 reads it."""
    cfg = from_hf_config(LEGACY)
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in LEGACY.items() if k != "architectures"})
    assert cfg.layer_types == ref.layer_types
    assert [cfg.window(i) for i in range(7)] == [16 if t == "sliding_attention" else None
                                                 for t in ref.layer_types]
    glob, local = ref.rope_parameters["full_attention"], ref.rope_parameters["sliding_attention"]
    assert (cfg.rope.kind, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, glob["rope_theta"])
    assert (cfg.rope_local.kind, cfg.rope_local.theta) == ("default", local["rope_theta"])
    assert cfg.tie_word_embeddings and cfg.qk_norm


@pytest.mark.parametrize("change, message", [
    (dict(attn_logit_softcapping=50.0), "attention logit softcapping"),
    (dict(hidden_activation="relu"), "hidden activation 'relu'"),
    (dict(use_bidirectional_attention=True), "bidirectional"),
    (dict(layer_types=["full_attention"] * 3), "layer_types names 3 layers"),
    (dict(layer_types=["sliding_attention"] * 6 + ["chunked_attention"]), "chunked_attention"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(TiergenError, match=message):
        from_hf_config(LEGACY | change)


# -- context length of all-windowed models -------------------------------------------------

def test_all_windowed_model_takes_prompts_past_max_position(tmp_path):
    hf = build("mistral-window", tmp_path)  # window 8 on every layer, max_position 256
    llm = LLM(tmp_path, dtype="float32")
    assert llm.config.context_length == UNLIMITED_CONTEXT
    prompt = [(7 * i) % 120 + 3 for i in range(300)]
    r = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert r.token_ids == hf_greedy(hf, [prompt], 6)[0]


def test_full_attention_model_refuses_prompts_past_max_position(tmp_path):
    build("mistral", tmp_path)  # no window
    llm = LLM(tmp_path, dtype="float32")
    assert llm.config.context_length == 256
    with pytest.raises(TiergenError, match="exceeds the model's context of 256"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=4))


# -- GGUF, as llama.cpp's converter writes Gemma 3 -----------------------------------------

HF_TO_GGUF = {v: k for k, v in GLOBAL_NAMES.items()} | {
    f"{v}.weight": f"{k}.weight" for k, v in GEMMA3_LAYER_NAMES.items()}


def write_gemma3_gguf(hf, path) -> None:
    """llama.cpp's convert_hf_to_gguf.py for Gemma 3: norms stored as 1 + w, q/k rows kept
    (NEOX RoPE), tied embeddings, local RoPE base and layer pattern left to llama.cpp."""
    c = hf.config
    write_gguf(hf, "gemma3", path, HF_TO_GGUF, c.rope_parameters["full_attention"]["rope_theta"],
               transform=lambda gname, data: data + 1 if gname.endswith("norm.weight") else data,
               metadata=lambda w: w.add_sliding_window(c.sliding_window))


def test_gguf_loads_same_model(tmp_path):
    # llama.cpp's defaults for Gemma 3: every 6th layer global, local RoPE base 10000,
    # attention scaled by head_dim**-0.5.
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=256, sliding_window=4, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.15))
    hf.save_pretrained(tmp_path / "hf")
    write_gemma3_gguf(hf, tmp_path / "model.gguf")
    from_dir = LLM(tmp_path / "hf", dtype="float32")
    from_gguf = LLM(tmp_path / "model.gguf", dtype="float32")
    a, b = from_gguf.config, from_dir.config
    for f in ("architecture", "layer_types", "sliding_window", "rope", "rope_local",
              "query_pre_attn_scalar", "hidden_act", "tie_word_embeddings", "qk_norm"):
        assert getattr(a, f) == getattr(b, f), f
    for x, y in zip(from_gguf.executor.weights.resident, from_dir.executor.weights.resident):
        for k in y:
            torch.testing.assert_close(x[k], y[k], atol=1e-6, rtol=0)  # (w + 1) - 1 rounds
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5], list(range(3, 30))]
    assert ([r.token_ids for r in from_gguf.generate(prompts, p)]
            == hf_greedy(hf, prompts, 16))


# -- the packaged Gemma 3 270M (base) Q4_K_M GGUF ------------------------------------------

@pytest.fixture(scope="module")
def gemma_path():
    from tiergen.weights import _packaged_file

    try:
        return _packaged_file("gemma3-270m")
    except TiergenError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gemma(gemma_path) -> LLM:
    return LLM("gemma3-270m", dtype="float32", activations="float32")  # the float path


@pytest.fixture(scope="module")
def gemma_hf(gemma_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32)
    return model.eval()


def _last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    cache = llm.executor.new_cache(1, len(ids))
    valid = torch.ones(1, len(ids), dtype=torch.bool)
    return llm.executor.forward(torch.tensor([ids]), StepMeta.build(valid, 0, len(ids)), cache)[0]


@pytest.mark.slow
def test_gemma_270m_logits_match_transformers(gemma, gemma_hf):
    """The same dequantised weights in float32: only the order of operations differs
    (measured: 6e-6 on logits of magnitude ~20)."""
    short = gemma.tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is")
    # past the 512-token window of the local layers: their ring cache is in play
    long = gemma.tokenizer.encode(" ".join(f"item {i} costs {i * 7 % 13} euros." for i in range(90)))
    assert len(long) > 600
    for ids in (short, long):
        with torch.no_grad():
            ref = gemma_hf(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(_last_logits(gemma, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_gemma_270m_long_prompt_in_32_chunks_logits_match_transformers(gemma, gemma_hf):
    """A 4k-token prompt fed in 32 chunks through the cache (each chunk's attention merged from
    a pass over the earlier slots and a causal pass within itself) against one transformers
    forward; past the 512-token window of the local layers eight times over."""
    words = " ".join(f"entry {i}: the {('red', 'green', 'blue')[i % 3]} box holds {i * 37 % 101} "
                     f"stones." for i in range(600))
    ids = gemma.tokenizer.encode(words)[:4096]
    assert len(ids) == 4096
    chunk = len(ids) // 32
    cache = gemma.executor.new_cache(1, len(ids))
    valid = torch.ones(1, len(ids), dtype=torch.bool)
    try:
        for start in range(0, len(ids), chunk):
            piece = torch.tensor([ids[start:start + chunk]])
            ours = gemma.executor.forward(piece, StepMeta.build(valid, start, piece.shape[1]),
                                          cache)[0]
    finally:
        cache.close()
    with torch.no_grad():
        ref = gemma_hf(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert ours.argmax() == ref.argmax()


@pytest.mark.slow
def test_gemma_270m_greedy_matches_transformers(gemma, gemma_hf):
    ids = gemma.tokenizer.encode("The capital of France is")
    ours = gemma.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = gemma_hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                do_sample=False)
    assert ours.token_ids == ref[0, len(ids):].tolist()
    assert "Paris" in ours.text or "capital" in ours.text


@pytest.mark.slow
def test_gemma_270m_tokenizer_matches_transformers(gemma, gemma_path):
    ref = transformers.AutoTokenizer.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name)
    texts = ["The capital of France is", "  two leading spaces\nand a newline\n\n",
             "Ünïcödé — 東京 🙂 naïve café", "x = f(1234567) + 3.14159", "<start_of_turn>user"]
    for text in texts:
        assert gemma.tokenizer.encode(text) == ref(text).input_ids, text
        assert gemma.tokenizer.decode(ref(text).input_ids) == ref.decode(
            ref(text).input_ids, skip_special_tokens=True), text


@pytest.mark.slow
def test_gemma_270m_base_model_refuses_chat(gemma):
    with pytest.raises(TiergenError, match="no chat template"):
        gemma.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=4))


@pytest.mark.slow
def test_gemma_270m_integer_path_takes_prompts_past_its_window(gemma_path):
    """Its local layers' rolling cache holds float16 on the integer path: a prompt chunk past
    the window (512) writes into it (a float32 chunk once went in unconverted)."""
    llm = LLM("gemma3-270m", activations="int8")
    ids = llm.encode(PROSE.read_text())[:700]
    assert llm.logits(ids).shape == (700, llm.config.vocab_size)
    r = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(r.token_ids) == 4

