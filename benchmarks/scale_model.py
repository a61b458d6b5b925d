"""A random-weight Llama checkpoint of any size, written as a Hugging Face bfloat16 safetensors
directory and, from the same weights, as GGUF files (Q8_0, Q4_0), streaming layer by layer so
that building an 8B-shaped model never holds more than one layer in RAM.

    build(directory, SHAPES["llama-3.1-8b"])  # about 16 GB of safetensors, 8.5 + 4.5 GB of GGUF

The GGUF files are what llama.cpp's converter would write for those weights (Q and K rows
permuted for its RoPE layout, a SentencePiece-style vocabulary of placeholder tokens), so
tiergen, transformers and llama.cpp all load them. Prompts are token ids: there is no real
tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

SHAPES = {
    # Llama-3.1-8B's shapes (plain RoPE: the scaling changes no byte or FLOP count)
    "llama-3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    # Llama-3.2-1B's shapes, untied: 1.5 B parameters, 3 GB in bfloat16
    "llama-3.2-1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256),
    # the same builder scaled down for tests: about 20 MB
    "tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=768, vocab_size=2048),
}
ROPE_THETA = 500000.0
EPS = 1e-5
CONTEXT = 8192
QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}

LAYER = {  # HF name -> GGUF name, in the converter's order
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def hf_config(shape: dict) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", **shape,
                max_position_embeddings=CONTEXT, rms_norm_eps=EPS, rope_theta=ROPE_THETA,
                hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
                mlp_bias=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")


def _layer_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    h, f = s["hidden_size"], s["intermediate_size"]
    d = h // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * d
    return {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (h, h),
            "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, h), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f)}


def _tensor(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm weights near 1; matrices with a std that keeps activations of order 1 (1/sqrt of
    the input width), so a deep random model still gives well-separated greedy tokens."""
    if len(shape) == 1:
        return (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    return (torch.randn(shape, generator=gen) * shape[1] ** -0.5).to(torch.bfloat16)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders Q and K rows of Llama models for its RoPE layout."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_vocab(w: gguf.GGUFWriter, vocab: int) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)  # unknown, control, byte, normal
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


class _GGUF:
    """A GGUF file written tensor by tensor: infos first, then each tensor's data in order."""

    def __init__(self, path: Path, qtype: gguf.GGMLQuantizationType, s: dict,
                 names: list[tuple[str, tuple[int, ...]]]) -> None:
        self.qtype, self.s = qtype, s
        w = self.writer = gguf.GGUFWriter(str(path), "llama")
        w.add_context_length(CONTEXT)
        w.add_embedding_length(s["hidden_size"])
        w.add_block_count(s["num_hidden_layers"])
        w.add_feed_forward_length(s["intermediate_size"])
        w.add_head_count(s["num_attention_heads"])
        w.add_head_count_kv(s["num_key_value_heads"])
        w.add_rope_freq_base(ROPE_THETA)
        w.add_layer_norm_rms_eps(EPS)
        w.add_vocab_size(s["vocab_size"])
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == QTYPES["Q8_0"]
                        else gguf.LlamaFileType.MOSTLY_Q4_0)
        _write_vocab(w, s["vocab_size"])
        for name, shape in names:
            t = self.stored(shape)
            if t == gguf.GGMLQuantizationType.F32:
                w.add_tensor_info(name, shape, np.float32, 4 * int(np.prod(shape)))
            else:  # quantised tensors are described by their shape in bytes
                nbytes = gguf.quant_shape_to_byte_shape(shape, t)
                w.add_tensor_info(name, nbytes, np.uint8, int(np.prod(nbytes)), raw_dtype=t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()

    def stored(self, shape: tuple[int, ...]) -> gguf.GGMLQuantizationType:
        return self.qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32

    def add(self, name: str, t: torch.Tensor) -> None:
        data = t.float().numpy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _permute(data, self.s["num_attention_heads" if "attn_q" in name
                                         else "num_key_value_heads"])
        if data.ndim == 2:
            data = gguf.quants.quantize(data, self.qtype)
        self.writer.write_tensor_data(data)

    def close(self) -> None:
        self.writer.close()


def build(directory: Path, shape: dict, seed: int = 0, qtypes: tuple[str, ...] = ("Q8_0", "Q4_0"),
          progress: bool = True) -> dict[str, Path]:
    """Write ``directory/hf`` (safetensors, one shard per layer) and ``directory/<qtype>.gguf``
    unless already complete; return their paths. Everything is written under temporary names
    and renamed when complete, so an interrupted build is started afresh."""
    directory = Path(directory)
    paths = {"hf": directory / "hf"} | {q: directory / f"{q}.gguf" for q in qtypes}
    if all(p.exists() for p in paths.values()):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    tmp = {k: p.with_name(f".{p.name}.partial") for k, p in paths.items()}
    shutil.rmtree(tmp["hf"], ignore_errors=True)
    tmp["hf"].mkdir()
    s, layers = shape, shape["num_hidden_layers"]
    h, vocab = s["hidden_size"], s["vocab_size"]
    gguf_names = [("token_embd.weight", (vocab, h))]
    for i in range(layers):
        gguf_names += [(f"blk.{i}.{LAYER[n]}", shp) for n, shp in _layer_shapes(s).items()]
    gguf_names += [("output_norm.weight", (h,)), ("output.weight", (vocab, h))]
    writers = [_GGUF(tmp[q], QTYPES[q], s, [(n, tuple(shp)) for n, shp in gguf_names])
               for q in qtypes]
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, str] = {}
    parts = [("embed", None)] + [("layer", i) for i in range(layers)] + [("head", None)]
    for kind, i in tqdm(parts, desc="building random checkpoint", unit="part", disable=not progress):
        if kind == "embed":
            tensors = {"model.embed_tokens.weight": _tensor((vocab, h), gen)}
            names = ["token_embd.weight"]
        elif kind == "layer":
            tensors = {f"model.layers.{i}.{n}": _tensor(shp, gen)
                       for n, shp in _layer_shapes(s).items()}
            names = [f"blk.{i}.{LAYER[n]}" for n in _layer_shapes(s)]
        else:
            tensors = {"model.norm.weight": _tensor((h,), gen),
                       "lm_head.weight": _tensor((vocab, h), gen)}
            names = ["output_norm.weight", "output.weight"]
        shard = f"model-{parts.index((kind, i)) + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(tensors, str(tmp["hf"] / shard), metadata={"format": "pt"})
        shards.update(dict.fromkeys(tensors, shard))
        for w in writers:
            for name, t in zip(names, tensors.values()):
                w.add(name, t)
    for w in writers:
        w.close()
    total = sum(os.path.getsize(tmp["hf"] / f) for f in set(shards.values()))
    (tmp["hf"] / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": shards}))
    (tmp["hf"] / "config.json").write_text(json.dumps(hf_config(s), indent=1))
    (tmp["hf"] / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    for k, p in paths.items():
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        os.rename(tmp[k], p)
    return paths
