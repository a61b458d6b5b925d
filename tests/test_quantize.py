"""Float checkpoints quantised at load (LLM(quantize=...)): the quantisers against plain
per-block references of llama.cpp's code, the engine on the quantised matrices through the
tiers, the cached file, and the errors."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen.cli import build_parser
from tiergen.errors import TiergenError
from tiergen.paths import cache_dir
from tiergen.weights import quantize as quantize_module
from tiergen.weights.packed import Packed
from tiergen.weights.quant import GGMLType, dequantize
from tiergen.weights.quantize import _fit_scale_min, matrix_type, quantize_matrix

from test_gguf_model import write_model_gguf
from test_offload import PROMPTS, prefill_and_decode_logits
from tiny_models import build


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    """A cache directory of the test's own (for its processes too), sharing the usual one's
    built kernels."""
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    directory = tmp_path_factory.mktemp("cache")
    (directory / "kernels").symlink_to(kernels)
    monkeypatch.setenv("TIERGEN_CACHE", str(directory))
    return directory


def weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random weights with the awkward blocks: all zero, all equal, ties of magnitude, one
    outlier."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[0, :32] = 0
    w[1, :32] = -0.5
    w[2, :32] = 0.25 * torch.tensor([1.0, -1.0] * 16)
    w[3, 5] = 3.0
    return w


# -- plain references: llama.cpp's quantize_row_*_ref, one block at a time ----------------

f32 = np.float32


def roundf(v: float) -> int:
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def reference_q8_0(block: np.ndarray) -> bytes:
    amax = max(abs(v) for v in block)
    d = f32(amax / f32(127))
    inv = f32(1) / d if d else f32(0)
    qs = [roundf(float(f32(v * inv))) for v in block]
    return np.float16(d).tobytes() + np.array(qs, np.int8).tobytes()


def reference_q4_0(block: np.ndarray) -> bytes:
    amax, top = f32(0), f32(0)
    for v in block:
        if amax < abs(v):
            amax, top = abs(v), v
    d = f32(top / f32(-8))
    inv = f32(1) / d if d else f32(0)
    q = [min(15, int(f32(f32(v * inv) + f32(8.5)))) for v in block]
    return np.float16(d).tobytes() + bytes(q[j] | q[j + 16] << 4 for j in range(16))


@pytest.mark.parametrize("ggml_type, reference, gguf_type", [
    (GGMLType.Q8_0, reference_q8_0, gguf.GGMLQuantizationType.Q8_0),
    (GGMLType.Q4_0, reference_q4_0, gguf.GGMLQuantizationType.Q4_0)])
def test_q8_0_and_q4_0_are_llama_cpps_bytes(ggml_type, reference, gguf_type):
    w = weights(8, 128)
    got = quantize_matrix(w, ggml_type).numpy().tobytes()
    blocks = w.numpy().reshape(-1, 32)
    assert got == b"".join(reference(b) for b in blocks)
    big = weights(256, 512, seed=1)
    assert np.array_equal(quantize_matrix(big, ggml_type).numpy(),
                          gguf.quants.quantize(big.numpy(), gguf_type).reshape(-1))


def reference_qkx2(x: np.ndarray, w: np.ndarray, nmax: int = 15) -> tuple[float, float, list]:
    """llama.cpp's make_qkx2_quants(32, 15, x, w, L, &the_min, Laux, -1, 0.1, 20, false)."""
    lo, hi = min(min(x), f32(0)), max(x)
    if hi == lo:
        return 0.0, float(-lo), [0] * len(x)
    sum_w, sum_x = float(w.sum()), float((w * x).sum())
    iscale = nmax / (hi - lo)
    scale = 1 / iscale
    codes = [min(nmax, max(0, round(iscale * (v - lo)))) for v in x]
    best = sum(wi * (scale * li + lo - v) ** 2 for wi, li, v in zip(w, codes, x))
    for step in range(21):
        iscale = (-1 + 0.1 * step + nmax) / (hi - lo)
        laux = [min(nmax, max(0, round(iscale * (v - lo)))) for v in x]
        sum_l = sum(wi * li for wi, li in zip(w, laux))
        sum_l2 = sum(wi * li * li for wi, li in zip(w, laux))
        sum_xl = sum(wi * li * v for wi, li, v in zip(w, laux, x))
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            s = (sum_w * sum_xl - sum_x * sum_l) / det
            m = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if m > 0:
                s, m = sum_xl / sum_l2, 0
            err = sum(wi * (s * li + m - v) ** 2 for wi, li, v in zip(w, laux, x))
            if err < best:
                best, codes, scale, lo = err, laux, s, m
    return scale, -lo, codes


def reference_q4_k(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q4_K_ref for one super-block, dequantised."""
    sub = x.reshape(8, 32)
    fits = [reference_qkx2(s, np.sqrt((s * s).mean()) + np.abs(s)) for s in sub]
    max_scale, max_min = max(f[0] for f in fits), max(f[1] for f in fits)
    d, dmin = float(np.float16(max_scale / 63)), float(np.float16(max_min / 63))
    out = np.empty((8, 32))
    for j, (scale, the_min, codes) in enumerate(fits):
        ls = min(63, round(63 / max_scale * scale)) if max_scale > 0 else 0
        lm = min(63, round(63 / max_min * the_min)) if max_min > 0 else 0
        if d * ls:
            codes = [min(15, max(0, round((v + dmin * lm) / (d * ls)))) for v in sub[j]]
        out[j] = [d * ls * q - dmin * lm for q in codes]
    return out.reshape(-1)


def naive_q4_k(x: np.ndarray) -> np.ndarray:
    """A Q4_K by min/max alone: scale (max - min) / 15 per sub-block, no search."""
    sub = x.reshape(-1, 32)
    lo, hi = np.minimum(sub.min(1, keepdims=True), 0), sub.max(1, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / 15, 1)
    return (np.clip(np.round((sub - lo) / scale), 0, 15) * scale + lo).reshape(x.shape)


def test_q4_k_fits_as_llama_cpp_does_and_round_trips():
    w = weights(4, 512, seed=2)
    x = w.numpy()
    # each sub-block's fit: the same codes as the reference (float32 against its float64
    # may round a trial differently, rarely)
    sub = x.reshape(-1, 32)
    sub_w = np.sqrt((sub * sub).mean(1, keepdims=True)) + np.abs(sub)
    _, _, codes = _fit_scale_min(torch.from_numpy(sub), torch.from_numpy(sub_w), 15)
    same = [reference_qkx2(s, sw)[2] == c for s, sw, c in zip(sub, sub_w, codes.int().tolist())]
    assert sum(same) >= 0.95 * len(same)
    # the blocks decode (tiergen's dequantiser) to llama.cpp's values, within its error
    back = dequantize(quantize_matrix(w, GGMLType.Q4_K), GGMLType.Q4_K, w.shape).numpy()
    ref = np.concatenate([reference_q4_k(b) for b in x.reshape(-1, 256)]).reshape(w.shape)
    assert np.linalg.norm(back - x) <= 1.01 * np.linalg.norm(ref - x)
    # on Gaussian weights: 7.2% relative error, against 8.6% for Q4_0 and 9.3% for min/max
    g = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))
    rel = {t: float((dequantize(quantize_matrix(g, t), t, g.shape) - g).norm() / g.norm())
           for t in (GGMLType.Q4_K, GGMLType.Q4_0, GGMLType.Q8_0)}
    naive = float(np.linalg.norm(naive_q4_k(g.numpy()) - g.numpy()) / g.norm())
    assert rel[GGMLType.Q4_K] < 0.075 and rel[GGMLType.Q4_K] < min(rel[GGMLType.Q4_0], naive)
    assert rel[GGMLType.Q8_0] < 0.006


def test_which_tensors_are_quantised():
    q4_k, q8_0 = GGMLType.Q4_K, GGMLType.Q8_0

    def kind(name: str, shape: tuple[int, ...], architecture: str = "LlamaForCausalLM"):
        return matrix_type(name, shape, q4_k, architecture)

    layer = "model.layers.3."
    assert kind(layer + "self_attn.q_proj.weight", (512, 512)) == q4_k
    assert kind(layer + "mlp.down_proj.weight", (512, 96)) == q8_0  # 96 wide: blocks of 32
    assert kind(layer + "mlp.down_proj.weight", (512, 48)) is None
    assert kind("lm_head.weight", (1000, 512)) == q8_0
    for name, shape in [("model.embed_tokens.weight", (1000, 512)),
                        (layer + "input_layernorm.weight", (512,)),
                        (layer + "self_attn.q_proj.bias", (512,)),
                        (layer + "block_sparse_moe.gate.weight", (8, 512))]:
        assert kind(name, shape, "MixtralForCausalLM") is None
    # routed experts are stacked packed
    assert kind(layer + "block_sparse_moe.experts.0.w1.weight", (512, 512),
                "MixtralForCausalLM") == q4_k
    assert kind(layer + "mlp.experts.7.down_proj.weight", (512, 96), "Qwen3MoeForCausalLM") == q8_0
    # DeepSeek-V2 joins q_proj with kv_a_proj_with_mqa as plain tensors
    assert kind(layer + "self_attn.q_proj.weight", (512, 512), "DeepseekV2ForCausalLM") is None
    assert kind(layer + "self_attn.o_proj.weight", (512, 512), "DeepseekV2ForCausalLM") == q4_k
    # its kv_b as the per-head k_b (rows of nope, 128: Q8_0) and v_b (rows of the rank)
    assert kind(layer + "self_attn.kv_b_proj.weight", (4096, 512), "DeepseekV3ForCausalLM") is None
    assert kind(layer + "self_attn.k_b_proj.weight", (8192, 128), "DeepseekV3ForCausalLM") == q8_0
    assert kind(layer + "self_attn.v_b_proj.weight", (2048, 512), "DeepseekV3ForCausalLM") == q4_k


# -- the engine on quantised weights -------------------------------------------------------

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def kl_divergence(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    p, q = want.float().log_softmax(-1), got.float().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).flatten()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama with an untied head, and its float logits."""
    directory = tmp_path_factory.mktemp("quantize") / "hf"
    build("llama-mha", directory)
    return directory, prefill_and_decode_logits(LLM(directory, dtype="float32", device="cpu"))


@pytest.mark.parametrize("policy", ["device", "disk"])
def test_q8_0_model_is_close_to_the_float_model(model, policy, tmp_path):
    """Measured: a mean KL divergence of 4e-4 (max 1.4e-3) from the float model, the same
    top token everywhere, whichever tier the blocks come from."""
    directory, want = model
    p = Policy() if policy == "device" else Policy(weights=(0, 0), gpu_batch_size=2,
                                                   num_gpu_batches=2, offload_dir=tmp_path)
    llm = LLM(directory, dtype="float32", device="cpu", quantize="q8_0", policy=p)
    layer = llm.executor.weights.take(0)
    assert {n: t.type_names for n, t in layer.items() if isinstance(t, Packed)} == {
        "qkv": "Q8_0", "o": "Q8_0", "gate_up": "Q8_0", "down": "Q8_0"}
    llm.executor.weights.release(0)
    assert isinstance(llm.executor.globals["lm_head"], Packed)
    assert not isinstance(llm.executor.globals["embed"], Packed)
    got = prefill_and_decode_logits(llm)
    kl = torch.cat([kl_divergence(a, b) for a, b in zip(want, got)])
    same = torch.cat([(a.argmax(-1) == b.argmax(-1)).flatten() for a, b in zip(want, got)])
    assert kl.mean() < 2e-3 and kl.max() < 1e-2 and same.float().mean() > 0.9
    assert len(llm.generate(PROMPTS, GREEDY)[1].token_ids) == GREEDY.max_tokens
    if policy == "disk":  # the blocks are read where they lie in the cached file
        disk = llm.executor.weights.disk
        assert {k.split("/")[1] for k in disk.entries} >= {"o", "down"}


def test_q4_k_model_runs_on_q4_k_blocks(tmp_path):
    """Rows 256 wide take Q4_K; the head takes Q8_0."""
    build("llama-gqa-tied", tmp_path / "hf", hidden_size=256, intermediate_size=256,
          num_hidden_layers=1, tie_word_embeddings=False)
    llm = LLM(tmp_path / "hf", dtype="float32", device="cpu", quantize="q4_k")
    layer = llm.executor.weights.take(0)
    assert layer["qkv"].type_names == layer["down"].type_names == "Q4_K"
    llm.executor.weights.release(0)
    assert llm.executor.globals["lm_head"].type_names == "Q8_0"
    assert len(llm.generate(PROMPTS, GREEDY)[0].token_ids) == GREEDY.max_tokens


@pytest.mark.parametrize("case", ["deepseek-v2", "deepseek-v32", "minimax-m2",
                                  "qwen2-moe", "mixtral"])
def test_families_with_experts_take_quantised_matrices(case, tmp_path):
    """Routed experts are quantised into packed stacks; routers and DeepSeek-V2's joined
    latent projections stay float. On the float path the quantised model's logits are the
    float model's within the weights' rounding, through every tier of the experts."""
    build(case, tmp_path / "hf")
    llm = LLM(tmp_path / "hf", dtype="float32", device="cpu", quantize="q8_0",
              activations="float32")
    weights = llm.executor.weights.take(1)
    packed = {n for n, t in weights.items() if isinstance(t, Packed)}
    experts = weights["experts"]
    llm.executor.weights.release(1)
    assert "o" in packed and "router" not in packed
    assert isinstance(experts.gate_up, Packed)
    # down is (H, I): packed where I is whole blocks (DeepSeek-V2's tiny I is 24)
    assert isinstance(experts.down, Packed) == (llm.executor.cfg.moe.intermediate_size % 32 == 0)
    assert experts.gate_up.shape[0] == llm.executor.cfg.moe.num_experts
    assert experts.gate_up.type_names == "Q8_0"
    want = prefill_and_decode_logits(LLM(tmp_path / "hf", dtype="float32", device="cpu"))
    got = prefill_and_decode_logits(llm)
    for w, g in zip(want, got):
        assert kl_divergence(w, g).mean() < 0.01  # a routing choice may flip
    tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    for policy in (dict(experts="disk"), dict(experts="host", weights=(0, 0))):
        offloaded = LLM(tmp_path / "hf", dtype="float32", device="cpu", quantize="q8_0",
                        activations="float32", policy=Policy(**policy, offload_dir=tmp_path / "off"))
        assert [r.token_ids for r in offloaded.generate(PROMPTS, GREEDY)] == tokens
        for a, b in zip(prefill_and_decode_logits(offloaded), got):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_deepseeks_kv_b_is_quantised_as_per_head_k_b_and_v_b(tmp_path):
    """A float DeepSeek checkpoint quantised at load serves its kv_b as llama.cpp's k_b and
    v_b, packed, which the absorbed attention multiplies a head at a time: on the float path
    the logits are the float model's within the weights' rounding, and the integer path
    runs."""
    build("deepseek-v3", tmp_path / "hf", qk_nope_head_dim=32)
    llm = LLM(tmp_path / "hf", dtype="float32", device="cpu", quantize="q8_0",
              activations="float32")
    assert llm.executor.cfg.mla.kv_b_split
    layer = llm.executor.weights.take(0)
    llm.executor.weights.release(0)
    assert layer["k_b"].type_names == layer["v_b"].type_names == "Q8_0"
    heads, mla = llm.executor.cfg.num_heads, llm.executor.cfg.mla
    assert layer["k_b"].shape == (heads * mla.kv_lora_rank, mla.qk_nope_head_dim)
    want = prefill_and_decode_logits(LLM(tmp_path / "hf", dtype="float32", device="cpu"))
    for w, g in zip(want, prefill_and_decode_logits(llm)):
        assert kl_divergence(w, g).mean() < 0.01
    int8 = LLM(tmp_path / "hf", dtype="float32", device="cpu", quantize="q8_0")
    assert len(int8.generate(PROMPTS, GREEDY)[1].token_ids) == GREEDY.max_tokens


def test_the_quantised_file_is_written_once_and_reused(model, cache, monkeypatch):
    directory, _ = model
    first = LLM(directory, dtype="float32", device="cpu", quantize="q4_0")
    files = list((cache / "quantized").iterdir())
    assert [f.suffix for f in files] == [".safetensors"]  # no temporary file left

    def fail(*args):
        raise AssertionError("quantised again")

    monkeypatch.setattr(quantize_module, "quantize_matrix", fail)
    second = LLM(directory, dtype="float32", device="cpu", quantize="q4_0")
    assert [r.token_ids for r in second.generate(PROMPTS, GREEDY)] == \
        [r.token_ids for r in first.generate(PROMPTS, GREEDY)]
    # another type is another file; the float model shares nothing with them
    with pytest.raises(AssertionError, match="quantised again"):
        LLM(directory, dtype="float32", device="cpu", quantize="q8_0")
    assert list((cache / "quantized").iterdir()) == files  # the interrupted one left nothing


def test_an_interrupted_quantisation_leaves_no_file(model, cache, monkeypatch):
    directory, _ = model
    calls = []

    def interrupt(w, ggml_type):
        calls.append(w)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return torch.zeros(0, dtype=torch.uint8)

    monkeypatch.setattr(quantize_module, "quantize_matrix", interrupt)
    with pytest.raises(KeyboardInterrupt):
        LLM(directory, dtype="float32", device="cpu", quantize="q8_0")
    assert not list((cache / "quantized").iterdir())


def test_bad_values_and_quantised_ggufs_are_refused(model, tmp_path):
    directory, _ = model
    with pytest.raises(TiergenError, match="q8_0, q4_0, q4_k"):
        LLM(directory, quantize="q5_1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--quantize", "int4"])
    assert build_parser().parse_args(["generate", "hi", "--quantize", "q4_k"]).quantize == "q4_k"
    hf = build("llama-gqa-tied", tmp_path / "hf")
    write_model_gguf(hf, "llama", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(TiergenError, match="already quantised"):
        LLM(tmp_path / "q8.gguf", quantize="q8_0")
    # a float GGUF is quantised like a safetensors checkpoint (its Q/K rows in llama.cpp's
    # order: the same blocks, in another order). On the float path the logits agree to float
    # rounding; the integer path would move them by whole steps of its 8-bit activations.
    write_model_gguf(hf, "llama", tmp_path / "f32.gguf", gguf.GGMLQuantizationType.F32)
    from_gguf = LLM(tmp_path / "f32.gguf", dtype="float32", device="cpu", quantize="q8_0",
                    activations="float32")
    from_hf = LLM(tmp_path / "hf", dtype="float32", device="cpu", quantize="q8_0",
                  activations="float32")
    for a, b in zip(prefill_and_decode_logits(from_gguf), prefill_and_decode_logits(from_hf)):
        torch.testing.assert_close(a, b)


def test_parallel_ranks_open_the_same_quantised_model(model):
    """Each rank opens the model itself, quantised alike (from the cached file)."""
    directory, _ = model
    one = LLM(directory, dtype="float32", device="cpu", quantize="q8_0", activations="float32")
    with LLM(directory, dtype="float32", device="cpu", quantize="q8_0", activations="float32",
             pipeline_parallel=2) as two:
        assert [r.token_ids for r in two.generate(PROMPTS, GREEDY)] == \
            [r.token_ids for r in one.generate(PROMPTS, GREEDY)]
