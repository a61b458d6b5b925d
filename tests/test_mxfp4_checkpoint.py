"""gpt-oss's own MXFP4 checkpoints (experts as ``*_blocks`` and ``*_scales``): the experts stay
MXFP4 on every tier, and the model agrees with transformers loading the same checkpoint
dequantised."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers

from tiergen import LLM, Policy, SamplingParams
from tiergen.weights.packed import Packed
from test_offload import PROMPTS, prefill_and_decode_logits
from tiny_models import build

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., rows, cols) as gpt-oss's checkpoint holds it: blocks (..., rows, cols / 32, 16),
    two E2M1 codes a byte (the first in the low nibble), and E8M0 scales (..., rows, cols / 32)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    build("gpt-oss", root / "float", intermediate_size=64)
    tensors = safetensors.torch.load_file(root / "float" / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.mT)  # stored (E, out, in)
            out |= {name + "_blocks": blocks, name + "_scales": scales}
        else:
            out[name] = t
    config = json.loads((root / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (root / "mxfp4").mkdir()
    (root / "mxfp4" / "config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(out, root / "mxfp4" / "model.safetensors",
                                metadata={"format": "pt"})
    return root / "mxfp4"


def test_mxfp4_checkpoint_matches_transformers_dequantising_it(mxfp4_model, tmp_path):
    llm = LLM(mxfp4_model, dtype="float32", activations="float32")
    experts = llm.executor.weights.take(0)["experts"]
    llm.executor.weights.release(0)
    assert isinstance(experts.gate_up, Packed) and experts.gate_up.type_names == "MXFP4"
    assert isinstance(experts.down, Packed) and experts.down.type_names == "MXFP4"
    if llm.executor.device.type != "cpu":  # on a GPU, first against tiergen's own CPU run
        on_cpu = LLM(mxfp4_model, dtype="float32", activations="float32", device="cpu")
        for prompt in [p for p in PROMPTS if len(p) > 1]:
            torch.testing.assert_close(llm.logits(prompt), on_cpu.logits(prompt),
                                       atol=1e-4, rtol=1e-4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_model, dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        for prompt in [p for p in PROMPTS if len(p) > 1]:
            want = hf(torch.tensor([prompt])).logits[0].float()
            torch.testing.assert_close(llm.logits(prompt), want, atol=1e-4, rtol=1e-4)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    logits = prefill_and_decode_logits(llm)
    for policy in (dict(experts="disk"), dict(weights=(0, 0))):
        offloaded = LLM(mxfp4_model, dtype="float32", activations="float32",
                        policy=Policy(**policy, offload_dir=tmp_path))
        assert [r.token_ids for r in offloaded.generate(PROMPTS, GREEDY)] == tokens
        for a, b in zip(prefill_and_decode_logits(offloaded), logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the integer path (the default on a CPU) runs the same experts
    assert len(LLM(mxfp4_model).generate(PROMPTS[:2], GREEDY)[1].token_ids) == 10
