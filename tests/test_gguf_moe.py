"""Mixture-of-experts models written as GGUF (llama.cpp's layout: routed experts stacked in
one tensor per projection) load to the same weights and tokens as their safetensors form,
and their quantised experts stay packed on every tier."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import safetensors.torch
import torch

from tiergen import LLM, Policy, SamplingParams, kernels
from tiergen.weights.moe_names import CHECKPOINT_NAMES
from tiergen.weights.gguf_map import DEEPSEEK2_LAYER_NAMES, DSA_LAYER_NAMES, MOE_NAMES
from tiergen.weights.packed import Packed
from gguf_writer import write_gguf
from test_gguf_model import HF_TO_GGUF, llama_cpp_permute
from test_offload import PROMPTS, prefill_and_decode_logits
from tiny_models import build

GGUF_ARCH = {"mixtral": "llama", "qwen2-moe": "qwen2moe", "qwen3-moe": "qwen3moe",
             "deepseek-v2": "deepseek2", "deepseek-v2-lite": "deepseek2", "deepseek-v3": "deepseek2",
             "gpt-oss": "gpt-oss", "gpt-oss-fused": "gpt-oss", "glm4-moe": "glm4moe",
             "glm4-moe-lite": "deepseek2", "minimax-m2": "minimax-m2", "deepseek-v32": "deepseek32",
             "glm-moe-dsa": "glm-dsa"}
LATENT = ("deepseek2", "deepseek32", "glm-dsa")
# llama.cpp converts GLM-4.7-Flash as DeepSeek-V3 ("deepseek2" with sigmoid gating)
GGUF_AS = {"glm4-moe-lite": "DeepseekV3ForCausalLM"}
# What a GGUF file cannot say: llama.cpp keeps DeepSeek's mscale equal to mscale_all_dim (as
# the released models have it) and RoPE pairs adjacent (rope_interleave), and gpt-oss's SwiGLU
# limit at the released 7.
OVERRIDES = {"deepseek-v2": dict(rope_parameters=dict(
                 rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                 mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1)),
             "deepseek-v3": dict(rope_interleave=True), "gpt-oss": dict(swiglu_limit=7.0)}
DEEPSEEK2_TO_GGUF = {f"{v}.weight": f"{k}.weight" for k, v in DEEPSEEK2_LAYER_NAMES.items()} | {
    "self_attn.k_b_proj.weight": "attn_k_b.weight", "self_attn.v_b_proj.weight": "attn_v_b.weight"}
DSA_TO_GGUF = {f"{v}.{kind}": f"{k}.{kind}" for k, v in DSA_LAYER_NAMES.items()
               for kind in ("weight", "bias")}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def moe_tensors(directory, names: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The checkpoint's tensors with each layer's routed experts stacked (E, ...) under a
    name of their own, and the layer-relative names of the MoE tensors in the GGUF file
    (``names``: the checkpoint names, tiergen.weights.moe_names.checkpoint_names)."""
    raw = safetensors.torch.load_file(directory / "model.safetensors")
    templates = {names[keys[0]]: (key, gguf_name) for gguf_name, keys in MOE_NAMES.items()
                 for key in keys if len(keys) == 1 and key in names}
    to_gguf = {t: g for t, (_, g) in templates.items() if "{e}" not in t}
    out, stacks = {}, {}
    for name, t in raw.items():
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        for template, (key, gguf_name) in templates.items():
            head, _, tail = template.partition("{e}")
            if tail and rest.startswith(head) and rest.endswith(tail):
                e = int(rest[len(head):-len(tail)])
                stacks.setdefault(f"model.layers.{layer}.{head}{key}", {})[e] = t
                to_gguf[f"{head}{key}"] = gguf_name
                break
        else:
            out[name] = t
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in sorted(experts)])
    return out, to_gguf


def gpt_oss_tensors(directory, fused: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What llama.cpp's converter does to gpt-oss's experts (E, H, 2I), gate and up in
    alternate columns: gate (E, I, H) and up apart, or fused as (E, 2I, H) [gate; up]."""
    raw = safetensors.torch.load_file(directory / "model.safetensors")
    out = {}
    for name, t in raw.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t[..., ::2].mT, t[..., 1::2].mT
            parts = {"gate_up": torch.cat([gate, up], 1)} if fused else {"gate": gate, "up": up}
        elif name.endswith("experts.gate_up_proj_bias"):
            gate, up = t[..., ::2], t[..., 1::2]
            parts = ({"gate_up_bias": torch.cat([gate, up], -1)} if fused
                     else {"gate_bias": gate, "up_bias": up})
        elif name.endswith("experts.down_proj"):
            parts = {"down": t.mT}
        else:
            out[name] = t
            continue
        prefix = name.rpartition("experts.")[0] + "experts."
        out |= {prefix + k: v.contiguous() for k, v in parts.items()}
    to_gguf = {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
               "mlp.router.bias": "ffn_gate_inp.bias",
               "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    to_gguf |= {f"mlp.experts.{k}": f"ffn_{k.removesuffix('_bias')}_exps."
                + ("bias" if k.endswith("bias") else "weight")
                for k in ("gate", "up", "down", "gate_up", "gate_bias", "up_bias", "gate_up_bias")}
    return out, to_gguf


def split_kv_b(tensors: dict[str, torch.Tensor], c) -> None:
    """What llama.cpp's converter does to DeepSeek's kv_b: k_b (heads, rank, nope), transposed,
    and v_b (heads, v, rank)."""
    for name in [n for n in tensors if n.endswith("kv_b_proj.weight")]:
        kv_b = tensors.pop(name).view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        tensors[name.replace("kv_b", "k_b")] = k_b.transpose(1, 2).contiguous()
        tensors[name.replace("kv_b", "v_b")] = v_b.contiguous()


def deepseek2_metadata(w: gguf.GGUFWriter, c) -> None:
    w.add_kv_lora_rank(c.kv_lora_rank)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    deepseek_moe_metadata(w, c)


def deepseek_moe_metadata(w: gguf.GGUFWriter, c) -> None:
    """DeepSeek's routing keys, which GLM-4.5's converter writes too."""
    dense = getattr(c, "first_k_dense_replace", None)
    if dense is None:  # GLM-4.7-Flash: a type per layer
        dense = c.mlp_layer_types.index("sparse")
    w.add_leading_dense_block_count(dense)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    v3 = c.architectures[0] != "DeepseekV2ForCausalLM"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else
                             gguf.ExpertGatingFuncType.SOFTMAX)
    if (c.n_group or 1) > 1 and (v3 or c.topk_method == "group_limited_greedy"):
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_moe_gguf(hf, directory, case: str, path, qtype=gguf.GGMLQuantizationType.F32) -> None:
    c, arch = hf.config, GGUF_ARCH[case]
    if arch == "gpt-oss":
        tensors, to_gguf = gpt_oss_tensors(directory, fused=case.endswith("fused"))
    else:
        tensors, to_gguf = moe_tensors(directory, CHECKPOINT_NAMES[c.architectures[0]])
    if arch in LATENT:
        split_kv_b(tensors, c)
        to_gguf |= DEEPSEEK2_TO_GGUF | DSA_TO_GGUF
    if arch == "glm4moe":
        to_gguf |= {"post_attention_layernorm.weight": "post_attention_norm.weight"}
        # llama.cpp's converter counts the multi-token-prediction layer among the blocks
        mtp = c.num_hidden_layers
        tensors |= {f"model.layers.{mtp}.input_layernorm.weight": torch.ones(c.hidden_size),
                    f"model.layers.{mtp}.nextn.eh_proj.weight": torch.ones(c.hidden_size,
                                                                           2 * c.hidden_size)}
        to_gguf |= {"nextn.eh_proj.weight": "nextn.eh_proj.weight"}

    def change(gname: str, data: np.ndarray) -> np.ndarray:
        if arch == "llama" and ("attn_q." in gname or "attn_k." in gname):
            heads = c.num_attention_heads if "attn_q." in gname else c.num_key_value_heads
            return llama_cpp_permute(data, heads)
        if "ffn_gate_inp_shexp" in gname:
            return data.reshape(-1)  # llama.cpp reads it as a vector
        return data

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_expert_count(getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
                           or c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch in LATENT:
            deepseek2_metadata(w, c)
        if arch in ("deepseek32", "glm-dsa"):
            w.add_indexer_head_count(c.index_n_heads)
            w.add_indexer_key_length(c.index_head_dim)
            w.add_indexer_top_k(c.index_topk)
        if arch == "glm4moe":
            deepseek_moe_metadata(w, c)
            w.add_nextn_predict_layers(1)
        if arch in ("glm4moe", "minimax-m2"):
            w.add_rope_dimension_count(int(
                c.head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0)))
        if arch == "minimax-m2":
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        if arch == "gpt-oss":
            rope = c.rope_parameters
            w.add_sliding_window(c.sliding_window)
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            w.add_expert_feed_forward_length(c.intermediate_size)
        elif arch == "minimax-m2":
            w.add_expert_feed_forward_length(c.intermediate_size)
        elif arch != "llama":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)

    write_gguf(hf, arch, path, HF_TO_GGUF | to_gguf, c.rope_parameters["rope_theta"], qtype,
               change, metadata, tensors,
               block_count=c.num_hidden_layers + (arch == "glm4moe"))


@pytest.fixture(scope="module", params=sorted(GGUF_ARCH))
def moe_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    base = request.param.removesuffix("-fused")
    hf = build(base, directory / "hf", **OVERRIDES.get(base, {}))
    return request.param, hf, directory


def test_moe_gguf_loads_the_same_model(moe_model):
    case, hf, directory = moe_model
    path = directory / "f32.gguf"
    write_moe_gguf(hf, directory / "hf", case, path)
    from_dir, from_gguf = LLM(directory / "hf", dtype="float32"), LLM(path, dtype="float32")
    a, b = from_gguf.executor.cfg, from_dir.executor.cfg
    # (the GGUF keeps gpt-oss's gate and up rows apart, its checkpoint interleaves them)
    assert replace(a.moe, gate_up_interleaved=b.moe.gate_up_interleaved) == b.moe
    assert a.architecture == GGUF_AS.get(case, b.architecture)
    for field in ("num_layers", "layer_types", "sliding_window", "attention_sinks", "rotary_dim",
                  "qk_norm", "qk_norm_across_heads", "qkv_bias", "o_bias"):
        assert getattr(a, field) == getattr(b, field), field
    # (llama.cpp's converter splits DeepSeek's kv_b into k_b and v_b)
    assert a.mla == (b.mla and replace(b.mla, kv_b_split=True))
    for x, y in zip(prefill_and_decode_logits(from_gguf), prefill_and_decode_logits(from_dir)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert ([r.token_ids for r in from_gguf.generate(PROMPTS, GREEDY)]
            == [r.token_ids for r in from_dir.generate(PROMPTS, GREEDY)])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_quantised_experts_stay_packed_on_every_tier(moe_model, qtype, tmp_path):
    """A quantised GGUF's routed experts are multiplied packed: the same logits as the same
    blocks decoded at load, from the device, host RAM behind it, and disk."""
    case, hf, directory = moe_model
    path = directory / f"{qtype}.gguf"
    if not path.exists():
        write_moe_gguf(hf, directory / "hf", case, path, gguf.GGMLQuantizationType[qtype])
    packed = LLM(path, dtype="float32", activations="float32")
    experts = packed.executor.weights.take(1)["experts"]
    packed.executor.weights.release(1)
    assert isinstance(experts.gate_up, Packed) and experts.gate_up.type_names == qtype
    decoded = LLM(path, dtype="float32", packed=False)
    want = prefill_and_decode_logits(decoded)
    tokens = [r.token_ids for r in decoded.generate(PROMPTS, GREEDY)]
    for policy in ({}, dict(experts="disk"), dict(experts="host", weights=(0, 0))):
        llm = LLM(path, dtype="float32", activations="float32",
                  policy=Policy(**policy, offload_dir=tmp_path))
        for x, y in zip(prefill_and_decode_logits(llm), want):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens


def test_experts_on_disk_are_read_from_the_gguf(moe_model, tmp_path):
    """A quantised GGUF's routed experts on disk are read expert by expert from the file
    itself: nothing of them is converted into the offload directory."""
    case, hf, directory = moe_model
    path = directory / "Q8_0.gguf"
    if not path.exists():
        write_moe_gguf(hf, directory / "hf", case, path, gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(path, dtype="float32", policy=Policy(experts="disk", offload_dir=tmp_path))
    disk, cfg = llm.executor.weights.disk, llm.executor.cfg
    moe_layers = [j for j in range(cfg.num_layers) if cfg.is_moe_layer(j)]
    expected = {f"{j}/experts.{n}" for j in moe_layers for n in ("gate_up", "down")}
    if cfg.moe.expert_bias:
        expected |= {f"{j}/experts.{n}" for j in moe_layers for n in ("gate_up_bias", "down_bias")}
    assert set(disk.rows) == expected
    assert disk.converted is None or not expected & set(disk.converted.entries)
    llm.generate(PROMPTS, GREEDY)
    assert 0 < disk.rows_read


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_one_tokens_experts_in_one_call_equal_them_one_by_one(moe_model, activations, tmp_path,
                                                             monkeypatch):
    """A decode step of one row runs its routed experts in one native call where it can
    (packed, on the CPU, SwiGLU without biases), with DeepSeek's routing too where all its
    experts are at hand: the same tokens and log-probabilities, to the bit, as the experts
    run one by one, with the experts resident and read from disk (kept in a cache or not)."""
    import tiergen.models.moe as moe

    case, hf, directory = moe_model
    path = directory / "Q4_0.gguf"
    if not path.exists():
        write_moe_gguf(hf, directory / "hf", case, path, gguf.GGMLQuantizationType.Q4_0)
    calls, at_hand = [], []
    one_call, routed_too = moe.experts_row, moe.moe_row
    monkeypatch.setattr(moe, "experts_row", lambda *a: calls.append(1) or one_call(*a))

    def counted(*args):
        out = routed_too(*args)
        at_hand.append(out is not None and out[0] is not None)
        return out

    monkeypatch.setattr(moe, "moe_row", counted)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    for policy in ({}, dict(experts="disk"), dict(experts="disk", expert_cache="64M")):
        llm = LLM(path, dtype="float32", activations=activations, device="cpu",
                  policy=Policy(**policy, offload_dir=tmp_path))
        at_hand.clear()
        fused = llm.generate([PROMPTS[1]], params)[0]
        # with DeepSeek's routing, where the kernels take its experts (rows of whole blocks):
        # from the resident experts, or from disk once they were read and kept
        cfg = llm.executor.cfg
        j = next(j for j in range(cfg.num_layers) if cfg.is_moe_layer(j))
        experts = llm.executor.weights.take(j)["experts"]
        llm.executor.weights.release(j)
        takes = isinstance(experts.gate_up, Packed) and all(
            kernels.integer_kernels_take(m[0]) for m in (experts.gate_up, experts.down))
        kept = policy.get("experts") != "disk" or "expert_cache" in policy
        assert any(at_hand) == (cfg.moe.router_float32 and takes and kept)
        if "expert_cache" in policy:  # experts run from the cache count as its hits
            assert llm.executor.weights.expert_cache.hits >= cfg.moe.top_k * sum(at_hand)
        with monkeypatch.context() as m:
            m.setattr(moe, "_one_token", lambda *a, **k: None)
            m.setattr(moe, "_one_token_at_hand", lambda *a, **k: None)
            alone = llm.generate([PROMPTS[1]], params)[0]
        assert fused.token_ids == alone.token_ids
        assert [{t: p.logprob for t, p in e.items()} for e in fused.logprobs] == \
            [{t: p.logprob for t, p in e.items()} for e in alone.logprobs]
    # gpt-oss's experts have biases and a clamped SwiGLU: they run one by one
    assert bool(calls) == (not case.startswith("gpt-oss"))


@pytest.fixture(scope="module")
def deepseek_ggufs(tmp_path_factory):
    """A DeepSeek-V3 GGUF in Q8_0 and in Q4_0 whose k_b, q_b and experts' down rows
    (qk_nope_head_dim, q_lora_rank, moe_intermediate_size) are whole blocks, by type name."""
    directory = tmp_path_factory.mktemp("deepseek-blocks")
    hf = build("deepseek-v3", directory / "hf", rope_interleave=True, qk_nope_head_dim=32,
               q_lora_rank=64, moe_intermediate_size=32)
    paths = {}
    for qtype in ("Q8_0", "Q4_0"):
        paths[qtype] = directory / f"{qtype}.gguf"
        write_moe_gguf(hf, directory / "hf", "deepseek-v3", paths[qtype],
                       gguf.GGMLQuantizationType[qtype])
    return paths


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_deepseek_k_b_and_v_b_stay_packed(deepseek_ggufs, qtype, tmp_path, monkeypatch):
    """llama.cpp's k_b and v_b of a quantised DeepSeek GGUF (rows of whole blocks) are the
    absorbed attention's own matrices: they stay packed, on every tier, and are read from the
    file in place on disk. With float32 activations the logits equal the same blocks decoded
    at load; with int8 ones, each head's product in one grouped call gives what it gives
    alone."""
    path = deepseek_ggufs[qtype]
    decoded = LLM(path, dtype="float32", packed=False)
    want = prefill_and_decode_logits(decoded)
    tokens = [r.token_ids for r in decoded.generate(PROMPTS, GREEDY)]
    for policy in ({}, dict(weights=(0, 0), experts="disk")):
        llm = LLM(path, dtype="float32", activations="float32",
                  policy=Policy(**policy, offload_dir=tmp_path / "offload"))
        layer = llm.executor.weights.take(0)
        assert all(isinstance(layer[n], Packed) and layer[n].type_names == qtype
                   for n in ("k_b", "v_b"))
        llm.executor.weights.release(0)
        for x, y in zip(prefill_and_decode_logits(llm), want):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens
        llm.executor.model.absorb = False  # naive attention, k_b and v_b decoded
        for x, y in zip(prefill_and_decode_logits(llm), want):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
        if policy:  # nothing of the attention converted into the offload directory
            disk = llm.executor.weights.disk
            assert disk.converted is None or not any("_b" in k for k in disk.converted.entries)
    # int8 (the CPU's integer kernels): every head's product in one grouped call, as each alone
    import tiergen.models.deepseek_v2 as deepseek

    calls = []

    def one_by_one(x, w):
        calls.append(w.type_names)
        rows = w.data.view(len(x), -1)
        return torch.stack([kernels.integer_linear(x[g], Packed(rows[g], (w.shape[0] // len(x),
                            w.shape[1]), ((w.parts[0][0], w.shape[0] // len(x)),)), None,
                            *kernels.ACTIVATION_FORMATS["int8"]) for g in range(len(x))])

    int8 = LLM(path, dtype="float32", activations="int8", device="cpu")  # (CPU kernels)
    grouped = prefill_and_decode_logits(int8)
    monkeypatch.setattr(deepseek, "grouped_linear", one_by_one)
    for x, y in zip(grouped, prefill_and_decode_logits(int8)):
        assert torch.equal(x, y)
    assert calls and set(calls) == {qtype}


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) of the next-token distributions."""
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_deepseek_latent_attention_in_one_call(deepseek_ggufs, qtype, tmp_path, monkeypatch):
    """A decode step's latent attention in one native call (``tg_mla_attention``) computes
    what the attention run operation by operation computes, for a batch of prompts of
    different lengths, with the weights resident and streamed from disk: within float32
    rounding on the float path (float32 cache); with int16 and int8 activations (float16
    cache) as close to the float path (its rounding flips move a logit by up to ~5e-4 here)."""
    import tiergen.models.deepseek_v2 as deepseek

    calls, native = [], deepseek.mla_attention

    def counted(*args):
        out = native(*args)
        calls.append(out is not None)
        return out

    def by_operation(llm):
        with monkeypatch.context() as m:
            m.setattr(deepseek, "mla_attention", lambda *a: None)
            return prefill_and_decode_logits(llm)

    monkeypatch.setattr(deepseek, "mla_attention", counted)
    path = deepseek_ggufs[qtype]
    for policy in ({}, dict(weights=(0, 0), experts="disk")):
        llm = LLM(path, dtype="float32", activations="float32", device="cpu",
                  policy=Policy(**policy, offload_dir=tmp_path / "offload"))
        for got, want in zip(prefill_and_decode_logits(llm), by_operation(llm)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert calls and all(calls)
    exact = by_operation(LLM(path, dtype="float32", activations="float32", device="cpu"))

    def error(logits):  # the greatest difference from the float path
        return max((x - y).abs().max() for x, y in zip(logits, exact))

    int16 = LLM(path, dtype="float32", activations="int16", device="cpu")
    assert 0 < error(prefill_and_decode_logits(int16)) <= 1.5 * error(by_operation(int16))
    int8 = LLM(path, dtype="float32", activations="int8", device="cpu")
    fused = torch.cat([kl(x, y) for x, y in zip(exact, prefill_and_decode_logits(int8))])
    by_op = torch.cat([kl(x, y) for x, y in zip(exact, by_operation(int8))])
    assert 0 < fused.mean() < 1.5 * by_op.mean() + 1e-4, (fused.mean(), by_op.mean())


def test_deepseek_k_b_and_v_b_are_cut_by_heads_over_ranks(deepseek_ggufs):
    """Two tensor-parallel ranks take two heads each of the packed k_b and v_b."""
    path = deepseek_ggufs["Q8_0"]
    one = LLM(path, dtype="float32", activations="float32")
    with LLM(path, dtype="float32", activations="float32", tensor_parallel=2) as llm:
        assert ([r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
                == [r.token_ids for r in one.generate(PROMPTS, GREEDY)])
        torch.testing.assert_close(llm.logits(PROMPTS[1]), one.logits(PROMPTS[1]),
                                   rtol=1e-4, atol=1e-4)
        layer = llm.executor.weights.take(0)
        llm.executor.weights.release(0)
        assert isinstance(layer["k_b"], Packed) and layer["k_b"].shape == (2 * 32, 32)


def numbers_alone_and_in_a_batch(path) -> tuple[list, list]:
    """Each prompt's greedy tokens and log-probabilities (generated and prompt) alone and
    among every prompt, batch invariant on the integer path: the longest as it is, the others
    left-padded (and past gpt-oss's sliding window of 8, its ring's turn moved by the
    padding)."""
    llm = LLM(path, dtype="float32", activations="int8", device="cpu", batch_invariant=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)

    def numbers(r):
        return r.token_ids, repr(r.logprobs), repr(r.prompt_logprobs)

    return ([numbers(llm.generate([p], params)[0]) for p in PROMPTS],
            [numbers(r) for r in llm.generate(PROMPTS, params)])


def test_batch_invariant_experts_give_a_prompt_the_same_numbers_alone_and_in_a_batch(
        moe_model, tmp_path, request):
    """Alone, a token's experts each multiply one row; in a batch, as many as chose them:
    batch invariant, the row's numbers are the same to the bit (one token's experts then go
    operation by operation, as several tokens' do, and float routers multiply each row alone)."""
    case, hf, directory = moe_model
    path = tmp_path / "q4_0.gguf"
    write_moe_gguf(hf, directory / "hf", case, path, gguf.GGMLQuantizationType.Q4_0)
    alone, batched = numbers_alone_and_in_a_batch(path)
    assert alone == batched


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_batch_invariant_latent_attention_gives_a_prompt_the_same_numbers_alone_and_in_a_batch(
        deepseek_ggufs, qtype):
    """DeepSeek's absorbed attention multiplies one query row per head (grouped products)."""
    alone, batched = numbers_alone_and_in_a_batch(deepseek_ggufs[qtype])
    assert alone == batched
