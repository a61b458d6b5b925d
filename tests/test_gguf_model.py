"""The same random model written as GGUF (as llama.cpp's converter would) loads to the same weights."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch

from tiergen import LLM, SamplingParams
from tiergen.weights.gguf_map import GLOBAL_NAMES, LAYER_NAMES
from gguf_writer import write_gguf
from tiny_models import build

GGUF_ARCH = {"llama-gqa-tied": "llama", "llama-mha": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
HF_TO_GGUF = {v: k for k, v in GLOBAL_NAMES.items()} | {
    f"{v}.{kind}": f"{k}.{kind}" for k, v in LAYER_NAMES.items() for kind in ("weight", "bias")}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows of Llama-family models."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_model_gguf(hf, arch: str, path, qtype: gguf.GGMLQuantizationType) -> None:
    c = hf.config

    def permute_qk(gname: str, data: np.ndarray) -> np.ndarray:
        if arch == "llama" and ("attn_q." in gname or "attn_k." in gname):
            heads = c.num_attention_heads if "attn_q." in gname else c.num_key_value_heads
            return llama_cpp_permute(data, heads)
        return data

    write_gguf(hf, arch, path, HF_TO_GGUF, c.rope_parameters["rope_theta"], qtype, permute_qk)


def as_stored(name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    """A fused layer tensor of the Hugging Face model with its Q and K rows in llama.cpp's
    order, as tiergen multiplies them from a Llama GGUF (``RopeConfig.pairs``)."""
    if not cfg.rope.pairs or name not in ("qkv", "qkv_bias"):
        return t
    q, k = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    w = t.cpu().numpy()
    return torch.from_numpy(np.concatenate([llama_cpp_permute(w[:q], cfg.num_heads),
                                            llama_cpp_permute(w[q:q + k], cfg.num_kv_heads),
                                            w[q + k:]])).to(t.device)


@pytest.mark.parametrize("case", sorted(GGUF_ARCH))
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_gguf_loads_same_weights(case, qtype, tmp_path):
    hf = build(case, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_model_gguf(hf, GGUF_ARCH[case], path, gguf.GGMLQuantizationType[qtype])
    from_dir = LLM(tmp_path / "hf", dtype="float32").executor
    from_gguf = LLM(path, dtype="float32", packed=False).executor  # weights decoded at load
    assert _same_shape_config(from_gguf.cfg, from_dir.cfg)
    assert from_gguf.cfg.rope.pairs == (GGUF_ARCH[case] == "llama") and not from_dir.cfg.rope.pairs
    # F32 is exact; F16 and Q8_0 are within their rounding of the original weights.
    atol = {"F32": 0.0, "F16": 1e-3, "Q8_0": 5e-3}[qtype]
    for a, b in zip(from_gguf.weights.resident, from_dir.weights.resident):
        for k in b:
            torch.testing.assert_close(a[k], as_stored(k, b[k], from_gguf.cfg), atol=atol, rtol=0)
    for k in from_dir.globals:
        torch.testing.assert_close(from_gguf.globals[k], from_dir.globals[k], atol=atol, rtol=0)
    if qtype == "F32":
        prompts = [[5], list(range(3, 30)), [7, 8, 9]]
        p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert ([r.token_ids for r in LLM(path).generate(prompts, p)]
                == [r.token_ids for r in LLM(tmp_path / "hf").generate(prompts, p)])


def _same_shape_config(a, b) -> bool:
    """GGUF carries no EOS/BOS for these token-less files and stores eps as float32;
    everything else must agree."""
    fields = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
              "num_heads", "num_kv_heads", "head_dim", "max_position",
              "tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm")
    return (all(getattr(a, f) == getattr(b, f) for f in fields)
            and replace(a.rope, pairs=False) == replace(b.rope, pairs=False)
            and a.rms_norm_eps == pytest.approx(b.rms_norm_eps, rel=1e-6))
