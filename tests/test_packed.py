"""Packed weights: the kernels equal decode-then-multiply, and a model whose matrices stay
packed gives what the same model decoded at load gives, through every tier."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tiergen import LLM, Policy, SamplingParams
from tiergen import kernels
from tiergen.weights.packed import PACKED_TYPES, Packed, cat_rows, stack
from tiergen.weights.quant import GGMLType, dequantize, ggml_type_sizes
from test_gguf_model import GGUF_ARCH, write_model_gguf
from test_offload import prefill_and_decode_logits
from tiny_models import build

# byte offsets of each type's float16 scale fields (random bytes there would give NaN/inf)
F16_FIELDS = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,),
              GGMLType.Q5_1: (0, 2), GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2),
              GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}


def random_packed(ggml_type: int, rows: int, cols: int, seed: int = 0) -> Packed:
    rng = np.random.default_rng(seed)
    block, size = ggml_type_sizes(ggml_type)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS.get(ggml_type, ()):
        scale = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    if ggml_type == GGMLType.MXFP4:  # its E8M0 exponent: scales 2^-10 to 2^-3
        blocks[:, 0] = rng.integers(118, 126, size=len(blocks))
    if ggml_type == GGMLType.FP8:  # a float32 scale, then e4m3 values of every code but NaN
        scale = rng.uniform(1e-4, 1e-3, size=len(blocks)).astype(np.float32)
        blocks[:, :4] = scale.view(np.uint8).reshape(-1, 4)
        values = blocks[:, 4:]
        values[(values & 0x7F) == 0x7F] = 0x42
    return Packed(torch.from_numpy(blocks.reshape(-1)), (rows, cols), ((ggml_type, rows),))


def reference(x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    dense = torch.cat([dequantize(raw, t, (n, w.shape[1])) for t, _, n, raw in w.segments()])
    return torch.nn.functional.linear(x, dense, bias)


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.numel():
        assert ((got - want).abs().max() / want.abs().max()).item() < tol


def test_every_required_type_is_packed():
    names = {GGMLType(t).name for t in PACKED_TYPES}
    assert names == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "FP8"}


@pytest.fixture(params=["native", "torch"])
def kernel_path(request, monkeypatch):
    """The compiled kernels, and the plain-torch path used where they cannot be built."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "_lib", False)
    else:
        assert kernels.library() is not None, "the C kernels did not build on this machine"
    return request.param


@pytest.mark.parametrize("ggml_type", sorted(PACKED_TYPES), ids=lambda t: GGMLType(t).name)
# rows: the in-register kernel (1-3), the tiled one (4-row tiles, with a remainder or not, up
# to kernels.ROW_THRESHOLD = 32), and decode-then-BLAS above it
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 9, 17, 32, 40])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_packed_matmul_equals_dequantise_then_matmul(ggml_type, rows, wide, kernel_path):
    block = ggml_type_sizes(ggml_type)[0]
    # 67 output rows (odd: the tiles take 2) and 11 blocks per row (or 3 K-blocks); wide rows
    # run past the kernel's 1024-value tile and stop inside the second
    cols = 1280 if wide else block * (11 if block == 32 else 3)
    w = random_packed(ggml_type, 67, cols, seed=ggml_type)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    assert_close_relative(kernels.packed_linear(x, w), reference(x, w))
    bias = torch.randn(67)
    x3 = x.view(1, rows, x.shape[-1])
    assert_close_relative(kernels.packed_linear(x3, w, bias), reference(x3, w, bias))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ggml_type", sorted(PACKED_TYPES), ids=lambda t: GGMLType(t).name)
def test_packed_matmul_on_cuda(ggml_type):
    block = ggml_type_sizes(ggml_type)[0]
    w = random_packed(ggml_type, 67, block * (11 if block == 32 else 3), seed=ggml_type)
    x = torch.randn(5, w.shape[1])
    got = kernels.packed_linear(x.cuda(), w.to("cuda")).cpu()
    assert_close_relative(got, reference(x, w))


@pytest.mark.skipif(not kernels.amx_engine(), reason="needs AMX (bfloat16 tiles) and a build for it")
@pytest.mark.parametrize("ggml_type", sorted(PACKED_TYPES), ids=lambda t: GGMLType(t).name)
# output rows: a whole 32-column panel, and panels cut short (16 + 8, 100 = 3 x 32 + 4);
# activation rows: one, 32 exactly, and 37 (the engine's rows come in 32s); values: one
# panel chunk, and 2,560 (two chunks of 1,280: the second adds to the first's sums)
@pytest.mark.parametrize("n,rows", [(32, 32), (24, 1), (100, 37)])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_amx_product_is_its_plain_bfloat16_arithmetic(ggml_type, n, rows, wide):
    """amx.c: each weight and activation rounded to bfloat16 once (to nearest even), the
    products summed in float32: within float32 summation error of the exact sums."""
    block = ggml_type_sizes(ggml_type)[0]
    cols = 2560 if wide else block * (3 if block == 32 else 1)
    w = random_packed(ggml_type, n, cols, seed=n + ggml_type)
    x = torch.randn(1, rows, cols, generator=torch.Generator().manual_seed(rows))
    got = kernels.amx_linear(x, w)
    assert got is not None and got.shape == (1, rows, n) and got.dtype == torch.float32
    dense = reference(torch.eye(cols), w).T.bfloat16().double()  # decoded, rounded once
    xs = x.bfloat16().double()
    sums, size = xs @ dense.T, xs.abs() @ dense.abs().T
    assert ((got.double() - sums).abs() <= 1e-5 * size + 1e-30).all()
    # and not the float32 product: the rounding is there
    assert not torch.equal(got, reference(x, w))


@pytest.mark.skipif(not kernels.amx_engine(), reason="needs AMX (bfloat16 tiles) and a build for it")
def test_amx_product_of_mixed_types_writes_each_parts_columns():
    fused = cat_rows([random_packed(GGMLType.Q4_K, 48, 512, 1),
                      random_packed(GGMLType.Q6_K, 40, 512, 2),
                      random_packed(GGMLType.Q8_0, 16, 512, 3)])
    assert len(fused.parts) == 3
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(0))
    dense = reference(torch.eye(512), fused).T.bfloat16().double()
    want = x.bfloat16().double() @ dense.T
    torch.testing.assert_close(kernels.amx_linear(x, fused).double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_rounding_to_bfloat16_is_torchs(dtype):
    """kernels.to_bfloat16 (C where the layout allows) gives Tensor.bfloat16()'s bits: halfway
    cases to even, subnormals, infinities and NaN, for whole tensors and the cache's slices."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (2, 3, 70, 64), generator=g, dtype=torch.int64)
    bits = bits.to(torch.int32) & ~0xFFFF | 0x8000 | (bits.to(torch.int32) & 0x10000)  # halfway
    x = bits.view(torch.float32) if dtype == torch.float32 else torch.randn(2, 3, 70, 64).half()
    x.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40])
    if dtype == torch.float32:
        x.view(-1)[6:70] = torch.randn(64) * 1e-39  # subnormals
    for t in (x, x[:, :, :45], x[1, 2], x[:, 1:, :33], x.transpose(2, 3), x[..., :17]):
        got, want = kernels.to_bfloat16(t), t.bfloat16()
        assert got.is_contiguous() and got.dtype == torch.bfloat16 and got.shape == t.shape
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_mixed_types_fuse_into_parts(kernel_path):
    q = random_packed(GGMLType.Q4_K, 64, 512, 1)
    kv = random_packed(GGMLType.Q6_K, 32, 512, 2)
    v = random_packed(GGMLType.Q6_K, 32, 512, 3)
    fused = cat_rows([q, kv, v])
    assert fused.parts == ((GGMLType.Q4_K, 64), (GGMLType.Q6_K, 64))
    x = torch.randn(2, 512)
    want = torch.cat([reference(x, m) for m in (q, kv, v)], dim=-1)
    assert_close_relative(kernels.packed_linear(x, fused), want)
    dense = kernels.dequantize_into(fused, torch.empty(128, 512))
    torch.testing.assert_close(x @ dense.T, want, rtol=1e-5, atol=1e-5)


def test_embedding_rows():
    w = cat_rows([random_packed(GGMLType.Q8_0, 10, 64, 4), random_packed(GGMLType.Q4_1, 6, 64, 5)])
    dense = w.dequantize()
    ids = torch.tensor([[15, 0, 9], [10, 10, 3]])
    torch.testing.assert_close(w.rows(ids, torch.float32), dense[ids], rtol=0, atol=0)


def test_experts_stack_into_one_packed_tensor():
    """Routed experts: E matrices of one layout stack into (E, out, in); expert e is a view
    of its bytes, and a mix of layouts or of packed and float stacks as floats."""
    experts = [cat_rows([random_packed(GGMLType.Q4_K, 8, 256, e),
                         random_packed(GGMLType.Q6_K, 8, 256, 9 + e)]) for e in range(3)]
    stacked = stack(experts)
    assert stacked.shape == (3, 16, 256) and stacked.parts == experts[0].parts
    assert stacked.nbytes == sum(m.nbytes for m in experts)
    for e, m in enumerate(experts):
        assert stacked[e].shape == m.shape and torch.equal(stacked[e].data, m.data)
        assert stacked[e].data.data_ptr() == stacked.data.data_ptr() + e * m.nbytes
    torch.testing.assert_close(stacked.dequantize(), torch.stack([m.dequantize() for m in experts]),
                               rtol=0, atol=0)
    mixed = stack([experts[0], random_packed(GGMLType.Q8_0, 16, 256)])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == (2, 16, 256)
    torch.testing.assert_close(mixed[0], experts[0].dequantize(), rtol=0, atol=0)
    with pytest.raises(Exception, match="needs"):
        Packed(stacked.data[:-1], stacked.shape, stacked.parts)


def test_corrupt_sizes_are_refused():
    w = random_packed(GGMLType.Q4_0, 4, 64)
    with pytest.raises(Exception, match="needs 144 bytes, got 143"):
        Packed(w.data[:-1], w.shape, w.parts)


PROMPTS = [[5], list(range(3, 30)), [7, 8, 9], [100, 3, 17, 4]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
POLICIES = {"device": Policy(), "host": Policy(weights=(0, 100)),
            "disk": Policy(weights=(0, 0), gpu_batch_size=2, num_gpu_batches=2),
            "three-tiers": Policy(weights=(30, 30))}


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "Q4_1"])
def packed_gguf(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"packed-{request.param}")
    hf = build("llama-gqa-tied", directory / "hf")
    path = directory / "model.gguf"
    write_model_gguf(hf, GGUF_ARCH["llama-gqa-tied"], path, gguf.GGMLQuantizationType[request.param])
    decoded = LLM(path, dtype="float32", device="cpu", packed=False)
    return path, [r.token_ids for r in decoded.generate(PROMPTS, GREEDY)], decoded


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_packed_model_equals_decoded_model(packed_gguf, policy, device, tmp_path):
    path, tokens, decoded = packed_gguf
    p = POLICIES[policy]
    p.offload_dir = str(tmp_path)
    llm = LLM(path, dtype="float32", activations="float32", device=device, policy=p)
    layer = llm.executor.weights.take(0)
    assert isinstance(layer["qkv"], Packed) and isinstance(llm.executor.globals["embed"], Packed)
    llm.executor.weights.release(0)
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens
    # logits of mixed-length prefill and decode within float32 rounding of the decoded model
    for got, want in zip(prefill_and_decode_logits(llm), prefill_and_decode_logits(decoded)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_integer_path_is_the_same_through_every_tier(packed_gguf, policy, tmp_path):
    """The integer path (the default on a CPU) computes the same whatever tier the blocks
    come from, and stays near the float path. A policy that cuts the batch into micro-batches
    changes which kernel a product takes (row kernel, tiles, the BLAS over the same quantised
    values) and so the float rounding, which can move an activation across an int8 rounding
    step: the logits then agree to about that step, not bit for bit."""
    path, tokens, decoded = packed_gguf
    p = POLICIES[policy]
    p.offload_dir = str(tmp_path)
    resident = LLM(path, dtype="float32", device="cpu")
    assert resident.activations == "int8"
    llm = LLM(path, dtype="float32", device="cpu", policy=p)
    for got, want, exact in zip(prefill_and_decode_logits(llm),
                                prefill_and_decode_logits(resident),
                                prefill_and_decode_logits(decoded)):
        if p.gpu_batch_size is None:
            assert torch.equal(got, want)
        else:
            assert (got - want).abs().max() < 0.02 * want.abs().max()
        assert 0 < (got - exact).abs().max() < 0.05 * exact.abs().max()
    assert kernels.activations() == "float32"  # the thread is left as it was


def test_packed_weights_on_disk_are_read_from_the_gguf(packed_gguf, tmp_path):
    """On the disk tier a GGUF's blocks are read where they lie in the file, nothing converted:
    Q and K rows too, multiplied in llama.cpp's order (RopeConfig.pairs)."""
    path, tokens, _ = packed_gguf
    llm = LLM(path, dtype="float32", activations="float32",
              policy=Policy(weights=(0, 0), offload_dir=tmp_path))
    disk = llm.executor.weights.disk
    assert disk.converted is None and not list(tmp_path.rglob("*.bin"))
    assert {k.split("/")[1] for k in disk.entries} == {"input_norm", "post_norm", "qkv", "o",
                                                      "gate_up", "down"}
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens
    resident = LLM(path, dtype="float32", device="cpu").executor.weights.resident
    for j, layer in enumerate(resident):
        for name, want in layer.items():
            shape, dtype = disk.shape(j, name)
            assert torch.equal(disk.read_into(j, name, torch.empty(shape, dtype=dtype)), want)


def test_packed_plan_counts_packed_bytes(packed_gguf, tmp_path):
    path, _, decoded = packed_gguf
    packed = LLM(path, dtype="float32", device="cpu").executor.weight_plan.needs()["device"]
    dense = decoded.executor.weight_plan.needs()["device"]
    assert packed < dense / 2


def test_types_without_kernels_are_decoded_with_a_warning(packed_gguf, monkeypatch, caplog):
    from tiergen.weights import gguf_map

    path, tokens, _ = packed_gguf
    monkeypatch.setattr(gguf_map, "PACKED_TYPES", frozenset())
    with caplog.at_level("WARNING", logger="tiergen"):
        llm = LLM(path, dtype="float32", activations="float32", device="cpu")
    assert "have no packed kernel; they are decoded to float" in caplog.text
    assert not isinstance(llm.executor.globals["embed"], Packed)
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens


def test_matrices_back_to_back_join_without_a_copy():
    """Packed matrices that lie one after the other in one buffer (a GGUF's gate and up)
    fuse into a view of it; others are copied. Either way the result is the same matrix."""
    a, b = random_packed(GGMLType.Q4_1, 8, 64, seed=1), random_packed(GGMLType.Q4_1, 4, 64, seed=2)
    buf = torch.cat([a.data, b.data, torch.zeros(3, dtype=torch.uint8), b.data])
    n, m = a.nbytes, b.nbytes
    first = Packed(buf[:n], a.shape, a.parts)
    apart = Packed(buf[n + m + 3:], b.shape, b.parts)
    joined = cat_rows([first, Packed(buf[n:n + m], b.shape, b.parts)])
    assert joined.data.data_ptr() == buf.data_ptr()  # a view: nothing copied
    copied = cat_rows([first, apart])
    assert copied.data.data_ptr() != buf.data_ptr()
    want = torch.cat([a.dequantize(torch.float32), b.dequantize(torch.float32)])
    assert torch.equal(joined.dequantize(torch.float32), want)
    assert torch.equal(copied.dequantize(torch.float32), want)


@pytest.mark.parametrize("ggml_type", sorted(PACKED_TYPES), ids=lambda t: GGMLType(t).name)
def test_every_instruction_set_build_multiplies_as_dequantise_then_matmul(isa_library, ggml_type,
                                                                         monkeypatch):
    """The float kernels of each instruction set's build, at the row counts of each path."""
    monkeypatch.setattr(kernels, "_lib", isa_library)
    block = ggml_type_sizes(ggml_type)[0]
    for cols in (block * (11 if block == 32 else 3), 1280):
        w = random_packed(ggml_type, 67, cols, seed=ggml_type)
        for rows in (1, 2, 3, 5, 9, 40):
            x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
            assert_close_relative(kernels.packed_linear(x, w), reference(x, w))
