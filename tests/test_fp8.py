"""FP8 checkpoints with block scales (DeepSeek-V3 / Kimi K2's form): their matrices stay FP8
blocks, multiplied by kernels that decode e4m3 exactly, and the model agrees with
transformers running the same checkpoint dequantised."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers

from tiergen import LLM, Policy, SamplingParams, kernels
from tiergen.errors import TiergenError
from tiergen.weights.fp8 import fp8_dequantize, fp8_packed
from tiergen.weights.packed import Packed
from tiergen.weights.quant import GGMLType
from test_offload import PROMPTS, prefill_and_decode_logits
from test_packed import assert_close_relative, kernel_path, random_packed, reference  # noqa: F401
from tiny_models import build

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
E4M3_MAX = 448.0


def test_every_e4m3_code_decodes_exactly(kernel_path):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # every code but NaN
    blocks = torch.zeros(2, 132, dtype=torch.uint8)
    blocks[:, :4] = torch.tensor([1.0, -0.5]).view(torch.uint8).view(2, 4)
    blocks[:, 4:131] = codes
    w = Packed(blocks.view(-1), (2, 128), ((GGMLType.FP8, 2),))
    want = torch.cat([codes, torch.zeros(2, 1, dtype=torch.uint8)], 1).view(torch.float8_e4m3fn)
    want = want.float() * torch.tensor([[1.0], [-0.5]])
    assert torch.equal(kernels.dequantize_into(w, torch.empty(2, 128)), want)
    assert torch.equal(w.dequantize(), want)


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_every_instruction_set_build_multiplies_fp8(isa_library, rows, monkeypatch):
    w = random_packed(GGMLType.FP8, 19, 384, seed=3)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(rows))
    monkeypatch.setattr(kernels, "_lib", isa_library)
    assert_close_relative(kernels.packed_linear(x, w), reference(x, w))


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """As DeepSeek's checkpoints: e4m3 values and a float32 scale (amax / 448) per block."""
    br, bc = block
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc)
    padded[:rows, :cols] = w
    blocks = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def test_partial_blocks_pack_and_decode():
    """Rows that do not fill a 128-row scale block take its scale; the packed matrix and the
    decoded values are the checkpoint's e4m3 values times their block's scale."""
    w = torch.randn(200, 256)
    q, scale = quantize_fp8(w, (128, 128))
    packed = fp8_packed(q, scale, 128)
    assert packed.nbytes == 200 * 2 * 132
    want = fp8_dequantize(q, scale, 128)
    assert torch.equal(packed.dequantize(), want)
    assert (want - w).abs().max() < 0.07 * w.abs().max()  # e4m3's rounding
    odd_q, odd_scale = quantize_fp8(torch.randn(5, 200), (128, 128))  # a partial column block
    assert fp8_dequantize(odd_q, odd_scale, 128).shape == (5, 200)


# DeepSeek-V3's architecture with every matrix a whole number of 128-column blocks; the
# kv_a rows (128 + 16) leave a partial row block.
SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=128,
             kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
             num_attention_heads=4, num_key_value_heads=4)


# ... and with heads whose nope and v parts of kv_b are whole blocks of 128 rows: served as
# llama.cpp's k_b and v_b in FP8 blocks (k_b each head's nope rows transposed, block for block)
SPLIT_SHAPE = SHAPE | dict(qk_nope_head_dim=128, v_head_dim=128, num_attention_heads=2,
                           num_key_value_heads=2)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """The same random model as an FP8 checkpoint and as that checkpoint dequantised."""
    return fp8_checkpoints(tmp_path_factory.mktemp("fp8"), SHAPE)


@pytest.fixture(scope="module")
def fp8_split_model(tmp_path_factory):
    return fp8_checkpoints(tmp_path_factory.mktemp("fp8-split"), SPLIT_SHAPE)


def fp8_checkpoints(root, shape: dict):
    build("deepseek-v3", root / "float", **shape)
    tensors = safetensors.torch.load_file(root / "float" / "model.safetensors")
    fp8, dequantised = {}, {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(("_proj.weight", "_mqa.weight")):
            q, scale = quantize_fp8(t, (128, 128))
            fp8 |= {name: q, name + "_scale_inv": scale}
            dequantised[name] = fp8_dequantize(q, scale, 128)
        else:
            fp8[name] = dequantised[name] = t
    for kind, weights in (("fp8", fp8), ("dequantised", dequantised)):
        directory = root / kind
        directory.mkdir()
        config = json.loads((root / "float" / "config.json").read_text())
        if kind == "fp8":
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                             "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
        (directory / "config.json").write_text(json.dumps(config))
        safetensors.torch.save_file(weights, directory / "model.safetensors",
                                    metadata={"format": "pt"})
    return root


def test_fp8_checkpoint_matches_transformers_on_it_dequantised(fp8_model, tmp_path):
    llm = LLM(fp8_model / "fp8", dtype="float32")
    layer = llm.executor.weights.take(1)
    llm.executor.weights.release(1)
    assert layer["o"].type_names == "FP8" and layer["experts"].gate_up.type_names == "FP8"
    assert layer["qkv_a"].type_names == "FP8"  # (128 + 144 rows: a partial row block)
    hf = transformers.AutoModelForCausalLM.from_pretrained(fp8_model / "dequantised",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt in [p for p in PROMPTS if len(p) > 1]:
            want = hf(torch.tensor([prompt])).logits[0]
            got = llm.logits(prompt)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    want = hf.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=GREEDY.max_tokens,
                       do_sample=False)[0, len(PROMPTS[1]):].tolist()
    assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids == want
    tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    logits = prefill_and_decode_logits(llm)
    for policy in (dict(experts="disk"), dict(weights=(0, 0))):
        offloaded = LLM(fp8_model / "fp8", dtype="float32",
                        policy=Policy(**policy, offload_dir=tmp_path))
        assert [r.token_ids for r in offloaded.generate(PROMPTS, GREEDY)] == tokens
        for a, b in zip(prefill_and_decode_logits(offloaded), logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["float32", "int8"])
@pytest.mark.parametrize("rows", [1, 40])
def test_fp8_grouped_products_take_the_float_kernels(kind, rows):
    """FP8 blocks have no integer kernel: a grouped product takes the float kernels a group
    at a time (few rows) or the decoded matrix (more), whatever activations are set."""
    w = random_packed(GGMLType.FP8, 3 * 16, 256, seed=5)
    x = torch.randn(3, rows, 256, generator=torch.Generator().manual_seed(rows))
    with kernels.activations_set(kind):
        got = kernels.grouped_linear(x, w)
    assert_close_relative(got, x @ w.dequantize().view(3, 16, 256).mT)


@pytest.mark.parametrize("block_rows,nope,v", [(128, 128, 128), (256, 128, 128), (128, 128, 64),
                                               (128, 256, 96)])
def test_kv_b_splits_into_k_b_and_v_b_exactly(block_rows, nope, v):
    """k_b (each head's nope rows transposed) and v_b from an FP8 kv_b hold its values
    exactly wherever splits_by_head allows the split, and it refuses where it does not."""
    from tiergen.weights.fp8 import fp8_per_head, splits_by_head

    heads, rank = 3, 256
    kv_b = torch.randn(heads * (nope + v), rank)
    q, scale = quantize_fp8(kv_b, (block_rows, 128))
    if not splits_by_head(block_rows, heads, nope, v, rank):
        assert (nope + v) % block_rows  # (a head's nope rows cross a row block)
        return
    k_b, v_b = fp8_per_head(fp8_packed(q, scale, block_rows), heads, nope)
    dense = fp8_dequantize(q, scale, block_rows).view(heads, nope + v, rank)
    assert torch.equal(k_b.dequantize(), dense[:, :nope].transpose(1, 2).reshape(-1, nope))
    assert torch.equal(v_b.dequantize(), dense[:, nope:].reshape(-1, rank))


def test_fp8_kv_b_is_served_as_packed_k_b_and_v_b(fp8_split_model, fp8_model, tmp_path):
    """Where kv_b's blocks allow it, the absorbed attention takes llama.cpp's k_b and v_b in
    FP8 blocks (nothing decoded at load), with transformers' logits on the dequantised
    checkpoint, from memory and from disk, and over two tensor-parallel ranks; where they do
    not (the other model: heads of 16 + 32 rows), kv_b is decoded as before."""
    llm = LLM(fp8_split_model / "fp8", dtype="float32")
    assert llm.executor.cfg.mla.kv_b_split
    layer = llm.executor.weights.take(1)
    llm.executor.weights.release(1)
    assert layer["k_b"].type_names == layer["v_b"].type_names == "FP8"
    assert layer["k_b"].shape == (2 * 128, 128) and layer["v_b"].shape == (2 * 128, 128)
    hf = transformers.AutoModelForCausalLM.from_pretrained(fp8_split_model / "dequantised",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt in [p for p in PROMPTS if len(p) > 1]:
            torch.testing.assert_close(llm.logits(prompt), hf(torch.tensor([prompt])).logits[0],
                                       atol=1e-4, rtol=1e-4)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    disk = LLM(fp8_split_model / "fp8", dtype="float32",
               policy=Policy(weights=(0, 0), offload_dir=tmp_path))
    assert [r.token_ids for r in disk.generate(PROMPTS, GREEDY)] == tokens
    with LLM(fp8_split_model / "fp8", dtype="float32", tensor_parallel=2) as ranks:
        assert [r.token_ids for r in ranks.generate(PROMPTS, GREEDY)] == tokens
    assert not LLM(fp8_model / "fp8", dtype="float32").executor.cfg.mla.kv_b_split


def test_fp8_checkpoints_refuse_what_they_cannot_be(fp8_model, tmp_path):
    with pytest.raises(TiergenError, match="already quantised"):
        LLM(fp8_model / "fp8", quantize="q4_0")
    config = json.loads((fp8_model / "fp8" / "config.json").read_text())
    for change, message in ((dict(weight_block_size=[128, 64]), "blocks of 64 columns"),
                            (dict(fmt="e5m2"), "format 'e5m2'")):
        bad = tmp_path / message.split()[-1].strip("'")
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(
            config | {"quantization_config": config["quantization_config"] | change}))
        (bad / "model.safetensors").symlink_to(fp8_model / "fp8" / "model.safetensors")
        with pytest.raises(TiergenError, match=message):
            LLM(bad)
