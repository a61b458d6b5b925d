"""``linear``: on CPUs without native bfloat16 many rows are multiplied widened to float32; on
AMX tiles a bfloat16 matrix as stored multiplies few rows by amx.c."""

import pytest
import torch
import torch.nn.functional as F

from tiergen import kernels
from tiergen.models import layers


def test_many_bfloat16_rows_are_multiplied_in_float32_on_slow_cpus(monkeypatch):
    calls = []
    real = F.linear

    def spy(x, w, b=None):
        calls.append(x.dtype)
        return real(x, w, b)

    monkeypatch.setattr(layers, "cpu_has_fast_bfloat16", lambda: False)
    monkeypatch.setattr(kernels, "dense_bfloat16_linear", lambda *a: None)  # (no AMX there)
    monkeypatch.setattr(layers.F, "linear", spy)
    torch.manual_seed(0)
    monkeypatch.setattr(layers, "UPCAST_SCRATCH", 96 * 10)  # 10 rows at a time: 5 slices
    w, b = torch.randn(48, 96).bfloat16(), torch.randn(48).bfloat16()
    for shape, widened in (((layers.UPCAST_ROWS - 1, 96), torch.bfloat16),
                           ((layers.UPCAST_ROWS, 96), torch.float32), ((3, 50, 96), torch.float32)):
        calls.clear()
        x = torch.randn(shape).bfloat16()
        y = layers.linear(x, w, b)
        assert set(calls) == {widened} and len(calls) == (5 if widened == torch.float32 else 1)
        assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], 48)
        want = real(x.float(), w.float(), b.float())
        torch.testing.assert_close(y.float(), want, atol=1e-6, rtol=2**-8)  # one bf16 rounding


@pytest.mark.skipif(not kernels.amx_engine(), reason="needs AMX (bfloat16 tiles) and a build for it")
# rows: one, a tile and one, and past the 256 tokens laid out at a time; matrix rows: whole
# 32-row panels, and a last panel cut short; values: two tile steps, and SmolLM2's width
@pytest.mark.parametrize("rows,n,k", [(1, 64, 64), (17, 40, 576), (33, 96, 64), (300, 100, 576)])
def test_amx_dense_product_is_its_plain_bfloat16_arithmetic_and_each_rows_own(rows, n, k):
    """amx.c on a bfloat16 matrix as stored: the exact products summed in float32 and rounded to
    bfloat16 once (with a bias: added before that rounding); every row's numbers the same alone
    as in the batch, to the bit."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w, b = torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    sums, size = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    for bias, want in ((None, sums), (b, sums + b.double())):
        got = kernels.dense_bfloat16_linear(x, w, bias)
        assert got is not None and got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # within float32 summation error of the exact sums, then one rounding to bfloat16
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * size).all()
        alone = torch.cat([kernels.dense_bfloat16_linear(r, w, bias) for r in x.split(1)])
        assert torch.equal(alone, got)


@pytest.mark.skipif(not kernels.amx_engine(), reason="needs AMX (bfloat16 tiles) and a build for it")
def test_linear_takes_amx_for_few_bfloat16_rows_and_torch_for_many(monkeypatch):
    taken = []
    real = kernels.dense_bfloat16_linear
    monkeypatch.setattr(kernels, "dense_bfloat16_linear",
                        lambda *a: taken.append(a[0].shape[:-1].numel()) or real(*a))
    w = torch.randn(48, 96).bfloat16()
    for rows in (1, kernels.AMX_DENSE_ROWS, kernels.AMX_DENSE_ROWS + 1):
        y = layers.linear(torch.randn(1, rows, 96).bfloat16(), w)
        assert y.shape == (1, rows, 48) and y.dtype == torch.bfloat16
    assert taken == [1, kernels.AMX_DENSE_ROWS]
    assert kernels.dense_bfloat16_linear(torch.empty(0, 96).bfloat16(), w) is None  # no rows
    with kernels.activations_set("float32", batch_invariant=True):  # every row its own
        layers.linear(torch.randn(1, 100, 96).bfloat16(), w)
    assert taken[-1] == 100


def _mlp_passes(monkeypatch, x, gate_up, down, gelu=False):
    """The MLP on x in passes of layers.MLP_ROWS rows (the rows of each pass through gate_up
    recorded), and on all of x at once."""
    passes, linear = [], layers.linear

    def recorded(x, w, *args, **kw):
        if w is gate_up:
            passes.append(x.shape[:-1].numel())
        return linear(x, w, *args, **kw)

    mlp = layers.gelu_tanh_mlp if gelu else layers.swiglu_mlp
    monkeypatch.setattr(layers, "linear", recorded)
    got, in_passes = mlp(x, gate_up, down), list(passes)
    monkeypatch.setattr(layers, "MLP_ROWS", 1 << 30)
    return got, mlp(x, gate_up, down), in_passes


def test_a_prefill_mlp_runs_over_many_rows_in_passes_with_the_same_integer_products(monkeypatch):
    from test_packed import random_packed
    from tiergen import kernels
    from tiergen.weights.quant import GGMLType

    gate_up, down = random_packed(GGMLType.Q4_1, 2 * 96, 64), random_packed(GGMLType.Q4_0, 64, 96)
    x = torch.randn(3, 700, 64)  # 2,100 rows: passes of 512, the last taking the remainder
    gate_up.may_keep_tiles = down.may_keep_tiles = True  # as resident weights may
    with kernels.activations_set("int8"):
        for gelu in (False, True):
            got, whole, passes = _mlp_passes(monkeypatch, x, gate_up, down, gelu)
            monkeypatch.undo()
            assert passes == [512, 512, 512, 564]
            assert got.shape == (3, 700, 64)
            assert torch.equal(got, whole)  # each row's numbers do not depend on the rows beside it
    assert gate_up.tiles is None and down.tiles is None  # a prompt's rows keep no tiles


def test_a_float_mlp_over_many_rows_in_passes_equals_it_at_once(monkeypatch):
    gate_up, down = torch.randn(2 * 96, 64), torch.randn(64, 96)
    got, whole, passes = _mlp_passes(monkeypatch, torch.randn(1100, 64), gate_up, down)
    assert passes == [512, 588]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    _, _, passes = _mlp_passes(monkeypatch, torch.randn(2, 500, 64), gate_up, down)
    assert passes == [1000]  # fewer than two passes' worth: at once


def test_a_prompts_mlp_on_amx_tiles_rounds_its_activation_where_it_makes_it(monkeypatch):
    """On AMX tiles (every row there) act(gate) * up comes out rounded to bfloat16 for down's
    tiles: the same numbers, to the bit, as down rounding the float32 activation itself."""
    from test_packed import random_packed
    from tiergen.weights.quant import GGMLType

    gate_up, down = random_packed(GGMLType.Q4_1, 2 * 256, 64), random_packed(GGMLType.Q4_0, 64, 256)
    x = torch.randn(2, 48, 64)
    rounded = []
    real = kernels.rounded_linear
    monkeypatch.setattr(kernels, "rounded_linear",  # (down's inputs recorded)
                        lambda a, w, *args: (rounded.append(a.dtype) if w is down else None)
                        or real(a, w, *args))
    with kernels.activations_set("int8"), kernels.rows_on_amx(torch.ones(2, dtype=torch.bool)):
        for gelu in (False, True):
            got = (layers.gelu_tanh_mlp if gelu else layers.swiglu_mlp)(x, gate_up, down)
            act = layers._glu(layers.linear(x, gate_up), gelu)  # float32
            assert act.dtype == torch.float32
            assert got.dtype == torch.float32 and torch.equal(got, layers.linear(act, down))
    assert rounded == [torch.bfloat16, torch.float32] * 2  # the MLP's, then linear's above
