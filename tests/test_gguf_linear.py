"""Qwen3-Next, Qwen3.5 and Kimi-Linear written as GGUF the way llama.cpp's converter writes
them (q, k, v in one and z apart, A_log as -exp(A_log), norms as 1 + w, Qwen3.5's value heads
tiled; Kimi's convolutions as (1, channels, 1, kernel), its latent attention's kv_b split and
each layer's kind in head_count_kv) load to the same model as their checkpoints, and their
matrices stay packed."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from tiergen import LLM, SamplingParams
from tiergen.weights.moe_names import CHECKPOINT_NAMES
from tiergen.weights.packed import Packed
from gguf_writer import write_gguf
from test_gguf_model import HF_TO_GGUF
from test_gguf_moe import DEEPSEEK2_TO_GGUF, moe_tensors, split_kv_b
from test_offload import PROMPTS, prefill_and_decode_logits
from tiny_models import build

GGUF_ARCH = {"qwen3-next": "qwen3next", "qwen3.5": "qwen35", "qwen3.5-moe": "qwen35moe",
             "kimi-linear": "kimi-linear"}
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
# the names of the attention layers' tensors and of the MLPs' (checkpoint -> GGUF)
PLAIN = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "post_attention_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}


def tiled(t: torch.Tensor, nk: int, r: int, width: int, dim: int = 0) -> torch.Tensor:
    """llama.cpp's Qwen3.5 value-head order: head g * r + i moves to i * nk + g."""
    t = t.movedim(dim, 0)
    rest = t.shape[1:]
    t = t.reshape(nk, r, width, *rest).transpose(0, 1).reshape(nk * r * width, *rest)
    return t.movedim(0, dim).contiguous()


def converted(hf, directory, case: str) -> dict[str, torch.Tensor]:
    """The GGUF tensors, by "model.layers.N.<GGUF name>" (and the global names)."""
    c = hf.config
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    hk, hv, r = c.linear_key_head_dim, c.linear_value_head_dim, nv // nk
    tensors, moe_names = moe_tensors(directory, CHECKPOINT_NAMES.get(c.architectures[0], {}))
    out = {}
    for name, t in tensors.items():
        if not name.startswith("model.layers."):
            out[name] = t + 1 if name == "model.norm.weight" else t
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        p = f"model.layers.{layer}."
        if rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
            t = t + 1
        if not rest.startswith("linear_attn."):
            out[p + (PLAIN.get(rest) or moe_names[rest])] = t
            continue
        part = rest.removeprefix("linear_attn.")
        if case == "qwen3-next":  # q, k, v, z grouped by key head: apart
            if part == "in_proj_qkvz.weight":
                q, k, v, z = t.view(nk, 2 * hk + 2 * r * hv, -1).split([hk, hk, r * hv, r * hv], 1)
                out[p + "attn_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
                out[p + "attn_gate.weight"] = z.reshape(-1, t.shape[1])
                continue
            names = {"in_proj_ba.weight": "ssm_ba.weight"}
        else:  # each apart, value heads tiled
            v_rows = slice(2 * nk * hk, None)
            if part in ("in_proj_qkv.weight", "conv1d.weight"):
                t = t.squeeze(1) if part == "conv1d.weight" else t
                t = torch.cat([t[:2 * nk * hk], tiled(t[v_rows], nk, r, hv)])
            elif part in ("in_proj_z.weight",):
                t = tiled(t, nk, r, hv)
            elif part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
                t = tiled(t, nk, r, 1)
            elif part == "out_proj.weight":
                t = tiled(t, nk, r, hv, dim=1)
            names = {"in_proj_qkv.weight": "attn_qkv.weight", "in_proj_z.weight": "attn_gate.weight",
                     "in_proj_b.weight": "ssm_beta.weight", "in_proj_a.weight": "ssm_alpha.weight"}
        names |= {"conv1d.weight": "ssm_conv1d.weight", "A_log": "ssm_a", "dt_bias": "ssm_dt.bias",
                  "norm.weight": "ssm_norm.weight", "out_proj.weight": "ssm_out.weight"}
        if part == "A_log":
            t = -t.exp()
        out[p + names[part]] = t.squeeze(1) if part == "conv1d.weight" else t
    return out


# Kimi Delta Attention's tensors (checkpoint -> GGUF), and the dense first layer's MLP
KIMI = {"self_attn.q_conv1d.weight": "ssm_conv1d_q.weight",
        "self_attn.k_conv1d.weight": "ssm_conv1d_k.weight",
        "self_attn.v_conv1d.weight": "ssm_conv1d_v.weight",
        "self_attn.f_a_proj.weight": "ssm_f_a.weight", "self_attn.f_b_proj.weight": "ssm_f_b.weight",
        "self_attn.g_a_proj.weight": "ssm_g_a.weight", "self_attn.g_b_proj.weight": "ssm_g_b.weight",
        "self_attn.b_proj.weight": "ssm_beta.weight", "self_attn.o_norm.weight": "ssm_norm.weight",
        "self_attn.A_log": "ssm_a", "self_attn.dt_bias": "ssm_dt.bias",
        "block_sparse_moe.gate_proj.weight": "ffn_gate.weight",
        "block_sparse_moe.up_proj.weight": "ffn_up.weight",
        "block_sparse_moe.down_proj.weight": "ffn_down.weight"}


def kimi_converted(hf, directory) -> dict[str, torch.Tensor]:
    """What llama.cpp's converter writes for Kimi-Linear (KimiLinearModel.modify_tensors):
    experts stacked, kv_b split, each convolution (channels, 1, kernel) as (1, channels, 1,
    kernel), A_log as -exp(A_log), everything else as it is."""
    c = hf.config
    tensors, moe_names = moe_tensors(directory, CHECKPOINT_NAMES[c.architectures[0]])
    split_kv_b(tensors, c)
    names = PLAIN | moe_names | DEEPSEEK2_TO_GGUF | KIMI
    out = {}
    for name, t in tensors.items():
        if not name.startswith("model.layers."):
            out[name] = t
            continue
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        if rest.endswith("conv1d.weight"):
            t = t.reshape(1, t.shape[0], 1, t.shape[-1])
        if rest.endswith("A_log"):
            t = -t.exp()
        out[f"model.layers.{layer}.{names[rest]}"] = t
    return out


def kimi_metadata(w: gguf.GGUFWriter, c) -> None:
    """KimiLinearModel.set_gguf_parameters: each layer's kind in head_count_kv, the latent
    attention's sizes, the experts'."""
    w.add_head_count_kv([1 if t == "full_attention" else 0 for t in c.layer_types])
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_kda_head_dim(c.linear_head_dim)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.mlp_layer_types.index("sparse"))
    w.add_expert_weights_scale(c.routed_scaling_factor)
    # (from the released config.json's moe_router_activation_func, which transformers drops)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def write_linear_gguf(hf, directory, case: str, path, qtype=gguf.GGMLQuantizationType.F32):
    c = hf.config
    if case == "kimi-linear":
        tensors = kimi_converted(hf, directory)
        rel = {n.split(".", 3)[3] for n in tensors if n.startswith("model.layers.")}
        write_gguf(hf, GGUF_ARCH[case], path, HF_TO_GGUF | {n: n for n in rel}, 10000.0, qtype,
                   metadata=lambda w: kimi_metadata(w, c), tensors=tensors)
        return
    tensors = converted(hf, directory, case)
    rel = {n.split(".", 3)[3] for n in tensors if n.startswith("model.layers.")}

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        w.add_ssm_state_size(c.linear_key_head_dim)
        w.add_ssm_group_count(c.linear_num_key_heads)
        w.add_ssm_time_step_rank(c.linear_num_value_heads)
        w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        every = c.layer_types.index("full_attention") + 1  # (llama.cpp keeps only this)
        assert c.layer_types == ["full_attention" if (j + 1) % every == 0 else "linear_attention"
                                 for j in range(c.num_hidden_layers)]
        w.add_full_attention_interval(every)
        w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
        if getattr(c, "num_experts", None):
            w.add_expert_count(c.num_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)

    write_gguf(hf, GGUF_ARCH[case], path, HF_TO_GGUF | {n: n for n in rel},
               c.rope_parameters["rope_theta"], qtype, metadata=metadata, tensors=tensors)


@pytest.fixture(scope="module", params=sorted(GGUF_ARCH))
def linear_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, directory / "hf"), directory


def test_linear_gguf_loads_the_same_model(linear_model):
    case, hf, directory = linear_model
    path = directory / "f32.gguf"
    write_linear_gguf(hf, directory / "hf", case, path)
    from_dir, from_gguf = LLM(directory / "hf", dtype="float32"), LLM(path, dtype="float32")
    a, b = from_gguf.executor.cfg, from_dir.executor.cfg
    assert a.architecture == b.architecture
    if a.moe:  # (the file holds the scale as float32)
        assert a.moe.routed_scaling_factor == pytest.approx(b.moe.routed_scaling_factor)
        assert replace(a.moe, routed_scaling_factor=b.moe.routed_scaling_factor) == b.moe
    assert a.mla == (b.mla and replace(b.mla, kv_b_split=True))  # (the converter splits kv_b)
    for field in ("num_layers", "layer_types", "rotary_dim", "qk_norm", "head_dim"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.linear.state_numel == b.linear.state_numel
    for x, y in zip(prefill_and_decode_logits(from_gguf), prefill_and_decode_logits(from_dir)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert ([r.token_ids for r in from_gguf.generate(PROMPTS, GREEDY)]
            == [r.token_ids for r in from_dir.generate(PROMPTS, GREEDY)])


def test_quantised_linear_layers_stay_packed(linear_model, tmp_path):
    """Q8_0: the fused in-projection of a linear layer and the attention layer's q/k/v
    (Kimi's latent attention: q and kv_a) are multiplied packed (the out-projection's rows, 48 numbers, are not whole blocks), to the
    logits of the same file decoded at load."""
    case, hf, directory = linear_model
    path = tmp_path / "q8.gguf"
    write_linear_gguf(hf, directory / "hf", case, path, gguf.GGMLQuantizationType.Q8_0)
    llm = LLM(path, dtype="float32", activations="float32")
    for layer, name in ((0, "in"), (3, "qkv_a" if case == "kimi-linear" else "qkv")):
        assert isinstance(llm.executor.weights.take(layer)[name], Packed)
        llm.executor.weights.release(layer)
    decoded = LLM(path, dtype="float32", packed=False)
    text = max(PROMPTS, key=len)
    torch.testing.assert_close(llm.logits(text), decoded.logits(text), atol=1e-4, rtol=1e-4)
