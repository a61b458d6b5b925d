"""The C decode-step operations (RMSNorm, rotary embedding, one token's attention) against
the torch code they replace on a CPU in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiergen import kernels
from tiergen.cache.attention import attention
from tiergen.models import layers


@pytest.fixture(autouse=True)
def native():
    assert kernels.library() is not None, "the C kernels did not build on this machine"


@pytest.fixture
def torch_path(monkeypatch):
    """Run a layers function on its torch path (the library disabled) for the reference."""
    def call(fn, *args, **kw):
        with monkeypatch.context() as m:
            m.setattr(kernels, "_lib", False)
            return fn(*args, **kw)
    return call


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert ((got - want).abs().max() / want.abs().max()).item() < tol


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 7, 64), (2, 5, 13)])
def test_rms_norm(shape, torch_path):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g), torch.randn(shape[-1], generator=g)
    close(layers.rms_norm(x, w, 1e-6), torch_path(layers.rms_norm, x, w, 1e-6))
    close(layers.gemma_rms_norm(x, w, 1e-6), torch_path(layers.gemma_rms_norm, x, w, 1e-6))
    assert kernels.rms_norm(x, w, 1e-6) is not None  # the kernel did run
    assert kernels.rms_norm(x.bfloat16(), w, 1e-6) is None  # not float32: torch's path
    # a bfloat16 model's: the float32 residual normed by the kernel, then rounded (at most
    # one bfloat16 step from torch's path, whose float32 sums run in another order)
    half = w.bfloat16()
    for norm in (layers.rms_norm, layers.gemma_rms_norm):
        got = norm(x, half, 1e-6)
        assert got.dtype == torch.bfloat16
        close(got, torch_path(norm, x, half, 1e-6), tol=2**-7)


@pytest.mark.parametrize("B,H,T,D", [(1, 9, 1, 64), (2, 3, 5, 64), (3, 2, 4, 6)])
def test_rope(B, H, T, D, torch_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # strided, as a layer has it
    cos, sin = torch.randn(2, B, 1, T, D, generator=g)
    assert kernels.rope(x, cos, sin) is not None
    close(layers.apply_rope(x, cos, sin), torch_path(layers.apply_rope, x, cos, sin))


@pytest.mark.parametrize("B,H,T,D,R", [(1, 9, 1, 64, 32), (2, 3, 5, 128, 64), (3, 2, 4, 6, 2)])
@pytest.mark.parametrize("pairs", [False, True])
def test_partial_rope_turns_a_heads_first_numbers_and_passes_the_rest(B, H, T, D, R, pairs,
                                                                      torch_path):
    """Partial rotary (GLM-4.5, MiniMax-M2): tables R wide rotate x[..., :R] as a whole
    head of R would be, x[..., R:] unchanged, on the C path and on torch's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    cos, sin = layers.rope_cos_sin(inv_freq, torch.randint(0, 500, (B, T), generator=g),
                                   torch.float32)
    want = torch.cat((torch_path(layers.apply_rope, x[..., :R].contiguous(), cos, sin, pairs),
                      x[..., R:]), dim=-1)
    assert kernels.rope(x, cos, sin, pairs) is not None
    close(layers.apply_rope(x, cos, sin, pairs), want)
    assert torch.equal(layers.apply_rope(x, cos, sin, pairs)[..., R:], x[..., R:])
    assert torch.equal(torch_path(layers.apply_rope, x, cos, sin, pairs), want)


@pytest.mark.parametrize("B,H,T,D", [(1, 9, 1, 64), (2, 3, 5, 64), (3, 2, 4, 6)])
def test_rope_in_pairs_is_the_half_split_rope_in_llama_cpp_order(B, H, T, D, torch_path):
    """Q/K rows as llama.cpp stores Llama's (each head's rotary pairs side by side), rotated
    in pairs, give the half-split rotation of the same rows in Hugging Face's order, to the
    bit, on the C path and on torch's."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    cos, sin = layers.rope_cos_sin(inv_freq, torch.randint(0, 500, (B, T), generator=g),
                                   torch.float32)

    def in_pairs(t: torch.Tensor) -> torch.Tensor:
        return torch.stack((t[..., :D // 2], t[..., D // 2:]), dim=-1).flatten(-2)

    stored = in_pairs(x)
    assert kernels.rope(stored, cos, sin, pairs=True) is not None
    assert torch.equal(layers.apply_rope(stored, cos, sin, pairs=True),
                       in_pairs(layers.apply_rope(x, cos, sin)))
    assert torch.equal(torch_path(layers.apply_rope, stored, cos, sin, pairs=True),
                       in_pairs(torch_path(layers.apply_rope, x, cos, sin)))


@pytest.mark.parametrize("H,KVH,D,Dv", [(9, 3, 64, 64), (4, 1, 72, 40), (2, 2, 16, 16),
                                        (8, 2, 128, 128), (4, 1, 256, 256)],
                         ids=["gqa", "mqa-latent-like", "mha", "gqa-128", "mqa-256"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["kv32", "kv16", "bf16"])
def test_decode_attention(H, KVH, D, Dv, masked, kv_dtype, torch_path):
    """A float16 cache (the integer path's) is read as the float32 cache of its values; a
    bfloat16 model's queries and cache likewise, its output rounded to bfloat16 once."""
    g = torch.Generator().manual_seed(2)
    B, S, capacity = 3, 37, 50
    q = torch.randn(B, 1, H, D, generator=g).transpose(1, 2)
    if kv_dtype == torch.bfloat16:
        q = q.bfloat16()
    cache = torch.randn(2, B, KVH, capacity, max(D, Dv), generator=g).to(kv_dtype)  # views
    k, v = cache[0, :, :, :S, :D], cache[1, :, :, :S, :Dv]
    mask = None
    if masked:  # every row keeps its own slot, as the engine's masks do
        mask = torch.rand(B, 1, 1, S, generator=g) > 0.4
        mask[..., S - 1] = True
        mask[1, ..., : S - 1] = False  # a row that sees only itself
    assert kernels.decode_attention(q, k, v, mask) is not None
    want = torch_path(attention, q.float(), k.float(), v.float(), mask)
    if q.dtype == torch.bfloat16:  # float32 sums, then one rounding
        assert torch.equal(attention(q, k, v, mask), kernels.decode_attention(
            q.float(), k.float(), v.float(), mask).bfloat16())
        close(torch_path(attention, q, k, v, mask).float(), want, 2e-2)  # bfloat16 sums
        return
    close(attention(q, k, v, mask), want)
    close(torch_path(attention, q, k, v, mask), want)  # torch converts the cache


@pytest.mark.parametrize("H", [4, 3])
def test_a_rows_heads_split_over_threads_give_the_numbers_of_a_batch(H, torch_path):
    """One row of a model with one K/V head has fewer groups than threads: its heads are
    split over them, and each head's numbers are those it gets in a batch (no split)."""
    g = torch.Generator().manual_seed(5)
    B, S, D = 3, 200, 256
    q = torch.randn(B, 1, H, D, generator=g).transpose(1, 2)
    k, v = torch.randn(2, B, 1, S, D, generator=g)
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.3
    batch = kernels.decode_attention(q, k, v, mask)
    for b in range(B):
        alone = kernels.decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1])
        assert torch.equal(alone, batch[b:b + 1])
    close(batch, torch_path(attention, q, k, v, mask))


def test_decode_attention_ignores_unwritten_slots_and_wide_score_ranges(torch_path):
    """Slots the mask hides may hold anything (a cache's unwritten rows); scores may span
    more than float32's exponentials (the kernel's vector exp clamps below -87)."""
    g = torch.Generator().manual_seed(3)
    B, H, KVH, S, D = 2, 4, 2, 70, 64
    q = torch.randn(B, H, 1, D, generator=g) * 4
    k, v = torch.randn(2, B, KVH, S, D, generator=g)
    k[:, :, ::3] *= 30  # scores from about -1000 to 1000
    mask = torch.rand(B, 1, 1, S, generator=g) > 0.3
    mask[0, ..., 20:60] = False  # whole vectors of slots hidden (a cache's unused end)
    mask[..., -1] = True
    want = torch_path(attention, q, k, v, mask)
    k[~mask.view(B, 1, S, 1).expand_as(k)] = float("nan")
    v[~mask.view(B, 1, S, 1).expand_as(v)] = float("inf")
    got = kernels.decode_attention(q, k, v, mask)
    assert got is not None and torch.isfinite(got).all()
    close(got, want)


@pytest.mark.parametrize("D", [64, 24], ids=["vectors", "odd-width"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["kv32", "kv16", "bf16"])
def test_a_rows_decode_attention_does_not_depend_on_where_its_tokens_sit(D, kv_dtype):
    """The same query over the same 29 tokens gives the same output to the bit, whether they
    fill a cache of their own from slot 0 (a row alone) or follow padding of any length in a
    longer cache whose later slots are hidden (the row in a batch of other lengths)."""
    g = torch.Generator().manual_seed(4)
    H, KVH, L = 6, 2, 29
    q = torch.randn(1, H, 1, D, generator=g)
    q = q.bfloat16() if kv_dtype == torch.bfloat16 else q
    k, v = torch.randn(2, 1, KVH, L, D, generator=g).to(kv_dtype)
    alone = kernels.decode_attention(q, k, v, None)
    assert alone is not None
    for pad, capacity in [(0, 29), (0, 50), (3, 40), (16, 45), (17, 70), (5, 34)]:
        kc, vc = torch.randn(2, 1, KVH, capacity, D, generator=g).to(kv_dtype)
        kc[:, :, pad:pad + L], vc[:, :, pad:pad + L] = k, v
        mask = torch.zeros(1, 1, 1, capacity, dtype=torch.bool)
        mask[..., pad:pad + L] = True
        assert torch.equal(kernels.decode_attention(q, kc, vc, mask), alone), (pad, capacity)


def test_decode_attention_leaves_other_cases_to_torch():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 6, 8)
    assert kernels.decode_attention(q, k, k, None) is None  # more than one query token
    assert kernels.decode_attention(q[:, :, :1].double(), k.double(), k.double(), None) is None
    assert kernels.decode_attention(q[:, :3, :1], k, k, None) is None  # heads not a multiple
    want = F.scaled_dot_product_attention(q[:, :, :1], k.repeat_interleave(2, 1),
                                          k.repeat_interleave(2, 1))
    close(kernels.decode_attention(q[:, :, :1], k, k, None), want)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_delta_step_is_the_recurrent_rule_in_place(per_channel, torch_path):
    """One token of the gated delta rule on states that are a view of wider rows (the state
    cache's: the convolution's numbers first), against the torch step."""
    from tiergen.models.qwen3_next import delta_rule

    gen = torch.Generator().manual_seed(0)
    B, H, dk, dv, pad = 3, 4, 16, 24, 40
    q, k = (F.normalize(torch.randn(B, 1, H, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, 1, H, dv, generator=gen)
    g = -torch.rand(B, 1, H, *((dk,) if per_channel else ()), generator=gen) * 2
    beta = torch.rand(B, 1, H, generator=gen)
    rows = torch.randn(B, pad + H * dk * dv, generator=gen)
    S = rows[:, pad:].view(B, H, dk, dv)
    want_out, want_S = torch_path(delta_rule, q, k, v, g, beta, S.clone())
    out, got_S = delta_rule(q, k, v, g, beta, S)
    assert got_S.data_ptr() == S.data_ptr()  # in place, in the rows
    close(out, want_out)
    close(S, want_S)


def test_argmax_equals_torch_with_ties_nans_and_ragged_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1003, generator=g)  # not a multiple of the vector width
    x[1, 5] = x[1, 900] = x[1].max() + 1  # a tie: the first index wins
    x[2, -1] = 50.0  # in the scalar tail
    x[3, 17] = float("nan")  # a NaN is the largest, as torch has it
    x[4] = -float("inf")
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    assert kernels.argmax(x)[1] == 5


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu-tanh"])
def test_glu_equals_torch(gelu):
    gu = torch.randn(5, 3, 2 * 333, generator=torch.Generator().manual_seed(1)) * 4
    gu[0, 0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # where exp saturates, and zero
    gate, up = gu.chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    close(kernels.glu(gu, gelu), want, 1e-6)
    # rounded to bfloat16 as it is written: the float32 values rounded as torch rounds them
    # (333 values a row: a whole piece of 256 and a tail)
    assert torch.equal(kernels.glu(gu, gelu, bfloat16=True), kernels.glu(gu, gelu).bfloat16())


HALF_CASES = torch.tensor([0.0, -0.0, 1.0, -2.5, 65504.0, 65520.0, 1e6, -1e6, 6.1e-5, 5.96e-8,
                           2.98e-8, 2.99e-8, 1e-9, 3e-5, 1.00048828125, 1.00146484375,
                           float("inf"), float("-inf"), float("nan")])


@pytest.mark.parametrize("build", ["native", "portable"])
def test_float16_writes_round_as_torch(build, tmp_path):
    """The decode layer's float16 cache rows (tg_to_half) hold what torch's .half() gives:
    ties to even, subnormals, overflow to inf, NaN; with F16C and the portable C alike."""
    import ctypes
    import platform

    lib = kernels.library()
    if build == "portable":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("an x86 build without F16C")
        flags = [f for f in kernels.FLAGS if not f.startswith(("-march", "-mcpu"))]
        kernels._compile(tmp_path / "portable.so", flags + ["-march=x86-64"])
        lib = kernels.bind(ctypes.CDLL(str(tmp_path / "portable.so")))
    x = torch.cat([HALF_CASES, torch.randn(1000) * 10.0 ** torch.randint(-9, 6, (1000,))])
    out = torch.empty(len(x), dtype=torch.float16)
    lib.tg_to_half(x.data_ptr(), len(x), out.data_ptr())
    want = x.half()
    same = (out.view(torch.int16) == want.view(torch.int16)) | (out.isnan() & want.isnan())
    assert same.all(), x[~same]


def test_every_instruction_set_build_does_the_decode_operations_as_torch(isa_library, torch_path,
                                                                        monkeypatch):
    """The tests above, on each instruction set's build (its vectors' widths and tails)."""
    monkeypatch.setattr(kernels, "_lib", isa_library)
    test_rms_norm((3, 7, 64), torch_path)
    test_rms_norm((2, 5, 13), torch_path)
    test_rope(2, 3, 5, 64, torch_path)
    test_rope(3, 2, 4, 6, torch_path)
    test_rope_in_pairs_is_the_half_split_rope_in_llama_cpp_order(2, 3, 5, 64, torch_path)
    for pairs in (False, True):
        test_partial_rope_turns_a_heads_first_numbers_and_passes_the_rest(2, 3, 5, 128, 64,
                                                                          pairs, torch_path)
    for kv_dtype in (torch.float32, torch.float16, torch.bfloat16):
        test_decode_attention(9, 3, 64, 64, True, kv_dtype, torch_path)
        test_decode_attention(4, 1, 72, 40, False, kv_dtype, torch_path)
        test_decode_attention(4, 1, 256, 256, True, kv_dtype, torch_path)
        for D in (64, 24):
            test_a_rows_decode_attention_does_not_depend_on_where_its_tokens_sit(D, kv_dtype)
    test_decode_attention_ignores_unwritten_slots_and_wide_score_ranges(torch_path)
    for per_channel in (False, True):
        test_delta_step_is_the_recurrent_rule_in_place(per_channel, torch_path)
    test_argmax_equals_torch_with_ties_nans_and_ragged_rows()
    for gelu in (False, True):
        test_glu_equals_torch(gelu)
