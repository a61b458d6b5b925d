"""Group-wise quantisation: error bound per group, exact corners, layout, sizes, errors."""

from __future__ import annotations

import pytest
import torch

from tiergen.errors import TiergenError
from tiergen.offload.compress import Compressed, decompress, compress, compressed_nbytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values with a per-row offset and a few outliers, rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2 + torch.randn(shape[:-1] + (1,), generator=g) * 5
    x.view(-1)[:: 97] *= 20
    return x.to(dtype)


def grouped(t: torch.Tensor, group_size: int, dim: int = -1) -> torch.Tensor:
    """``t`` in float32 as (groups, group_size), groups in the order compress() uses."""
    return t.movedim(dim, -1).reshape(-1, group_size).float()


def tolerance(x: torch.Tensor, group_size: int, dim: int = -1) -> torch.Tensor:
    """Rounding slack per group: the cast back to x.dtype plus float32 arithmetic."""
    absmax = grouped(x, group_size, dim).abs().amax(dim=1, keepdim=True)
    return (torch.finfo(x.dtype).eps + 1e-6) * absmax


def check_bound(x: torch.Tensor, q: Compressed, dim: int = -1) -> None:
    err = (grouped(x, q.group_size, dim) - grouped(decompress(q), q.group_size, dim)).abs()
    bound = q.scale / 2 + tolerance(x, q.group_size, dim)
    worst = (err - bound).amax()
    assert worst <= 0, f"error exceeds scale/2 by {worst.item():.3g}"


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_within_half_a_step_per_group(dtype, bits, group_size):
    for shape in [(24, 256), (2, 3, 5, 128)]:  # a weight (out, in); a KV cache (..., head_dim)
        x = sample(shape, dtype)
        q = compress(x, bits=bits, group_size=group_size)
        assert q.scale.shape == (x.numel() // group_size, 1)
        check_bound(x, q)
        # the bound is per group: the reference scale is (max - min) / (2**bits - 1)
        g = grouped(x, group_size)
        expected = (g.amax(dim=1, keepdim=True) - g.amin(dim=1, keepdim=True)) / (2**bits - 1)
        torch.testing.assert_close(q.scale, expected)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_groups_round_trip_exactly(dtype, bits):
    x = sample((4, 128), dtype)
    x[0, :64] = 0
    x[1, 64:] = 3.7
    x[2] = -1e3
    q = compress(x, bits=bits, group_size=64)
    y = decompress(q)
    assert torch.equal(y[0, :64], x[0, :64])
    assert torch.equal(y[1, 64:], x[1, 64:])
    assert torch.equal(y[2], x[2])
    assert (q.scale.view(4, 2)[[0, 1, 2, 2], [0, 1, 0, 1]] == 0).all()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_min_and_max_are_reproduced(dtype, bits):
    x = sample((16, 256), dtype, seed=3)
    q = compress(x, bits=bits, group_size=64)
    g, y = grouped(x, 64), grouped(decompress(q), 64)
    lo, hi = g.argmin(dim=1, keepdim=True), g.argmax(dim=1, keepdim=True)
    assert torch.equal(y.gather(1, lo), g.gather(1, lo))  # code 0 gives the minimum exactly
    slack = 1e-6 * g.abs().amax(dim=1, keepdim=True)  # float32 rounding of scale * 2**bits-1
    assert ((y.gather(1, hi) - g.gather(1, hi)).abs() <= slack).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape_dtype_device_and_out_buffer(dtype, device):
    x = sample((3, 7, 64), dtype).to(device)
    q = compress(x, bits=4, group_size=32)
    assert q.data.dtype == torch.uint8 and q.data.device == x.device
    assert (q.shape, q.dtype, q.bits, q.group_size, q.dim) == ((3, 7, 64), dtype, 4, 32, 2)
    y = decompress(q)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert y.is_contiguous()
    out = torch.full_like(x, float("nan"))
    result = decompress(q, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, y)
    with pytest.raises(TiergenError, match="out buffer"):
        decompress(q, out=torch.empty(3, 7, 64, dtype=torch.float64, device=device))
    with pytest.raises(TiergenError, match="out buffer"):
        decompress(q, out=torch.empty(3, 64, 7, dtype=dtype, device=device))


@pytest.mark.parametrize("shape,group_size", [((1536, 576), 64), ((2, 4, 10, 64), 64),
                                              ((8, 128), 32), ((4, 256), 128), ((0, 64), 64)])
@pytest.mark.parametrize("bits", [4, 8])
def test_nbytes_matches_planner(shape, group_size, bits):
    x = torch.randn(shape, dtype=torch.float16)
    q = compress(x, bits=bits, group_size=group_size)
    assert compressed_nbytes(shape, bits, group_size) == q.nbytes
    n = x.numel()
    # codes at bits/8 bytes per element, plus a float32 scale and minimum per group
    assert q.nbytes == n * bits // 8 + (n // group_size) * 8
    assert q.data.numel() == n * bits // 8
    if bits == 4 and n:
        fp16 = n * 2
        assert q.nbytes == fp16 // 4 + fp16 * 4 // group_size  # 0.3125 of float16 at 64


def test_bad_arguments_say_what_to_change():
    x = torch.randn(4, 96)
    for bits in (2, 3, 16):
        with pytest.raises(TiergenError, match="use bits=4 or bits=8"):
            compress(x, bits=bits)
        with pytest.raises(TiergenError, match="use bits=4 or bits=8"):
            compressed_nbytes((4, 96), bits, 32)
    with pytest.raises(TiergenError, match=r"96 elements, not a multiple of the group size 64"):
        compress(x, group_size=64)
    with pytest.raises(TiergenError, match="multiple of the group size"):
        compressed_nbytes((4, 96), 4, 64)
    with pytest.raises(TiergenError, match="group size"):
        compress(x, group_size=0)
    with pytest.raises(TiergenError, match="even group size"):
        compress(torch.randn(4, 99), bits=4, group_size=33)
    with pytest.raises(TiergenError, match="dim that exists"):
        compress(x, group_size=32, dim=2)
    with pytest.raises(TiergenError, match="floating-point"):
        compress(torch.ones(4, 64, dtype=torch.int32))
    compress(torch.randn(4, 99), bits=8, group_size=33)  # odd groups are fine at 8 bits


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouping_another_dim(dtype, bits):
    x = sample((5, 128, 3), dtype).transpose(0, 1)  # (128, 5, 3), non-contiguous
    q = compress(x, bits=bits, group_size=32, dim=0)
    assert q.dim == 0
    y = decompress(q)
    assert y.shape == x.shape and y.dtype == dtype
    check_bound(x, q, dim=0)
    # same codes as grouping the last dim of the moved tensor
    moved = compress(x.movedim(0, -1).contiguous(), bits=bits, group_size=32)
    assert torch.equal(q.data, moved.data) and torch.equal(q.scale, moved.scale)
    assert torch.equal(y, decompress(moved).movedim(-1, 0))
    assert torch.equal(decompress(compress(x, bits=bits, group_size=32, dim=-3)), y)
    with pytest.raises(TiergenError, match="not a multiple"):
        compress(x, group_size=32, dim=1)


def test_four_bit_nibble_layout():
    x = torch.arange(16, dtype=torch.float32).view(1, 16)  # min 0, scale 1: codes are x
    q = compress(x, bits=4, group_size=16)
    assert q.data.tolist() == [[0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF]]
    assert torch.equal(decompress(q), x)


def test_to_and_tensors_round_trip():
    x = sample((6, 128), torch.bfloat16)
    q = compress(x, bits=4, group_size=64)
    moved = q.to("cpu")
    assert torch.equal(decompress(moved), decompress(q))
    parts = {k: v.clone() for k, v in q.tensors().items()}
    assert set(parts) == {"data", "scale", "minimum"}
    assert sum(t.numel() * t.element_size() for t in parts.values()) == q.nbytes
    back = Compressed.from_tensors(parts, (6, 128), torch.bfloat16, 4, 64)
    assert torch.equal(decompress(back), decompress(q))
    with pytest.raises(TiergenError, match="do not match"):
        Compressed.from_tensors(parts, (6, 128), torch.bfloat16, 8, 64)
