"""The integer kernels (int8.c): activations quantised to int8 in blocks of 16 equal a plain
torch quantiser bit for bit, and every packed type's integer product equals the same
arithmetic done plainly (decoded weights times the quantised activations, in float64), up
to float rounding, on random blocks, odd shapes and tile edges."""

from __future__ import annotations

import pytest
import torch

from tiergen import kernels
from tiergen.weights.packed import PACKED_TYPES
from tiergen.weights.quant import GGMLType, dequantize, ggml_type_sizes
from test_packed import random_packed

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="needs the C kernels")


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 values, one scale per 16, and scale * sum per 16: the arithmetic int8.c does."""
    m, k = x.shape
    blocks = x.view(m, k // 16, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros(()))
    q = torch.round(blocks * inv)
    scale = (amax / 127.0).squeeze(-1)
    return q.to(torch.int8).view(m, k), scale, scale * q.sum(-1)


def test_activations_quantise_as_the_plain_reference():
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[2, :16] = 0  # an all-zero block: scale 0, values 0
    x[3, 5] = 40.0  # an outlier sets its block's scale alone
    got = kernels.quantize_activations(x)
    q, scale, sums = quantize_reference(x)
    assert torch.equal(got.q, q)
    assert torch.equal(got.scales, scale.repeat_interleave(4, dim=1))
    assert torch.equal(got.sums, sums)
    assert got.q[2, :16].abs().sum() == 0 and got.q.abs().max() <= 127


def integer_reference(x: torch.Tensor, w) -> torch.Tensor:
    q, scale, _ = quantize_reference(x)
    xd = (q.double().view(x.shape[0], -1, 16) * scale.double()[..., None]).view(x.shape)
    dense = torch.cat([dequantize(raw, t, (n, w.shape[1])) for t, _, n, raw in w.segments()])
    return (xd @ dense.double().T).float()


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert got.shape == want.shape
    if want.numel():
        assert ((got - want).abs().max() / want.abs().max()).item() < tol


@pytest.mark.parametrize("ggml_type", sorted(PACKED_TYPES), ids=lambda t: GGMLType(t).name)
# rows: the row-by-row kernel (1-4), the 8-row tiles over 4 activation rows at a time with a
# remainder or not, and prefill-sized products
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33, 100])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_integer_product_equals_the_plain_arithmetic(ggml_type, rows, wide):
    block = ggml_type_sizes(ggml_type)[0]
    # 67 output rows: the last 8-row tile holds 3; wide rows run past the 1024-value chunk
    cols = 1280 if wide else block * (11 if block == 32 else 3)
    w = random_packed(ggml_type, 67, cols, seed=ggml_type)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, :7] *= 30  # outliers in one block
    kernels.set_int8_activations(True)
    try:
        got = kernels.packed_linear(x, w)
        bias = torch.randn(67)
        got3 = kernels.packed_linear(x.view(1, rows, cols), w, bias)
    finally:
        kernels.set_int8_activations(False)
    want = integer_reference(x, w)
    assert_close_relative(got, want)
    assert_close_relative(got3, (want + bias).view(1, rows, 67))


def test_integer_products_are_near_the_float_ones_and_off_by_default():
    w = random_packed(GGMLType.Q4_K, 64, 512, 1)
    x = torch.randn(3, 512)
    exact = kernels.packed_linear(x, w)
    assert not kernels.int8_activations()
    kernels.set_int8_activations(True)
    try:
        approx = kernels.packed_linear(x, w)
    finally:
        kernels.set_int8_activations(False)
    err = ((approx - exact).abs().max() / exact.abs().max()).item()
    assert 0 < err < 0.05  # 8-bit activations: close, but not the float product
