"""Write a transformers model as a GGUF file the way llama.cpp's converter does."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

F32 = gguf.GGMLQuantizationType.F32


def write_gguf(hf, arch: str, path, hf_to_gguf: dict[str, str], rope_theta: float,
               qtype: gguf.GGMLQuantizationType = F32,
               transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
               metadata: Callable[[gguf.GGUFWriter], None] | None = None,
               tensors: dict | None = None, block_count: int | None = None) -> None:
    """``hf_to_gguf`` maps global names and layer-relative names; ``transform(gguf_name, data)``
    applies the converter's per-architecture changes; matrices (and stacks of them) are stored
    as ``qtype``. ``tensors``: what to write, by Hugging Face name (default: the model's
    state dict); ``block_count``: the blocks the file says it has (default: the model's
    layers)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(block_count or c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if metadata:
        metadata(w)
    for name, t in (hf.state_dict() if tensors is None else tensors).items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        key = name.removeprefix("model.")
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            gname = f"blk.{i}.{hf_to_gguf[rest]}"
        else:
            gname = hf_to_gguf[name]
        data = t.numpy().astype(np.float32)
        if transform:
            data = transform(gname, data)
        # as llama.cpp, rows that are not whole blocks, routers (ffn_gate_inp) and biases
        # stay float
        if (data.ndim >= 2 and qtype != F32 and "ffn_gate_inp" not in gname
                and gname.endswith(".weight")
                and data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0):
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
