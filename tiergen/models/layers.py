"""Shared building blocks. Every function takes its weights as arguments: layers never own
or move tensors, the executor hands them what they need."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tiergen import kernels
from tiergen._platform import cpu_has_fast_bfloat16
from tiergen.cache.kv import KVView
from tiergen.cache.step import StepMeta
from tiergen.kernels.layer import LayerKind, Step, decode_step, run_steps
from tiergen.config import RopeConfig
from tiergen.weights.packed import Packed, cat_rows  # noqa: F401  (cat_rows: for the families)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, returned in the weights' dtype (ready for their matmul).

    In half precision the residual stream stays float32 and only the matmuls run in the
    weights' dtype: a small model's near-tied logits otherwise flip with the batch shape.
    """
    out = kernels.rms_norm(x, weight.float(), eps)  # float32 x on a CPU: one call
    if out is not None:
        return out.to(weight.dtype)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(weight.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, x * (1 + w): float32 throughout, returned in the weights' dtype."""
    out = kernels.rms_norm(x, weight.float(), eps, shift=1.0)
    if out is not None:
        return out.to(weight.dtype)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (normed * (1.0 + weight.float())).to(weight.dtype)


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (weight.float() * x.float()).sum(-1).to(weight.dtype)


_compiled_gemv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def use_compiled_gemv(enabled: bool) -> None:
    """Switch single-row CPU matmuls (batch-1 decode) to a compiled multiply-reduce.

    torch.compile turns it into one streaming loop that reads the weights about twice as fast
    as the library GEMV on a CPU; it costs a few seconds of compilation per weight shape on
    first use (cached on disk by torch afterwards). Off by default; the eager path is the same
    arithmetic.
    """
    global _compiled_gemv
    if enabled and _compiled_gemv is None:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled_gemv = torch.compile(_gemv, dynamic=False)
    elif not enabled:
        _compiled_gemv = None


# A CPU without native bfloat16 multiplies bfloat16 matrices at about a GEMV per row. From
# UPCAST_ROWS rows on, widening the weights to float32 a slice at a time into one reused
# buffer (UPCAST_SCRATCH floats, 16 MiB) and multiplying in float32 is faster: on an AVX2 EPYC
# 2.5-2.9x at 32 rows, 6.4-7.1x at 512, even at 8 (docs/BENCHMARKS-HISTORY.md; a fresh float32
# copy of the whole matrix would cost more in page faults than the multiply). The result can
# differ from the bfloat16 kernel's in the last bit of an element.
UPCAST_ROWS = 8
UPCAST_SCRATCH = 1 << 22
# The rows of x widened at a time hold their float32 copy and output within this many bytes
# (at least UPCAST_ROWS rows): a long prompt's product would otherwise hold both whole.
UPCAST_ROWS_BYTES = 16 << 20
# Batch invariant (kernels.set_activations), a float matrix of up to this many numbers (a MoE
# router, a gate) multiplies each row alone, as a product of one row does: the BLAS sums a
# vector product in another order than a product of several rows. Larger ones (a float
# checkpoint's layers) multiply as usual: row by row they would read the whole matrix again
# for every row.
INVARIANT_FLOAT = 1 << 20
_scratch = threading.local()


def _widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = torch.empty(UPCAST_SCRATCH)
    xr = x.reshape(-1, x.shape[-1])
    y = torch.empty(xr.shape[0], weight.shape[0], dtype=x.dtype)
    step, piece = max(1, UPCAST_SCRATCH // weight.shape[1]), widened_rows(*weight.shape)
    for i in range(0, len(xr), piece):
        xf = xr[i:i + piece].float()
        out = torch.empty(xf.shape[0], weight.shape[0])
        for r in range(0, weight.shape[0], step):
            rows = weight[r:r + step]
            if rows.numel() > buf.numel():  # one row wider than the buffer
                buf = _scratch.buf = torch.empty(rows.numel())
            out[:, r:r + len(rows)] = F.linear(xf, buf[:rows.numel()].view(rows.shape).copy_(rows))
        if bias is not None:
            out += bias.float()
        y[i:i + len(xf)] = out
    return y.view(*x.shape[:-1], -1)


def widened_rows(n: int, k: int) -> int:
    """How many rows of x an (n, k) matrix's widened product takes at a time."""
    return max(UPCAST_ROWS, UPCAST_ROWS_BYTES // (4 * (n + k)))


def linear(x: torch.Tensor, weight: torch.Tensor | Packed, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; into ``out`` (contiguous, x's rows by weight's) if given."""
    if isinstance(weight, Packed):  # the integer kernels write float32 straight into out
        y = kernels.packed_linear(x, weight, bias, out=out if out is not None
                                  and out.dtype == torch.float32 else None)
    elif (weight.dtype == torch.bfloat16 and (x.shape[:-1].numel() <= kernels.AMX_DENSE_ROWS
                                             or kernels.batch_invariant())
            and (amx := kernels.dense_bfloat16_linear(x, weight, bias)) is not None):
        y = amx  # on AMX tiles, each row alone as in any batch
    elif (x.device.type == "cpu" and kernels.batch_invariant()
            and weight.numel() <= INVARIANT_FLOAT):
        # the BLAS takes one row (a vector product) in another order than several
        rows = x.reshape(-1, x.shape[-1])
        y = torch.cat([F.linear(r, weight, bias) for r in rows.split(1)]).view(*x.shape[:-1], -1)
    elif _compiled_gemv is not None and x.device.type == "cpu" and x.shape[:-1].numel() == 1:
        y = _compiled_gemv(x.reshape(-1), weight).view(*x.shape[:-1], -1)
        y = y if bias is None else y + bias
    elif (weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.shape[:-1].numel() >= UPCAST_ROWS and not cpu_has_fast_bfloat16()):
        y = _widened_linear(x, weight, bias)
    else:
        y = F.linear(x, weight, bias)
    return _into(y, out)


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """y, or y copied into ``out`` where it was asked for and y is not already there."""
    return y if out is None or y.data_ptr() == out.data_ptr() else out.copy_(y.reshape(out.shape))


def fused_step(kind: LayerKind, names: dict[str, str], w: dict, h: torch.Tensor,
               meta: StepMeta, cache: KVView, cos_sin: tuple[torch.Tensor, torch.Tensor],
               known: Step | None = None) -> Step | None:
    """A decode step's layer as the native layer runs it (:func:`run_steps`), or None where
    that cannot run it. ``names`` maps the names of :mod:`tiergen.kernels.layer` to the
    family's own in ``w``; ``known``: as :func:`tiergen.kernels.layer.decode_step` takes it."""
    if ((h.shape[1] != 1 and not meta.checks) or h.device.type != "cpu"
            or cache.k.device.type != "cpu"):
        return None  # a CPU kernel: activations and cache both in host RAM
    slots = cache.decode_slots(meta)
    if slots is None:
        return None
    named = None if known is not None else {native: w.get(own) for native, own in names.items()}
    return decode_step(kind, named, h, *cos_sin, cache.k, cache.v, *slots, known=known)


def embedding(weight: torch.Tensor | Packed, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of an embedding matrix, as ``dtype``."""
    if isinstance(weight, Packed):
        return weight.rows(ids, dtype)
    return weight[ids].to(dtype)


# A CPU prefill of many rows (a batch of prompts) runs an MLP MLP_ROWS rows at a time: its
# (rows, 2 I) intermediate then stays in the caches instead of going out to memory and back
# (SmolLM2's is 50 MB at 32 x 128 rows). A batch-32 prefill ran at 1.1x (SmolLM2) and 1.2x
# (Gemma 3) on a Zen 5 EPYC (docs/BENCHMARKS-HISTORY.md). Every row still goes through the same
# kernels (the last pass takes the remainder, so none has fewer than MLP_ROWS // 2 rows). Rows
# of long prompts that multiply on AMX tiles (kernels.rows_on_amx) take no passes: amx.c decodes
# each matrix once a product, and one product for all of them was 1.02-1.05x faster at 32 x 128
# rows and 1.09x at one 4,096-token prompt in chunks of 2,048 (scratch timings, 2-core AMX Xeon).
MLP_ROWS = 512


def _glu_mlp(x: torch.Tensor, gate_up: torch.Tensor | Packed, down: torch.Tensor | Packed,
             gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, gelu: bool
             ) -> torch.Tensor:
    """down(act(gate) * up) with gate and up fused into one (2 I, H) matrix; MLP_ROWS rows at a
    time on a CPU (above). The passes write into buffers taken once for all of them (copied
    there where a product cannot write into them): each pass's own temporaries took pieces of
    the holes that a prompt's large tensors leave in the heap, which then grew by 10-20 MB a
    layer."""
    rows = x.shape[:-1].numel()
    amx = kernels.on_amx(x.shape[0]) if x.dim() == 3 else None
    if amx is not None and not bool(amx.all()):  # rows on AMX tiles and not: each kind apart
        return kernels.split_rows(
            amx, lambda r: _glu_mlp(x[r], gate_up, down, gate_up_bias, down_bias, gelu))
    if amx is not None and x.dtype == torch.float32 and kernels.takes_rounded(down):
        # on AMX tiles: no passes (each product decodes its matrix once for all its rows),
        # and the activation comes out of act(gate) * up rounded as down's tiles take it
        act = (kernels.amx_glu(x, gate_up, gelu)
               if gate_up_bias is None and isinstance(gate_up, Packed) else None)
        if act is None:
            act = _glu(linear(x, gate_up, gate_up_bias), gelu, rounded=True)
        return kernels.rounded_linear(act, down, down_bias)
    if rows < 2 * MLP_ROWS or x.device.type != "cpu" or amx is not None:
        return linear(_glu(linear(x, gate_up, gate_up_bias), gelu), down, down_bias)
    # one sequence of all the rows: a product keeps its tiles only for a token of each of
    # several sequences (kernels.integer_linear), and these are a prompt's
    seq = x.reshape(1, rows, x.shape[-1])
    cuts = list(range(0, rows - MLP_ROWS // 2, MLP_ROWS)) + [rows]
    most = max(b - a for a, b in zip(cuts, cuts[1:]))
    out = torch.empty(rows, down.shape[0], dtype=x.dtype)
    both = torch.empty(most, gate_up.shape[0], dtype=x.dtype)
    act = torch.empty(most, gate_up.shape[0] // 2, dtype=x.dtype)
    for a, b in zip(cuts, cuts[1:]):
        n = b - a
        g = linear(seq[:, a:b], gate_up, gate_up_bias, out=both[:n])
        linear(_glu(g, gelu, out=act[:n])[None], down, down_bias, out=out[a:b])
    return out.view(*x.shape[:-1], -1)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None
               ) -> torch.Tensor:
    """SwiGLU MLP with gate and up projections fused into one (2*I, H) matrix."""
    return _glu_mlp(x, gate_up, down, gate_up_bias, down_bias, gelu=False)


def gelu_tanh_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """GeGLU MLP (Gemma): down(gelu_tanh(gate(x)) * up(x)), gate and up fused as in swiglu_mlp."""
    return _glu_mlp(x, gate_up, down, None, None, gelu=True)


def _glu(gate_up: torch.Tensor, gelu: bool, out: torch.Tensor | None = None,
         rounded: bool = False) -> torch.Tensor:
    """act(gate) * up, act SiLU or GELU's tanh form: in one native call on a CPU; into ``out``
    (contiguous, gate_up's rows) if given; ``rounded``: rounded to bfloat16."""
    y = kernels.glu(gate_up, gelu, out, bfloat16=rounded)
    if y is None:
        gate, up = gate_up.chunk(2, dim=-1)
        y = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
        y = y.bfloat16() if rounded else y
    return _into(y, out)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in float32 for the configured RoPE variant."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope.kind == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by factor, blend in between.
        old_ctx = rope.original_max_position or 8192
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / rope.factor,
                               torch.where(wavelen < high_wavelen, inv_freq, blended))
    elif rope.kind == "yarn":
        # YaRN: extrapolate high frequencies, interpolate (divide by factor) low ones, with a
        # linear ramp between the dimensions that turn beta_fast and beta_slow times over the
        # original context.
        def dim_of(rotations: float) -> float:
            ctx = rope.original_max_position
            return head_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

        low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        inv_freq = inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)
    return inv_freq


def yarn_mscale(factor: float, mscale: float | None = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * (mscale or 1.0) * math.log(factor) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor YaRN multiplies cos/sin by (1 for other kinds)."""
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (B, 1, T, 2 len(inv_freq)) for positions (B, T), computed in float32:
    as wide as the rotated part of a head (all of it, or its first ``rotary_dim`` numbers)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # (B, T, R/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False
               ) -> torch.Tensor:
    """Rotate x (B, heads, T, D) in the half-split layout Hugging Face uses, or (``pairs``)
    with each rotated pair adjacent, (x[2i], x[2i + 1]) turned by the angle of i: Q/K rows in
    llama.cpp's order (``RopeConfig.pairs``). Both take rope_cos_sin's tables, whose width R
    may be less than D (partial rotary): then only x's first R numbers turn."""
    out = kernels.rope(x, cos, sin, pairs)  # float32 on a CPU: one call
    if out is not None:
        return out
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :R], cos, sin, pairs), x[..., R:]), dim=-1)
    if pairs:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, s = cos[..., :x.shape[-1] // 2], sin[..., :x.shape[-1] // 2]
        return torch.stack((x1 * c + -x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, D) whose rotation pairs are adjacent elements (2i, 2i+1), as
    DeepSeek's checkpoints lay them out; cos/sin (B, 1, T, D/2). Computed in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.float(), sin.float()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)
