"""The integer kernels (int8.c): activations quantised to int8 in scale groups of 16 equal a plain
torch quantiser bit for bit, and every packed type's integer product equals the same
arithmetic done plainly (decoded weights times the quantised activations in float64, and for
the 8-bit tiles their float32 reading of each block's sum, see tile_reference), up to float
rounding, on random blocks, odd shapes and tile edges."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tiergen import kernels
from tiergen._platform import amx_usable
from tiergen.weights.packed import INTEGER_TYPES, Packed, cat_rows
from tiergen.weights.quant import GGMLType, dequantize, ggml_type_sizes
from test_packed import random_packed

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="needs the C kernels")


# (values per scale, 16-bit): the activation formats the kernels take
FORMATS = [(4, False), (8, False), (16, False), (16, True)]
FORMAT_IDS = ["int8/4", "int8/8", "int8/16", "int16/16"]


def quantize_reference(x: torch.Tensor, group: int, wide: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer values (int32) and one scale per ``group`` values, and the sums of scale *
    value per 16: the arithmetic int8.c does."""
    m, k = x.shape
    top = 32512.0 if wide else 127.0
    groups = x.view(m, k // group, group)
    amax = groups.abs().amax(-1, keepdim=True)
    # a true division (a number over a tensor is a reciprocal times it in torch)
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, torch.zeros(()))
    q = torch.round(groups * inv)
    scale = (amax / top).squeeze(-1)
    sums = (scale.double() * q.sum(-1).double()).view(m, k // 16, 16 // group)
    total = sums[..., 0]
    for j in range(1, 16 // group):  # in order, as int8.c adds them
        total = total + sums[..., j]
    return q.to(torch.int32).view(m, k), scale, total.float()


@pytest.mark.parametrize("group,wide", FORMATS, ids=FORMAT_IDS)
def test_activations_quantise_as_the_plain_reference(group, wide):
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[2, :16] = 0  # an all-zero group: scale 0, values 0
    x[3, 5] = 40.0  # an outlier sets its group's scale alone
    got = kernels.quantize_activations(x, group, wide)
    q, scale, sums = quantize_reference(x, group, wide)
    values = got.q.int() if got.low is None else 255 * got.q.int() + got.low.int()
    assert torch.equal(values, q)
    assert torch.equal(got.scales, scale.repeat_interleave(group // 4, dim=1))
    assert torch.equal(got.sums, sums)
    assert got.q[2, :16].abs().sum() == 0 and got.q.abs().max() <= 127
    assert (got.low is None) == (not wide)
    if wide:  # both halves multiply as int8 (and a sign flip of either stays in range)
        assert got.low.abs().max() <= 127 and q.abs().max() == 32512


def test_activation_formats_that_do_not_exist_are_refused():
    with pytest.raises(ValueError, match="4, 8 or 16"):
        kernels.quantize_activations(torch.randn(1, 32), 32)
    with pytest.raises(ValueError, match="16-bit activations come in groups of 16"):
        kernels.quantize_activations(torch.randn(1, 32), 8, wide=True)


def integer_reference(x: torch.Tensor, w, group: int, wide: bool) -> torch.Tensor:
    """The product as the kernels do it: the row-by-row kernels and the 16-bit tiles exactly,
    up to float rounding; the 8-bit tiles as :func:`tile_reference`, for the parts whose
    product takes them (the library says which: more than a few rows, and with AVX-512 a few
    more for the types its row kernels take into registers)."""
    q, scale, _ = quantize_reference(x, group, wide)
    xd = (q.double().view(x.shape[0], -1, group) * scale.double()[..., None]).view(x.shape)
    dense = torch.cat([dequantize(raw, t, (n, w.shape[1])) for t, _, n, raw in w.segments()])
    exact = (xd @ dense.double().T).float()
    tiled = [not wide and bool(kernels.library().tg_takes_tiles(t, w.shape[1], x.shape[0], group,
                                                                0))
             for t, _, _, _ in w.segments()]
    if not any(tiled):
        return exact
    where = torch.cat([torch.full((n,), tile) for (_, _, n, _), tile in zip(w.segments(), tiled)])
    return torch.where(where, tile_reference(x, w, group), exact)


MAGIC = 12582912.0  # int8.c's MAGIC: 1.5 * 2^23


def tile_view(w) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weights as the tiles hold them (int8.c's tg_tile_view): integer values (n, k) and
    per 16 values a scale and an offset (n, k / 16), checked to give the decoded weights."""
    lib, k = kernels.library(), w.shape[1]
    qs, scales, offsets = [], [], []
    for ggml_type, _, n, raw in w.segments():
        q = torch.empty(n, k, dtype=torch.uint8)
        a, c = torch.empty(n, k // 16), torch.empty(n, k // 16)
        signed = ctypes.c_int()
        nb = n * k // ggml_type_sizes(ggml_type)[0]
        assert lib.tg_tile_view(ggml_type, raw.data_ptr(), nb, q.data_ptr(), a.data_ptr(),
                                c.data_ptr(), ctypes.byref(signed)) == 0
        q = (q.view(torch.int8) if signed.value else q).double()
        values = q.view(n, -1, 16) * a.double()[..., None] + c.double()[..., None]
        dense = dequantize(raw, ggml_type, (n, k)).double()
        torch.testing.assert_close(values.view(n, k), dense, rtol=1e-6, atol=1e-6)
        qs.append(q), scales.append(a), offsets.append(c)
    return torch.cat(qs), torch.cat(scales), torch.cat(offsets)


def tile_reference(x: torch.Tensor, w, group: int) -> torch.Tensor:
    """The 8-bit tiles' arithmetic done plainly: each activation group's integer sum D,
    read as the float32 MAGIC + D, multiply-added with the group's scale into a part per 16
    values that starts at -MAGIC times the sum of their scales; the parts take the weights'
    scales and offsets in float64 (the kernels add them in float32, whose rounding alone
    stays below the comparison's tolerance). Each float32 multiply-add is one float64 one
    rounded to float32."""
    q, scale, sums = quantize_reference(x, group, False)
    wq, a, c = tile_view(w)
    m, k = q.shape
    d = torch.einsum("mbl,nbl->mnb", q.double().view(m, k // group, group),
                     wq.view(-1, k // group, group)).view(m, -1, k // 16, 16 // group)
    s = scale.view(m, k // 16, 16 // group)
    part = (-MAGIC * s.double().sum(-1)).float()[:, None].expand(-1, d.shape[1], -1)
    for b in range(16 // group):
        part = ((MAGIC + d[..., b]) * s[:, None, :, b].double() + part.double()).float()
    return (part.double() * a.double() + c.double() * sums.double()[:, None]).sum(-1).float()


def assert_close_relative(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert got.shape == want.shape
    if want.numel():
        assert ((got - want).abs().max() / want.abs().max()).item() < tol


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
# rows: the row-by-row kernel (1-4), the 8-row tiles over 4 activation rows at a time with a
# remainder or not, and prefill-sized products
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 33, 100])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("group,wide_act", FORMATS, ids=FORMAT_IDS)
def test_integer_product_equals_the_plain_arithmetic(ggml_type, rows, wide, group, wide_act):
    qk = ggml_type_sizes(ggml_type)[0]
    # 67 output rows: the last 8-row tile holds 3; wide rows run past the 1024-value chunk
    cols = 1280 if wide else qk * (11 if qk == 32 else 3)
    w = random_packed(ggml_type, 67, cols, seed=ggml_type)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, :7] *= 30  # outliers in one group
    got = kernels.integer_linear(x, w, None, group, wide_act)
    bias = torch.randn(67)
    got3 = kernels.integer_linear(x.view(1, rows, cols), w, bias, group, wide_act)
    want = integer_reference(x, w, group, wide_act)
    assert_close_relative(got, want)
    assert_close_relative(got3, (want + bias).view(1, rows, 67))


@pytest.mark.parametrize("kind", ["int8", "int16"])
def test_packed_products_take_the_integer_kernels_when_asked(kind):
    w = random_packed(GGMLType.Q4_K, 64, 512, 1)
    x = torch.randn(3, 512)
    many = torch.randn(kernels.ROW_THRESHOLD + 1, 512)
    exact = kernels.packed_linear(x, w)
    assert kernels.activations() == "float32"
    with kernels.activations_set(kind):
        approx = kernels.packed_linear(x, w)
        got_many = kernels.packed_linear(many, w)
    assert kernels.activations() == "float32"
    fmt = kernels.ACTIVATION_FORMATS[kind]
    assert torch.equal(approx, kernels.integer_linear(x, w, None, *fmt))
    err = ((approx - exact).abs().max() / exact.abs().max()).item()
    assert 0 < err < (0.02 if kind == "int8" else 1e-4)
    # more rows than ROW_THRESHOLD (a prompt): the same tiles, so each row gets the same
    # numbers as in any other product that takes the tiles (8 rows do on every build)
    assert torch.equal(got_many, kernels.integer_linear(many, w, None, *fmt))
    assert torch.equal(got_many[:8], kernels.integer_linear(many[:8], w, None, *fmt))
    assert_close_relative(got_many, integer_reference(many, w, *fmt))
    with pytest.raises(ValueError, match="float32, int8, int16"):
        kernels.set_activations("int4")


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
def test_a_prompts_product_on_amx_tiles_is_the_plain_bfloat16_arithmetic(ggml_type):
    """Products of the rows of prompts of AMX_PROMPT tokens or more on the integer path,
    where AMX works (a decode step's rows, however many, take the integer kernels): the matrix
    decoded, it and the rows rounded to bfloat16, their products summed in float32 (on the
    tiles by amx.c, or by oneDNN, each in its own order; oneDNN rounds the sums to bfloat16),
    the bias added in float32. The arithmetic is checked on every machine."""
    w = random_packed(ggml_type, 96, 256, 2)
    x = torch.randn(kernels.AMX_PROMPT, 256, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(96)
    dense = w.dequantize().bfloat16().double()
    sums = x.bfloat16().double() @ dense.T
    got = kernels._bfloat16_linear(x, w, bias)
    assert got.dtype == torch.float32
    # the float32 sums may round to the neighbouring bfloat16 of the exact sums' (2**-7)
    assert ((got - bias).double() - sums).abs().le(sums.abs() * 2**-7 + 1e-6).all()
    with kernels.activations_set("int8"):
        plain = kernels.packed_linear(x[None], w, bias)[0]  # outside a step: integer kernels
        with kernels.rows_on_amx(kernels.amx_rows(torch.tensor([kernels.AMX_PROMPT]))):
            taken = kernels.packed_linear(x[None], w, bias)[0]
        rows = kernels.packed_linear(x[:, None], w, bias)[:, 0]  # one token of each sequence
    assert torch.equal(rows, kernels.integer_linear(x, w, bias, 8))
    assert torch.equal(plain, kernels.integer_linear(x, w, bias, 8))
    assert torch.equal(taken, got if amx_usable() else plain)


@pytest.mark.skipif(not amx_usable(), reason="needs AMX")
def test_a_steps_rows_on_amx_and_off_are_each_their_own_product():
    """A prompt step that mixes rows of long prompts (AMX tiles) and short ones (integer
    kernels): each row's product and attention are what it gets alone."""
    from tiergen.cache.attention import attention

    w = random_packed(GGMLType.Q4_1, 96, 256, 3)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 40, 256, generator=g)
    q = torch.randn(3, 4, 40, 64, generator=g)
    k, v = (torch.randn(3, 2, 40, 64, generator=g) for _ in range(2))
    with kernels.activations_set("int8"):
        rows = kernels.amx_rows(torch.tensor([200, 5, kernels.AMX_PROMPT]))
        assert rows.tolist() == [True, False, True]
        with kernels.rows_on_amx(rows):
            got, att = kernels.packed_linear(x, w), attention(q, k, v, None)
        assert kernels.amx_rows(torch.tensor([5, kernels.AMX_PROMPT - 1])) is None
    for r in range(3):
        alone = x[r:r + 1]
        want = (kernels._bfloat16_linear(alone, w, None) if rows[r]
                else kernels.integer_linear(alone, w, None, 8))
        assert torch.equal(got[r:r + 1], want), r
        qkv = [t[r:r + 1] for t in (q, k, v)]
        with kernels.activations_set("int8"), kernels.rows_on_amx(rows[r:r + 1]):
            assert torch.equal(att[r:r + 1], attention(*qkv, None)), r


@pytest.mark.skipif(not amx_usable(), reason="needs AMX")
def test_an_mlp_keeps_rows_on_amx_apart_from_the_others():
    """A prompt step's MLP over many rows goes in passes of MLP_ROWS rows across its
    sequences, but rows on AMX tiles go apart from the others, in one product: each row as it
    does alone."""
    from tiergen.models.layers import MLP_ROWS, swiglu_mlp

    gate_up = random_packed(GGMLType.Q4_1, 256, 256, 7)
    down = random_packed(GGMLType.Q4_1, 256, 128, 8)
    x = torch.randn(4, MLP_ROWS // 2 + 8, 256, generator=torch.Generator().manual_seed(9))
    with kernels.activations_set("int8"):
        rows = kernels.amx_rows(torch.tensor([300, 20, 300, 300]))
        with kernels.rows_on_amx(rows):
            got = swiglu_mlp(x, gate_up, down)
        for r in range(4):
            with kernels.rows_on_amx(rows[r:r + 1] if rows[r] else None):
                assert torch.equal(got[r:r + 1], swiglu_mlp(x[r:r + 1], gate_up, down)), r
        with kernels.rows_on_amx(rows[[0, 2, 3]]):  # all on AMX: passes over the three
            assert torch.equal(swiglu_mlp(x[[0, 2, 3]], gate_up, down), got[[0, 2, 3]])


@pytest.mark.skipif(not kernels.amx_engine(), reason="needs AMX and a build with it")
@pytest.mark.parametrize("gate_type,up_type,k", [(GGMLType.Q4_1, GGMLType.Q4_1, 576),
                                                 (GGMLType.Q5_0, GGMLType.Q8_0, 640),
                                                 (GGMLType.Q4_K, GGMLType.Q6_K, 512),
                                                 (GGMLType.FP8, GGMLType.FP8, 512)])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_a_prompts_gate_and_up_on_the_tiles_leave_as_glu_of_their_products(gate_type, up_type,
                                                                           k, gelu, monkeypatch):
    """kernels.amx_glu: the gate's and up's products on AMX tiles and act(gate) * up in one
    pass, bit for bit glu's bfloat16 of rounded_linear's product, for rows that do not fill
    the tiles' 32 and halves of different types; the MLP of a prompt's rows on the tiles takes
    it. A row longer than one decoded panel is left to the two calls."""
    from tiergen.models.layers import gelu_tanh_mlp, swiglu_mlp

    gate_up = cat_rows([random_packed(gate_type, 96, k, 1), random_packed(up_type, 96, k, 2)])
    down = random_packed(GGMLType.Q4_1, 64, 96, 3)
    x = torch.randn(2, 45, k, generator=torch.Generator().manual_seed(5))
    want = kernels.glu(kernels.rounded_linear(x, gate_up), gelu, bfloat16=True)
    got = kernels.amx_glu(x, gate_up, gelu)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 45, 96)
    assert torch.equal(got, want)
    mlp, one_pass, taken = gelu_tanh_mlp if gelu else swiglu_mlp, kernels.amx_glu, []
    monkeypatch.setattr(kernels, "amx_glu", lambda *a: taken.append(one_pass(*a)) or taken[-1])
    with kernels.activations_set("int8"), kernels.rows_on_amx(torch.ones(2, dtype=torch.bool)):
        assert torch.equal(mlp(x, gate_up, down), kernels.rounded_linear(want, down))
    assert len(taken) == 1 and taken[0] is not None
    wide = cat_rows([random_packed(GGMLType.Q4_0, 32, 4096, 4)] * 2)
    assert kernels.amx_glu(torch.randn(32, 4096), wide, gelu) is None


def test_a_long_prompts_attention_on_the_integer_path_runs_in_bfloat16_where_amx_works():
    from tiergen.cache.attention import attention

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 64, 64, generator=g)
    k, v = (torch.randn(1, 2, 64, 64, generator=g) for _ in range(2))
    with kernels.activations_set("int8"):
        with kernels.rows_on_amx(kernels.amx_rows(torch.tensor([kernels.AMX_PROMPT]))):
            got = attention(q, k, v, None)
    exact = attention(q, k, v, None)  # the float path: float32 throughout
    if amx_usable():  # rounded to bfloat16 and summed in float32 on the tiles
        want = (kernels.amx_attention(q, k, v) if kernels.amx_engine()
                else attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), None).float())
        assert torch.equal(got, want) and not torch.equal(got, exact)
    else:
        assert torch.equal(got, exact)


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
# rows a group: one (a decode step's query per head), the row-by-row kernel's two, the tiles
@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("kind", ["int8", "int16"])
def test_a_grouped_product_is_each_groups_own_product(ggml_type, rows, kind):
    """kernels.grouped_linear: group g's activation rows times the g-th block of weight
    rows, as integer_linear computes each alone, in one call; the float path decodes."""
    qk = ggml_type_sizes(ggml_type)[0]
    groups, n, k = 5, 24, qk * (4 if qk == 32 else 2)
    w = random_packed(ggml_type, groups * n, k, seed=ggml_type)
    x = torch.randn(groups, rows, k, generator=torch.Generator().manual_seed(rows))
    fmt = kernels.ACTIVATION_FORMATS[kind]
    with kernels.activations_set(kind):
        got = kernels.grouped_linear(x, w)
    assert got.shape == (groups, rows, n)
    for g in range(groups):
        block = Packed(w.data.view(groups, -1)[g], (n, k), ((ggml_type, n),))
        assert torch.equal(got[g], kernels.integer_linear(x[g], block, None, *fmt))
    # the float path: few rows by the float kernels, more by the decoded matrix
    dense = w.dequantize().view(groups, n, k)
    assert_close_relative(kernels.grouped_linear(x, w), x @ dense.mT, 1e-4)
    many = torch.randn(groups, kernels.ROW_THRESHOLD + 1, k)
    assert_close_relative(kernels.grouped_linear(many, w), many @ dense.mT, 1e-4)


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
@pytest.mark.parametrize("rows", [1, 2, 3, 9])
def test_every_instruction_set_build_does_the_same_arithmetic(isa_library, ggml_type, rows,
                                                              monkeypatch):
    qk = ggml_type_sizes(ggml_type)[0]
    cols = 1280 if qk == 256 else 32 * 11
    w = random_packed(ggml_type, 19, cols, seed=ggml_type)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    monkeypatch.setattr(kernels, "_lib", isa_library)
    for group, wide in FORMATS:
        got = kernels.quantize_activations(x, group, wide)
        q, scale, sums = quantize_reference(x, group, wide)
        values = got.q.int() if got.low is None else 255 * got.q.int() + got.low.int()
        assert torch.equal(values, q) and torch.equal(got.sums, sums)
        y = kernels.integer_linear(x, w, None, group, wide)
        assert_close_relative(y, integer_reference(x, w, group, wide))
        kept = Packed(w.data, w.shape, w.parts, may_keep_tiles=True)
        assert kernels.keep_tiles(kept)
        assert torch.equal(kernels.integer_linear(x, kept, None, group, wide), y)


def test_a_prompt_whose_panels_outgrow_the_kept_buffer_multiplies_the_same():
    """More than 64 MiB of activation panels (here 4,100 rows of 8,192 values): the buffer is
    freed after the product and made again for the next, which gives the same numbers."""
    w = random_packed(GGMLType.Q8_0, 24, 8192, 1)
    x = torch.randn(4100, 8192, generator=torch.Generator().manual_seed(3))
    first = kernels.integer_linear(x, w, None, 4)
    again = kernels.integer_linear(x, w, None, 4)
    assert torch.equal(first, again)
    assert torch.equal(first[4090:], kernels.integer_linear(x[4090:], w, None, 4))


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
def test_kept_tiles_multiply_as_the_tiles_built_at_each_product(ggml_type):
    """Kept tiles (kernels.keep_tiles) hold what each product would build: the same numbers
    to the bit, for a matrix of two types whose rows do not fill the last tile and run past a
    1024-value chunk, from three rows (fewer take the row kernel) to past a pass of 256."""
    qk = ggml_type_sizes(ggml_type)[0]
    cols = 1280 if qk == 256 else 32 * 37
    w = cat_rows([random_packed(ggml_type, 21, cols, seed=ggml_type),
                  random_packed(GGMLType.Q8_0, 14, cols, seed=1)])
    assert not kernels.keep_tiles(w) and w.tiles is None  # only where its owner allows it
    kept = Packed(w.data, w.shape, w.parts, may_keep_tiles=True)
    assert kernels.keep_tiles(kept) and kept.tiles.numel() == kernels.tile_bytes(kept)
    assert kernels.tile_bytes(kept) >= 3 * w.shape[0] * cols // 2
    for rows in (1, 3, 5, 32, 300):
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        for group, wide in FORMATS:
            assert torch.equal(kernels.integer_linear(x, kept, None, group, wide),
                               kernels.integer_linear(x, w, None, group, wide))
    # a copy elsewhere, or over other bytes, does not carry them
    assert kept.to("cpu").tiles is None and kept.with_data(w.data.clone()).tiles is None


@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_a_tokens_experts_in_one_call_add_each_experts_output_in_order(count, kind):
    """tg_experts_row gives each expert's output as alone, added in order, whether the threads
    share each product or (an even split of the experts) take whole experts each."""
    from tiergen.kernels.layer import experts_row

    hidden, inter = 256, 96
    experts = [(random_packed(GGMLType.Q4_0, 2 * inter, hidden, seed=2 * e),
                random_packed(GGMLType.Q4_0, hidden, inter, seed=2 * e + 1)) for e in range(count)]
    mix = [0.5, 0.25, 0.125, 0.0625][:count]
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(count))
    with kernels.activations_set(kind):
        got = experts_row(x, experts, mix)
        alone = [experts_row(x, [pair], [1.0]) for pair in experts]
    want = torch.zeros(1, hidden)
    for m, y in zip(mix, alone):
        want = want + m * y
    assert torch.equal(got, want)



# A row inside products of these many rows: the row kernels (1, 2; up to 4 for the types that
# AVX-512 takes into registers) and the tiles (3 or more; with AVX-512 VNNI and 8-bit rows
# scaled per 8 values, up to 4 rows decode their blocks into registers, in the tiles' order),
# with the panels' four rows full or not and more than a pass of them.
BATCHES = [1, 2, 3, 4, 7, 16, 33, 64]


def row_cols(ggml_type: int) -> int:
    return 1280 if ggml_type_sizes(ggml_type)[0] == 256 else 32 * 37  # past a 1024-value chunk


def a_row_in_batches(ggml_type: int, group: int, wide: bool, kept: bool, threads: int,
                     batch_invariant: bool = False) -> dict[int, torch.Tensor]:
    """Row 0 of x's product placed among other rows (each batch's row there), in products of
    every size in BATCHES, on a matrix of two parts whose rows do not fill the last tile."""
    cols = row_cols(ggml_type)
    w = cat_rows([random_packed(ggml_type, 37, cols, seed=ggml_type),
                  random_packed(ggml_type, 19, cols, seed=ggml_type + 100)])
    if kept:
        w = Packed(w.data, w.shape, w.parts, may_keep_tiles=True)
        assert kernels.keep_tiles(w)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(ggml_type))
    x[:, :9] *= torch.linspace(0.01, 40, 64)[:, None]  # rows of scales far apart
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {}
        with kernels.activations_set("int16" if wide else "int8", batch_invariant):
            for m in BATCHES:
                at = m // 2  # among the others, not first
                rows = torch.cat([x[1:at + 1], x[:1], x[at + 1:m]])
                got[m] = kernels.integer_linear(rows, w, None, group, wide)[at]
        return got
    finally:
        torch.set_num_threads(before)


def takes_tiles(ggml_type: int, rows: int, group: int, wide: bool) -> bool:
    return bool(kernels.library().tg_takes_tiles(ggml_type, row_cols(ggml_type), rows, group,
                                                 int(wide)))


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
@pytest.mark.parametrize("group,wide", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("kept", [False, True], ids=["built", "kept"])
def test_a_rows_numbers_do_not_depend_on_the_rows_beside_it_within_a_kernel(
        ggml_type, group, wide, kept):
    """Products that take the same kernels (the row kernels, or the tiles, built or kept) give
    a row the same bits whatever the rows beside it, on one thread or two."""
    assert_a_row_independent_within_a_kernel(ggml_type, group, wide, kept)


def assert_a_row_independent_within_a_kernel(ggml_type: int, group: int, wide: bool,
                                             kept: bool) -> None:
    one = a_row_in_batches(ggml_type, group, wide, kept, 1)
    two = a_row_in_batches(ggml_type, group, wide, kept, 2)
    for m in BATCHES:
        assert torch.equal(two[m], one[m]), f"{m} rows, two threads"
    for tiles in (False, True):
        same = [(m, one[m]) for m in BATCHES if takes_tiles(ggml_type, m, group, wide) == tiles]
        for m, y in same[1:]:
            assert torch.equal(y, same[0][1]), f"{m} rows against {same[0][0]}"


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
def test_every_instruction_set_build_gives_a_row_the_same_bits_beside_any_rows(
        isa_library, ggml_type, monkeypatch):
    """As above, for each instruction set's kernels (built tiles; kept ones read the same)."""
    monkeypatch.setattr(kernels, "_lib", isa_library)
    for group, wide in FORMATS:
        assert_a_row_independent_within_a_kernel(ggml_type, group, wide, False)


@pytest.mark.xfail(strict=True, reason=(
    "the row kernels (few rows) sum each 32-bit lane's products in float across the row and "
    "add the lanes at the end; the tiles (more rows) sum each output's products in order, per "
    "16 values, with the 8-bit sums read as MAGIC + D: the same arithmetic in another order, "
    "so a row's last bits depend on whether its batch takes the tiles"))
@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
@pytest.mark.parametrize("group,wide", FORMATS, ids=FORMAT_IDS)
def test_a_rows_numbers_do_not_depend_on_the_kernel_its_batch_takes(ggml_type, group, wide):
    got = a_row_in_batches(ggml_type, group, wide, False, 1)
    for m in BATCHES:
        assert torch.equal(got[m], got[1]), f"{m} rows"


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
@pytest.mark.parametrize("group,wide", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("kept", [False, True], ids=["built", "kept"])
def test_batch_invariant_products_give_a_row_the_same_bits_in_any_batch(ggml_type, group, wide,
                                                                       kept):
    """With batch invariance set (kernels.set_activations), every product takes the tiles: a
    row's numbers are the same to the bit alone, in two rows and in any larger batch, on one
    thread or two, and the same as a batch's without it."""
    one = a_row_in_batches(ggml_type, group, wide, kept, 1, batch_invariant=True)
    two = a_row_in_batches(ggml_type, group, wide, kept, 2, batch_invariant=True)
    for m in BATCHES:
        assert torch.equal(one[m], one[1]), f"{m} rows"
        assert torch.equal(two[m], one[1]), f"{m} rows, two threads"
    assert torch.equal(a_row_in_batches(ggml_type, group, wide, kept, 1)[64], one[1])


@pytest.mark.parametrize("ggml_type", sorted(INTEGER_TYPES), ids=lambda t: GGMLType(t).name)
def test_every_instruction_set_build_is_batch_invariant(isa_library, ggml_type, monkeypatch):
    """Each instruction set's tiles give a row alone the bits it gets in a batch of 33."""
    monkeypatch.setattr(kernels, "_lib", isa_library)
    for group, wide in FORMATS:
        got = a_row_in_batches(ggml_type, group, wide, False, 1, batch_invariant=True)
        assert torch.equal(got[1], got[33]) and torch.equal(got[2], got[33])


def test_tiles_in_registers_read_mxfp4s_smallest_and_largest_scales_as_the_tiles_do():
    """MXFP4's E8M0 scales below 2^-126 are subnormal floats (e8m0_half): the tiles in
    registers (one row) make them as the tiles built in memory (64 rows) do."""
    cols = row_cols(GGMLType.MXFP4)
    w = random_packed(GGMLType.MXFP4, 37, cols, seed=5)
    blocks = w.data.view(-1, 17)
    blocks[:, 0] = torch.tensor([0, 1, 2, 3, 120, 200], dtype=torch.uint8)[
        torch.arange(len(blocks)) % 6]
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(5))
    with kernels.activations_set("int8", True):
        alone = kernels.integer_linear(x[:1], w, None, 8)
        batch = kernels.integer_linear(x, w, None, 8)[:1]
    assert torch.equal(alone, batch) and bool(torch.isfinite(alone).all())
