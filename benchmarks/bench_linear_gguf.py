"""tiergen against llama.cpp on a Qwen3-Next-shaped Q4_K GGUF (random weights, a placeholder
vocabulary, llama.cpp's qwen3next layout): generation at batch 1 and 32 (128-token prompts,
64 greedy tokens, 2 threads), each engine in a fresh process, in turns with --repeat, through
``bench_packed.py``'s runs.

The shape is Qwen3-Next-80B-A3B's layers (hidden 2048; Gated DeltaNet with 16 key heads and
32 value heads of 128, kernel 4; gated attention with 16 heads of 256, 2 KV heads, a quarter
rotating) in 8 layers (every fourth attends), with 64 routed experts of 512 (10 chosen) and a
gated shared expert of 512, and a 32,000-token vocabulary, so the file is about 1 GB.

    python benchmarks/bench_linear_gguf.py [--dir /var/tmp/tiergen-qwen3next] [--batches 1 32]
        [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_packed import run_llama_cpp, run_tiergen  # noqa: E402
from scale_model import _write_vocab  # noqa: E402

H, LAYERS, EVERY, VOCAB = 2048, 8, 4, 32000
HEADS, KV_HEADS, HEAD_DIM, ROTARY = 16, 2, 256, 64
NK, NV, DK, KERNEL = 16, 32, 128, 4
EXPERTS, USED, EXPERT_FF, SHARED_FF = 64, 10, 512, 512
F32, Q4_K = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q4_K


def tensors() -> list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]]:
    """(GGUF name, torch shape, type) in file order."""
    out = [("token_embd.weight", (VOCAB, H), Q4_K)]
    conv = 2 * NK * DK + NV * DK
    for j in range(LAYERS):
        p = f"blk.{j}."
        out += [(p + "attn_norm.weight", (H,), F32), (p + "post_attention_norm.weight", (H,), F32)]
        if (j + 1) % EVERY:
            out += [(p + "attn_qkv.weight", (conv, H), Q4_K),
                    (p + "attn_gate.weight", (NV * DK, H), Q4_K),
                    (p + "ssm_ba.weight", (2 * NV, H), Q4_K),
                    (p + "ssm_conv1d.weight", (conv, KERNEL), F32),
                    (p + "ssm_dt.bias", (NV,), F32), (p + "ssm_a", (NV,), F32),
                    (p + "ssm_norm.weight", (DK,), F32),
                    (p + "ssm_out.weight", (H, NV * DK), Q4_K)]
        else:
            out += [(p + "attn_q.weight", (2 * HEADS * HEAD_DIM, H), Q4_K),
                    (p + "attn_k.weight", (KV_HEADS * HEAD_DIM, H), Q4_K),
                    (p + "attn_v.weight", (KV_HEADS * HEAD_DIM, H), Q4_K),
                    (p + "attn_output.weight", (H, HEADS * HEAD_DIM), Q4_K),
                    (p + "attn_q_norm.weight", (HEAD_DIM,), F32),
                    (p + "attn_k_norm.weight", (HEAD_DIM,), F32)]
        out += [(p + "ffn_gate_inp.weight", (EXPERTS, H), F32),
                (p + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FF, H), Q4_K),
                (p + "ffn_up_exps.weight", (EXPERTS, EXPERT_FF, H), Q4_K),
                (p + "ffn_down_exps.weight", (EXPERTS, H, EXPERT_FF), Q4_K),
                (p + "ffn_gate_inp_shexp.weight", (H,), F32),
                (p + "ffn_gate_shexp.weight", (SHARED_FF, H), Q4_K),
                (p + "ffn_up_shexp.weight", (SHARED_FF, H), Q4_K),
                (p + "ffn_down_shexp.weight", (H, SHARED_FF), Q4_K)]
    return out + [("output_norm.weight", (H,), F32), ("output.weight", (VOCAB, H), Q4_K)]


def value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> np.ndarray:
    """Random weights of a trained model's scale: norms near 1 (stored as 1 + w except the
    gated one), a decay that keeps state, a convolution that passes its input through."""
    if name.endswith("ssm_a"):
        return -np.exp(np.random.default_rng(0).uniform(0, 2, shape)).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        return np.full(shape, -2.0, dtype=np.float32)
    if name.endswith("norm.weight"):  # w = 0 stored as 1 + w, and the gated norm's 1
        return np.ones(shape, dtype=np.float32)
    fan_in = shape[-1]
    t = torch.randn(*shape, generator=gen) * (0.5 / fan_in**0.5)
    return t.numpy().astype(np.float32)


def build(path: Path) -> Path:
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(partial), "qwen3next")
    w.add_context_length(32768)
    w.add_embedding_length(H)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(EXPERT_FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(10_000_000.0)
    w.add_rope_dimension_count(ROTARY)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_expert_feed_forward_length(EXPERT_FF)
    w.add_expert_shared_feed_forward_length(SHARED_FF)
    w.add_ssm_conv_kernel(KERNEL)
    w.add_ssm_state_size(DK)
    w.add_ssm_group_count(NK)
    w.add_ssm_time_step_rank(NV)
    w.add_ssm_inner_size(NV * DK)
    w.add_full_attention_interval(EVERY)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    _write_vocab(w, VOCAB)
    names = tensors()
    for name, shape, qtype in names:
        if qtype == F32:
            w.add_tensor_info(name, shape, np.float32, 4 * int(np.prod(shape)))
        else:
            nbytes = gguf.quant_shape_to_byte_shape(shape, qtype)
            w.add_tensor_info(name, nbytes, np.uint8, int(np.prod(nbytes)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    from tiergen.weights.quantize import quantize_q4_k

    gen = torch.Generator().manual_seed(0)
    made: dict[tuple[int, ...], np.ndarray] = {}  # one quantised matrix per shape, reused
    for name, shape, qtype in names:
        if qtype == F32:
            w.write_tensor_data(value(name, shape, gen))
            continue
        if shape[-2:] not in made:  # (an expert's matrix serves every expert of the stack)
            rows = torch.from_numpy(value(name, shape[-2:], gen).reshape(-1, 256))
            made[shape[-2:]] = quantize_q4_k(rows).numpy().reshape(
                gguf.quant_shape_to_byte_shape(shape[-2:], qtype))
        data = made[shape[-2:]]
        w.write_tensor_data(np.broadcast_to(data, (*shape[:-2], *data.shape)).copy()
                            if len(shape) == 3 else data)
    w.close()
    partial.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/tiergen-qwen3next"))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    path = str(build(args.dir / "qwen3next-q4_k.gguf"))
    print("| batch | tiergen total tok/s | llama.cpp total tok/s | tiergen decode tok/s | "
          "llama.cpp decode tok/s | total ratio (turns) |\n|---|---|---|---|---|---|")
    for batch in args.batches:
        runs = {"tiergen": [], "llama.cpp": []}
        for _ in range(args.repeat):
            runs["tiergen"].append(run_tiergen(path, batch, []))
            runs["llama.cpp"].append(run_llama_cpp(path, batch))
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("total_tok_s", "decode_tok_s")}
               for k, v in runs.items()}
        turns = [t["total_tok_s"] / l["total_tok_s"] for t, l in zip(runs["tiergen"],
                                                                     runs["llama.cpp"])]
        print(f"| {batch} | {med['tiergen']['total_tok_s']:.1f} | "
              f"{med['llama.cpp']['total_tok_s']:.1f} | {med['tiergen']['decode_tok_s']:.1f} | "
              f"{med['llama.cpp']['decode_tok_s']:.1f} | "
              f"{statistics.median(turns):.2f}x ({', '.join(f'{x:.2f}' for x in turns)}) |",
              flush=True)
    print(f"CPU: {runs['tiergen'][0]['cpu']}, {runs['tiergen'][0]['simd']}")


if __name__ == "__main__":
    main()
