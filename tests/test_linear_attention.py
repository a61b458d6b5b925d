"""Linear attention (Qwen3-Next's Gated DeltaNet) beyond parity: the chunked delta rule
against the recurrent one, a state's bytes per sequence (not per token) in the budget and
the cache, and prompts longer than a chunk of the rule and of a prefill."""

from __future__ import annotations

import pytest
import torch
import transformers

from tiergen import LLM, Policy, SamplingParams, TiergenError
from tiergen.config import from_hf_config
from tiergen.models.qwen3_next import CHUNK, delta_rule
from tiergen.offload.kv import TieredKV, cache_needs
from tiny_models import BASE, CASES, build


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_the_chunked_delta_rule_is_the_recurrent_one_token_by_token(per_channel):
    """Qwen3-Next's decay per head, Kimi's per key channel (steep, as trained ones are)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, dk, dv = 2, 2 * CHUNK + 21, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
            for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=g)
    decay = -torch.rand(B, T, H, dk, generator=g) * 8 if per_channel else \
        -torch.rand(B, T, H, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    S0 = torch.randn(B, H, dk, dv, generator=g)
    out, S = delta_rule(q, k, v, decay, beta, S0)
    state, steps = S0, []
    for t in range(T):  # plainly: S <- S e^g; S += k (beta (v - S^T k))^T; o = S^T q
        d = decay[:, t].exp()
        state = state * (d[..., None] if per_channel else d[..., None, None])
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t],
                                     beta[:, t, :, None] * (v[:, t] - recalled))
        steps.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    torch.testing.assert_close(out, torch.stack(steps, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, state, atol=1e-5, rtol=1e-5)
    one, S1 = delta_rule(q[:, :1], k[:, :1], v[:, :1], decay[:, :1], beta[:, :1], S0)
    torch.testing.assert_close(one[:, 0], steps[0], atol=1e-6, rtol=1e-6)


def test_a_state_is_counted_per_sequence_not_per_token(tmp_path):
    build("qwen3-next", tmp_path)
    cfg = LLM(tmp_path, dtype="float32").config
    tiers = ["device"] * cfg.num_layers
    short, long = (cache_needs(cfg, torch.float32, tiers, [(3, n)], "cpu")["device"]
                   for n in (10, 1010))
    attention = sum(not cfg.keeps_state(j) for j in range(cfg.num_layers))
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * 3 * attention
    assert long - short == 1000 * per_token  # the states do not grow
    states = sum(map(cfg.keeps_state, range(cfg.num_layers)))
    assert short == 10 * per_token + states * 3 * cfg.linear.state_numel * 4
    cache = TieredKV(cfg, 3, 10, torch.float32, torch.device("cpu"), tiers, None)
    assert cache.nbytes == short
    cache.close()


@pytest.mark.parametrize("case", ["qwen3-next", "kimi-linear"])
def test_long_prompts_across_chunks_and_tiers(tmp_path, case):
    """Prompts longer than a chunk of the delta rule, in prefill chunks of 48 tokens, with
    the states on disk: the tokens and logits of one prefill with everything resident, and
    transformers' logits."""
    hf = build(case, tmp_path / "hf", max_position_embeddings=512)
    prompts = [[(5 * i) % 120 + 3 for i in range(150)], [(7 * i) % 120 + 3 for i in range(90)]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLM(tmp_path / "hf", dtype="float32")
    want = [r.token_ids for r in plain.generate(prompts, params)]
    chunked = LLM(tmp_path / "hf", dtype="float32", prefill_chunk_size=48,
                  policy=Policy(cache=(0, 0), offload_dir=tmp_path / "off"))
    assert [r.token_ids for r in chunked.generate(prompts, params)] == want
    torch.testing.assert_close(chunked.logits(prompts[0]), plain.logits(prompts[0]),
                               atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # three chunks of the delta rule, as transformers computes them
        ref = hf(torch.tensor(prompts[:1])).logits[0]
    torch.testing.assert_close(plain.logits(prompts[0]).reshape(ref.shape[0], -1)[-1], ref[-1],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["qwen3.5", "qwen3.5-moe"])
def test_an_image_and_text_checkpoint_runs_its_text_model(tmp_path, case):
    """Qwen3.5 as released: ``...ForConditionalGeneration`` with a vision tower and the text
    model under ``model.language_model.``. Its text model (multimodal rotary, whose three
    position rows are equal for text, so plain rotary) against transformers' whole model, on
    prompts of different lengths."""
    wrapper = {"qwen3.5": "Qwen3_5Config", "qwen3.5-moe": "Qwen3_5MoeConfig"}[case]
    text = BASE | CASES[case][1] | dict(head_dim=32, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
        mrope_interleaved=True, mrope_section=[2, 1, 1]))
    config = getattr(transformers, wrapper)(text_config=text, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    hf = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    hf.eval().save_pretrained(tmp_path)
    llm = LLM(tmp_path, dtype="float32")
    assert llm.config.architecture == CASES[case][0].replace("TextConfig", "ForCausalLM")
    prompts = [[5, 9, 17, 3, 44, 8, 2, 71, 30], [12, 6, 90]]
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(llm.logits(prompt).reshape(ref.shape), ref,
                                   atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = [r.token_ids for r in llm.generate(prompts, params)]
    for prompt, tokens in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()


def test_kimi_linear_as_released_reads_its_own_config_names():
    """Kimi-Linear-48B-A3B's config.json: its layer types in linear_attn_config (1-based),
    DeepSeek-V3's fields under Kimi's names."""
    full = [4, 8, 12, 16, 20, 24, 27]
    cfg = from_hf_config({
        "architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840, "hidden_size": 2304,
        "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_hidden_layers": 27,
        "num_attention_heads": 32, "num_key_value_heads": 32, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "num_experts": 256, "num_experts_per_token": 8,
        "num_shared_experts": 1, "moe_renormalize": True, "num_expert_group": 1,
        "topk_group": 1, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
        "moe_router_activation_func": "sigmoid", "model_max_length": 1048576,
        "linear_attn_config": {"full_attn_layers": full, "head_dim": 128, "num_heads": 32,
                               "short_conv_kernel_size": 4,
                               "kda_layers": [i for i in range(1, 28) if i not in full]}})
    assert [j + 1 for j in range(27) if not cfg.keeps_state(j)] == full
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.shared_intermediate_size) == (256, 8, 1024)
    assert cfg.moe.dense_layers == [0] and cfg.moe.scoring == "sigmoid"
    assert cfg.max_position == 1048576 and not cfg.mla.rotary
    assert cfg.linear.state_numel == 3 * 4096 * 3 + 32 * 128 * 128
    with pytest.raises(TiergenError, match="moe_router_activation_func"):
        from_hf_config({"architectures": ["KimiLinearForCausalLM"], "num_hidden_layers": 2,
                        "moe_router_activation_func": "softmax"})
