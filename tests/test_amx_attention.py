"""A prompt's causal attention on AMX tiles (amx.c's tg_amx_attention, kernels.amx_attention):
q, k, v rounded to bfloat16, float32 sums, the softmax online in blocks of keys with its
probabilities rounded to bfloat16. Checked against the plain arithmetic (exact softmax over the
rounded inputs, its probabilities rounded once) where the CPU has AMX; elsewhere the kernel
declines and attention takes torch's path, as tests/test_int8_kernels.py checks."""

from __future__ import annotations

import pytest
import torch

from tiergen import kernels
from tiergen.cache.attention import attention
from tiergen.cache.kv import RollingKVView
from tiergen.cache.step import StepMeta

pytestmark = pytest.mark.skipif(not kernels.amx_engine(),
                                reason="needs AMX (bfloat16 tiles) and a build for it")


def plain(q, k, v, window=0):
    """Query t of q (B, H, T, D) sees keys 0..S-T+t of k, v (B, KVH, S, D) (the last `window`
    of them where window > 0); inputs rounded to bfloat16, the probabilities too (against the
    exact maximum), the rest in float64."""
    B, H, T, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    q, k, v = (t.bfloat16().double() for t in (q, k, v))
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    s = q @ k.transpose(-1, -2) * D**-0.5
    key, place = torch.arange(S)[None], torch.arange(T)[:, None] + S - T
    unseen = (key > place) | ((key <= place - window) if window else False)
    s = s.masked_fill(unseen, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return ((e.bfloat16().double() @ v) / e.sum(-1, keepdim=True)).float()


SHAPES = [  # B, H, KVH, T, S, D
    (1, 9, 3, 100, 100, 64),   # a first chunk, rows past a tile
    (2, 4, 1, 37, 300, 256),   # a later chunk: keys past a block of 128, not of 32
    (3, 2, 2, 64, 64, 32),
    (1, 4, 2, 1, 70, 128),     # one query
    (2, 2, 1, 160, 700, 64),   # several key blocks and query blocks
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d)[6:])
def test_amx_attention_is_its_plain_arithmetic(shape, dtype):
    B, H, KVH, T, S, D = shape
    g = torch.Generator().manual_seed(T + S)
    # q as the layers make it: a (B, T, H, D) product seen as (B, H, T, D)
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(B, KVH, S, D, generator=g).to(dtype) for _ in "kv")
    got = kernels.amx_attention(q, k, v)
    assert got.dtype == torch.float32 and got.shape == (B, H, T, D)
    assert got.transpose(1, 2).is_contiguous()  # laid out for the output projection
    err = (got - plain(q, k, v)).abs()
    # the probabilities round against the running maximum, not the exact one
    assert err.max() < 4e-3 and err.mean() < 3e-4


@pytest.mark.parametrize("shape", [  # B, H, KVH, T, S, D, window
    (1, 4, 1, 300, 300, 256, 100),  # a first chunk longer than its window
    (2, 4, 2, 100, 612, 64, 512),   # a later chunk over a ring of 512
    (1, 2, 1, 37, 70, 64, 33),      # a window's edge inside a block of 32
    (1, 2, 1, 64, 64, 32, 1),       # each query itself only
    (1, 3, 1, 200, 250, 64, 64),
], ids=str)
def test_amx_attention_in_a_sliding_window_is_its_plain_arithmetic(shape):
    B, H, KVH, T, S, D, window = shape
    g = torch.Generator().manual_seed(T + S + window)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, KVH, S, D, generator=g) for _ in "kv")
    err = (kernels.amx_attention(q, k, v, window) - plain(q, k, v, window)).abs()
    assert err.max() < 4e-3 and err.mean() < 3e-4


def test_amx_attention_reads_no_later_key_and_keeps_each_row_its_own():
    g = torch.Generator().manual_seed(1)
    B, H, KVH, T, S, D = 3, 4, 2, 90, 200, 64
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, KVH, S, D, generator=g) for _ in "kv")
    got = kernels.amx_attention(q, k, v)
    for r in range(B):
        assert torch.equal(got[r:r + 1], kernels.amx_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1]))
    # the first 40 queries see keys up to S - T + 39: whatever comes after is not read
    k2, v2 = k.clone(), v.clone()
    k2[:, :, S - T + 40:], v2[:, :, S - T + 40:] = 1e4, -1e4
    assert torch.equal(kernels.amx_attention(q[:, :, :40], k2[:, :, :S - T + 40],
                                             v2[:, :, :S - T + 40]), got[:, :, :40])
    assert torch.equal(kernels.amx_attention(q, k2, v2)[:, :, :40], got[:, :, :40])


def test_a_prompt_step_takes_the_tiles_where_its_attention_is_plain_causal():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 48, 64, generator=g)
    k, v = (torch.randn(2, 2, 112, 64, generator=g) for _ in "kv")
    valid = torch.ones(2, 112, dtype=torch.bool)
    tiles = kernels.amx_attention(q, k, v)
    on = kernels.rows_on_amx(torch.ones(2, dtype=torch.bool))
    with kernels.activations_set("int8"), on:  # the integer path's long prompts, float32
        assert torch.equal(attention(q, k, v, None, key_valid=valid), tiles)  # a later chunk
        own = [t[:, :, -48:] for t in (k, v)]
        assert torch.equal(attention(q, *own, None), kernels.amx_attention(q, *own))
        # a ring's window: its mask, not plain causal, takes torch's path
        window = torch.ones(48, 48, dtype=torch.bool).tril() & ~torch.ones(48, 48).bool().tril(-9)
        ring = attention(q, *own, window.expand(2, 1, 48, 48), key_valid=valid[:, :48])
        half = [t.bfloat16() for t in (q, *own)]
        assert torch.equal(ring, attention(*half, window.expand(2, 1, 48, 48)).float())
    # bfloat16 queries (a bfloat16 checkpoint) take the tiles; float32 off the tiles does not
    half = [t.bfloat16() for t in (q, k, v)]
    assert torch.equal(attention(*half, None, key_valid=valid), tiles.bfloat16())
    assert not torch.equal(attention(q, k, v, None, key_valid=valid), tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_a_rings_prompt_steps_take_the_tiles_in_its_window(dtype):
    """A sliding-window layer's prompt in chunks: each chunk over the ring's keys, oldest
    first, and its own, on the tiles (float32: the integer path's rows on the tiles)."""
    B, H, KVH, D, window, chunks = 2, 4, 2, 64, 48, [40, 64, 30]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, sum(chunks), D, generator=g).to(dtype)
    k, v = (torch.randn(B, KVH, sum(chunks), D, generator=g).to(dtype) for _ in "kv")
    ring = RollingKVView(torch.zeros(2, B, KVH, window, D, dtype=dtype), window)
    valid = torch.ones(B, sum(chunks), dtype=torch.bool)
    on = kernels.rows_on_amx(torch.ones(B, dtype=torch.bool))
    start, outs = 0, []
    with kernels.activations_set("int8"), on:
        for n in chunks:
            now = slice(start, start + n)
            outs.append(ring.attend(q[:, :, now], k[:, :, now], v[:, :, now],
                                    StepMeta.build(valid, start, n)))
            seen = slice(max(0, start - window), start + n)
            assert torch.equal(outs[-1], kernels.amx_attention(
                q[:, :, now], k[:, :, seen], v[:, :, seen], window).to(dtype))
            start += n
    err = (torch.cat(outs, 2).float() - plain(q, k, v, window)).abs()
    assert err.max() < (4e-3 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("start", [0, 10, 40, 100], ids=lambda s: f"start{s}")
def test_a_window_without_a_mask_takes_the_tiles(start):
    """attention's window with mask None (every key valid), bfloat16: the tiles' band
    (tests/test_chunked_prefill.py checks torch's paths against the band's mask)."""
    B, H, KVH, T, D, window = 2, 4, 2, 60, 64, 48
    S = min(start, window) + T
    g = torch.Generator().manual_seed(start)
    q, k, v = (torch.randn(B, n, length, D, generator=g).bfloat16()
               for n, length in ((H, T), (KVH, S), (KVH, S)))
    got = attention(q, k, v, None, key_valid=torch.ones(B, S, dtype=torch.bool), window=window)
    assert torch.equal(got, kernels.amx_attention(q, k, v, window).bfloat16())
