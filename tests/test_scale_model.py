"""The random checkpoint builder of benchmarks/bench_scale.py, scaled down: its safetensors and
GGUF files hold the same weights, and tiergen's greedy tokens on it do not depend on where the
policy puts weights and cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.weights import open_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scale_model  # noqa: E402

PROMPTS = [[5, 9, 300, 17], list(range(260, 290)), [1000]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
POLICIES = {
    "disk": dict(weights=(0, 0)),
    "disk-cache-on-disk": dict(weights=(0, 0), cache=(0, 0), gpu_batch_size=2, num_gpu_batches=2),
    "half": dict(weights=(50, 0), cache=(50, 0), gpu_batch_size=1, num_gpu_batches=3),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    return scale_model.build(tmp_path_factory.mktemp("scale"), scale_model.SHAPES["tiny"],
                             progress=False)


def test_the_files_hold_the_same_weights(built):
    hf = open_model(built["hf"]).source
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}" for i in (0, 3) for n in scale_model.LAYER]
    shape = scale_model.SHAPES["tiny"]
    for qtype, atol in (("Q8_0", 0.02), ("Q4_0", 0.3)):
        gguf = open_model(built[qtype], packed=False).source
        for name in names:
            want, got = hf.get(name).float(), gguf.get(name).float()
            if "q_proj" in name or "k_proj" in name:  # kept in llama.cpp's order (rope in pairs)
                heads = shape["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
                want = torch.from_numpy(scale_model._permute(want.numpy(), heads))
            assert got.shape == want.shape, name
            # norms are F32 in the GGUF (exact); matrices within their format's rounding
            tol = 0.0 if want.dim() == 1 else atol * want.abs().max().item()
            torch.testing.assert_close(got, want, atol=tol, rtol=0, msg=name)


def test_a_finished_build_is_reused_and_a_partial_one_is_not_trusted(built):
    stamp = {k: p.stat().st_mtime_ns for k, p in built.items()}
    assert scale_model.build(built["hf"].parent, scale_model.SHAPES["tiny"], progress=False) == built
    assert {k: p.stat().st_mtime_ns for k, p in built.items()} == stamp
    assert not list(built["hf"].parent.glob(".*partial"))


@pytest.mark.parametrize("fmt,activations", [("hf", "auto"), ("Q4_0", "float32"),
                                             ("Q4_0", "int8")])
def test_greedy_tokens_do_not_depend_on_the_policy(built, fmt, activations, tmp_path):
    """Every policy on the float paths. The integer path gives a row the same numbers only
    where the kernel is the same: a micro-batch of one or two rows goes row by row, three or
    more through the tiles, which agree within float rounding, and on a random model a float
    rounding can move an 8-bit activation by a whole step and a near-tied token with it. So
    there it covers the policies that keep the batch whole."""
    dtype = "bfloat16" if fmt == "hf" else "float32"
    want = [r.token_ids for r in LLM(built[fmt], dtype=dtype, activations=activations
                                     ).generate(PROMPTS, PARAMS)]
    assert len({tuple(t) for t in want}) > 1  # the prompts lead to different continuations
    for name, kw in POLICIES.items():
        if activations == "int8" and "gpu_batch_size" in kw:
            continue
        llm = LLM(built[fmt], dtype=dtype, activations=activations,
                  policy=Policy(**kw, offload_dir=tmp_path / name))
        assert [r.token_ids for r in llm.generate(PROMPTS, PARAMS)] == want, name
