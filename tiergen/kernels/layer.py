"""Decode layers of packed weights in one call to ``layer.c``: a whole layer, or all of a
step's layers one after another (:func:`run_steps`).

A model family describes its layer once (:class:`LayerKind`) and hands each decode step's
tensors to :func:`decode_step` under the names of :data:`NORMS`, :data:`BIASES` and
:data:`MATRICES`; where anything is outside what the C layer takes (a GPU, float weights,
on the float path too many rows, a cache it does not know), it returns None and the family
runs its layer operation by operation, which computes the same numbers within rounding.

For a mixture of experts, ``layer.c`` also runs a token's chosen experts in one call
(:func:`experts_row`), DeepSeek's routing (:func:`route_rows`), and both at once where the
experts are at hand (:func:`moe_row`); for DeepSeek, its latent attention
(:func:`mla_attention`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tiergen import kernels
from tiergen.weights.packed import Packed

if TYPE_CHECKING:
    from tiergen.config import MoEConfig

NORMS = ("attn_norm", "q_norm", "k_norm", "attn_out_norm", "ffn_norm", "ffn_out_norm")
BIASES = ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")
MATRICES = ("qkv", "o", "gate_up", "down")
_ptr = ctypes.c_void_p


class _Layer(ctypes.Structure):
    """tiergen.h's tg_layer, field for field."""

    _fields_ = ([(n, ctypes.c_int64)
                 for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "rotary")]
                + [(n, ctypes.c_float) for n in ("eps", "shift", "q_scale")]
                + [(n, ctypes.c_int32) for n in ("gelu", "qa", "wide", "pairs")]
                + [(n, _ptr) for n in NORMS + BIASES + MATRICES])


@dataclass(frozen=True)
class LayerKind:
    """What a family's decode layer is, beyond its tensors (see ``layer.c``)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    shift: float = 0.0  # norms multiply by (w + shift): 1 for Gemma
    q_scale: float = 1.0  # q is multiplied by it after the rotation
    gelu: bool = False  # the MLP's activation: GELU (tanh) instead of SiLU
    pairs: bool = False  # rotary pairs adjacent (RopeConfig.pairs)
    rotary: int = 0  # the rotated numbers of a head: 0 all of them, fewer for partial rotary


_built: dict[tuple, tuple[_Layer, list]] = {}  # by the addresses (and layouts) they point to


def _usable(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu"
                         and t.is_contiguous())


def _key(head: tuple, mats: list, vecs: list) -> tuple:
    """What a C description built from ``mats`` and ``vecs`` is kept under in :data:`_built`:
    every address it holds. Buffers that stream weights from disk hold another layer's
    matrices, perhaps of other types (Q4_K_M mixes them), at the same address: the key has
    the layout too."""
    return (*head, *((m.data.data_ptr(), m.shape, m.parts,
                      None if m.tiles is None else m.tiles.data_ptr())
                     for m in mats if isinstance(m, Packed)),
            *(None if v is None else (v.data_ptr(), v.dtype, v.device) for v in vecs))


def _remember(key: tuple, described: ctypes.Structure, arrays: list) -> None:
    if len(_built) > 4096:  # weights streamed from disk come at new addresses every step
        _built.clear()
    # The key is every address the description holds, so it never outlives what it names:
    # tensors at those addresses later are the ones a call passes. Only the arrays it points
    # to are kept (holding the tensors would keep a closed model's weights alive).
    _built[key] = (described, arrays)


def _layer(kind: LayerKind, fmt: tuple[int, bool] | None, w: dict) -> _Layer | None:
    """The C description of a layer (built once for the same tensors), or None if the C
    layer cannot take them."""
    mats = [w[n] for n in MATRICES]
    if not isinstance(mats[0], Packed):
        return None
    vecs = [w.get(n) for n in NORMS + BIASES]
    key = _key((kind, fmt), mats, vecs)
    entry = _built.get(key)
    if entry is not None:
        return entry[0]
    if not all(map(kernels.integer_kernels_take, mats)) or not all(map(_usable, vecs)):
        return None
    arrays = [kernels.matrix_descriptor(m) for m in mats]
    qa, wide = fmt or (0, False)
    layer = _Layer(w["o"].shape[0], kind.heads, kind.kv_heads, kind.head_dim,
                   w["down"].shape[1], kind.rotary or kind.head_dim, kind.eps, kind.shift, kind.q_scale, int(kind.gelu),
                   qa, int(wide), int(kind.pairs),
                   *(None if v is None else v.data_ptr() for v in vecs),
                   *(ctypes.addressof(a) for a in arrays))
    layer.arrays = arrays  # (whoever keeps the description keeps what it points to)
    _remember(key, layer, arrays)
    return layer


def _products(hidden: int) -> _Layer:
    """What the products of tg_experts_row and tg_moe_row read of a layer: its width and the
    thread's activations."""
    qa, wide = kernels.ACTIVATION_FORMATS.get(kernels.activations()) or (0, False)
    return _Layer(hidden=hidden, qa=qa, wide=int(wide))


def _too_many(rows: int, fmt: tuple | None) -> bool:
    """Whether a decode step of this many rows leaves the C layer: on the float path past
    ROW_THRESHOLD (the BLAS on the decoded matrices is faster); on the integer path never, so
    that a row's numbers are those of one arithmetic whatever the batch."""
    return fmt is None and rows > kernels.ROW_THRESHOLD


class Step(ctypes.Structure):
    """tiergen.h's tg_step: one layer of a decode step, as tg_decode_layers runs it."""

    _fields_ = [("layer", _ptr), ("cos", _ptr), ("sin", _ptr), ("kc", _ptr), ("vc", _ptr),
                ("strides", _ptr), ("mask", _ptr), ("slot", ctypes.c_int64),
                ("slots", ctypes.c_int64), ("kv16", ctypes.c_int32), ("tokens", ctypes.c_int64)]


def _inputs_usable(cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> bool:
    return (_usable(cos) and _usable(sin) and mask is not None and mask.is_contiguous()
            and mask.dtype == torch.bool and mask.device.type == "cpu")


def decode_step(kind: LayerKind, w: dict, h: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int,
                mask: torch.Tensor, known: Step | None = None) -> Step | None:
    """A decode layer for :func:`run_steps`: h (B, T, hidden) through it, the new tokens' K/V
    written to the cache k, v (B, KVH, S, D; float32 or float16) at slots ``slot`` onwards,
    token t attending over the slots that ``mask`` (B, 1, T, S') allows (S' <= S); cos, sin
    (B, 1, T, rotary). T > 1 for a speculative step's checks, each token with a decode step's
    numbers. None where the C layer cannot run it (see the module docstring). The tensors
    must outlive the run.

    ``known``: this layer's step of an earlier decode step of as many rows, with the same
    weights, cache tensors and activations (the caller's promise): only what changes from
    step to step (cos, sin, slot, mask) is set in it anew."""
    if known is not None:
        if not _inputs_usable(cos, sin, mask):
            return None
        known.cos, known.sin, known.mask = cos.data_ptr(), sin.data_ptr(), mask.data_ptr()
        known.slot, known.slots = slot, mask.shape[-1]
        return known
    B = h.shape[0] * h.shape[1]
    fmt = kernels.ACTIVATION_FORMATS.get(kernels.activations())
    kv16 = kernels.kv_format(k, v)  # (the layer writes float32 and float16 caches)
    if (_too_many(B, fmt) or not _usable(h) or not _inputs_usable(cos, sin, mask)
            or kv16 not in (0, 1) or k.stride(-1) != 1 or v.stride(-1) != 1):
        return None
    if kernels.library() is None:
        return None
    if fmt is not None and B >= kernels.TILE_ROWS:
        for n in MATRICES:
            if isinstance(w[n], Packed):
                kernels.keep_tiles_for(w[n], B, *fmt)
    layer = _layer(kind, fmt, w)
    if layer is None:
        return None
    strides = (ctypes.c_int64 * 6)(*k.stride()[:3], *v.stride()[:3])
    step = Step(ctypes.addressof(layer), cos.data_ptr(), sin.data_ptr(), k.data_ptr(),
                v.data_ptr(), ctypes.addressof(strides), mask.data_ptr(), slot, mask.shape[-1],
                kv16, h.shape[1])
    step.keep = strides, layer  # what it points to lives as long as it does
    return step


def run_steps(steps: list[Step], h: torch.Tensor) -> torch.Tensor:
    """h (B, T, hidden) through the layers ``steps`` describe, in order, in one native call:
    a decode step's Python then costs the layers once, not once a layer."""
    out = h.clone()
    err = kernels.library().tg_decode_layers((Step * len(steps))(*steps), len(steps),
                                             out.data_ptr(), h.shape[0] * h.shape[1])
    if err:
        raise MemoryError("decode layer: out of memory for its buffers")
    return out


def experts_row(x: torch.Tensor, experts: list[tuple[Packed, Packed]], mix: list[float]
                ) -> torch.Tensor | None:
    """One token's experts in one native call (``tg_experts_row``): the sum, in order, of
    ``mix[e]`` times expert e's SwiGLU MLP of x (1, hidden), each expert a (gate_up, down)
    pair of packed matrices on the CPU (of any intermediate size: a shared expert can be one).
    None where the C kernels cannot take them; then the experts run one by one, which
    computes the same numbers."""
    if not (_usable(x) and x.shape[0] == 1):
        return None
    arrays = []
    for m in (m for pair in experts for m in pair):
        # (a matrix keeps a descriptor once the integer kernels are known to take it)
        d = m.descriptor if isinstance(m, Packed) else None
        if d is None:
            if not kernels.integer_kernels_take(m):
                return None
            d = kernels.matrix_descriptor(m)
        arrays.append(d)
    lib = kernels.library()
    if lib is None:
        return None
    table = (ctypes.c_void_p * len(arrays))(*(ctypes.addressof(a) for a in arrays))
    weights = (ctypes.c_float * len(mix))(*mix)
    out = torch.empty(1, x.shape[1], dtype=torch.float32)
    err = lib.tg_experts_row(ctypes.byref(_products(x.shape[1])), table, len(experts), weights, x.data_ptr(),
                             out.data_ptr())
    if err == 2:
        raise MemoryError("routed experts: out of memory for their buffers")
    return None if err else out


_SCORING = {"softmax": 0, "sigmoid": 1}
_GROUPS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


def route_rows(cfg: MoEConfig, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """DeepSeek's routing (moe.py's ``route``) of rows x (N, H) by a float32 router gate
    (E, H) in one native call (``tg_route``): the chosen experts (N, k) and their weights
    (N, k). None where it cannot take them (a GPU, another scoring)."""
    if (cfg.scoring not in _SCORING or not all(map(_usable, (x, gate, bias)))
            or (lib := kernels.library()) is None):
        return None
    n, k = x.shape[0], cfg.top_k
    ids = torch.empty(n, k, dtype=torch.int64)
    weights = torch.empty(n, k, dtype=torch.float32)
    err = lib.tg_route(x.data_ptr(), n, x.shape[1], gate.data_ptr(), gate.shape[0],
                       None if bias is None else bias.data_ptr(), _SCORING[cfg.scoring],
                       _GROUPS[cfg.topk_method], cfg.num_groups, cfg.topk_groups, k,
                       int(cfg.norm_topk_prob), cfg.routed_scaling_factor, ids.data_ptr(),
                       weights.data_ptr())
    if err:
        raise MemoryError("routing: out of memory for its buffers")
    return ids, weights


class _Router(ctypes.Structure):
    """tiergen.h's tg_router, field for field."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("hidden", "experts", "groups", "topk_groups", "k")]
                + [(n, ctypes.c_int32) for n in ("scoring", "method", "norm")]
                + [("scale", ctypes.c_float), ("W", _ptr), ("bias", _ptr)])


def expert_table(pairs: list[tuple[Packed, Packed] | None]) -> ctypes.Array | None:
    """Experts' (gate_up, down) matrices as :func:`moe_row` takes them (None: an expert not
    at hand); None where the C kernels cannot take one of them."""
    table = (ctypes.c_void_p * (2 * len(pairs)))()
    for e, pair in enumerate(pairs):
        if pair is not None and not set_expert(table, e, pair):
            return None
    return table


def set_expert(table: ctypes.Array, e: int, pair: tuple[Packed, Packed] | None) -> bool:
    """Expert e's matrices into a table of :func:`expert_table` (None: no longer at hand),
    where the C kernels take them; whether they were. The table holds their descriptors'
    addresses: the matrices must outlive their place in it."""
    table[2 * e:2 * e + 2] = [None, None]
    if pair is None or not all(map(kernels.integer_kernels_take, pair)):
        return False
    descriptors = [kernels.matrix_descriptor(m) for m in pair]
    if any(m.descriptor is None for m in pair):  # (not kept: with tiles)
        return False
    table[2 * e:2 * e + 2] = [ctypes.addressof(d) for d in descriptors]
    return True


def moe_row(cfg: MoEConfig, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None,
            table: ctypes.Array, shared: tuple[Packed, Packed, float] | None
            ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """One token's routing (as :func:`route_rows`) and, where ``table`` (:func:`expert_table`)
    holds every chosen expert, its experts and the ``shared`` one (gate_up, down, its weight)
    summed as :func:`experts_row` sums them, in one native call (``tg_moe_row``): (out,
    ids, weights), or (None, ids, weights) where an expert is not at hand; None where the C
    kernels cannot take x, the router or the shared expert."""
    if (cfg.scoring not in _SCORING or not all(map(_usable, (x, gate, bias))) or len(x) != 1
            or (lib := kernels.library()) is None):
        return None
    pair = None
    if shared is not None:
        if not all(map(kernels.integer_kernels_take, shared[:2])):
            return None
        descriptors = [kernels.matrix_descriptor(m) for m in shared[:2]]  # (held to the call)
        pair = (ctypes.c_void_p * 2)(*map(ctypes.addressof, descriptors))
    hidden, k = x.shape[1], cfg.top_k
    router = _Router(hidden, gate.shape[0], cfg.num_groups, cfg.topk_groups, k,
                     _SCORING[cfg.scoring], _GROUPS[cfg.topk_method], int(cfg.norm_topk_prob),
                     cfg.routed_scaling_factor, gate.data_ptr(),
                     None if bias is None else bias.data_ptr())
    ids = torch.empty(1, k, dtype=torch.int64)
    weights = torch.empty(1, k, dtype=torch.float32)
    out = torch.empty(1, hidden, dtype=torch.float32)
    err = lib.tg_moe_row(ctypes.byref(_products(hidden)), ctypes.byref(router), x.data_ptr(), table, pair,
                         1.0 if shared is None else shared[2], ids.data_ptr(),
                         weights.data_ptr(), out.data_ptr())
    if err == 2:
        raise MemoryError("mixture of experts: out of memory for its buffers")
    return (None if err else out), ids, weights


class _Mla(ctypes.Structure):
    """tiergen.h's tg_mla, field for field."""

    _fields_ = ([(n, ctypes.c_int64) for n in ("hidden", "heads", "q_rank", "kv_rank", "nope",
                                                "rope", "v_dim")]
                + [(n, ctypes.c_float) for n in ("eps", "scale")]
                + [(n, ctypes.c_int32) for n in ("qa", "wide", "kb_type", "vb_type")]
                + [(n, ctypes.c_int64) for n in ("kb_stride", "vb_stride")]
                + [(n, _ptr) for n in ("attn_norm", "q_norm", "kv_norm", "qkv_a", "q_b", "o",
                                       "k_b", "v_b")])


@dataclass(frozen=True)
class MlaKind:
    """What DeepSeek's latent attention is, beyond its tensors (see ``tg_mla_attention``)."""

    heads: int
    q_rank: int  # 0: queries straight from x
    kv_rank: int
    nope: int
    rope: int
    v_dim: int
    eps: float
    scale: float  # of the scores


MLA_MATRICES = ("qkv_a", "q_b", "o", "k_b", "v_b")


def _mla(kind: MlaKind, fmt: tuple[int, bool] | None, w: dict) -> _Mla | None:
    """The C description of a latent attention (built once for the same tensors, as
    :func:`_layer`), or None if the C kernels cannot take them."""
    mats = [w.get(n) for n in MLA_MATRICES]
    vecs = [w.get(n) for n in ("input_norm", "q_norm", "kv_norm")]
    if (not all(isinstance(m, Packed) for m in mats if m is not None)
            or (mats[1] is None and kind.q_rank)):
        return None
    key = _key(("mla", kind, fmt), mats, vecs)
    entry = _built.get(key)
    if entry is not None:
        return entry[0]
    if (not all(kernels.integer_kernels_take(m) for m in mats if m is not None)
            or not all(map(_usable, vecs)) or len(w["k_b"].parts) != 1
            or len(w["v_b"].parts) != 1):
        return None
    arrays = {n: kernels.matrix_descriptor(w[n]) for n in ("qkv_a", "q_b", "o") if n in w}
    qa, wide = fmt or (0, False)
    k_b, v_b = w["k_b"], w["v_b"]
    mla = _Mla(w["o"].shape[0], kind.heads, kind.q_rank, kind.kv_rank, kind.nope, kind.rope,
               kind.v_dim, kind.eps, kind.scale, qa, int(wide), k_b.parts[0][0],
               v_b.parts[0][0], k_b.data.numel() // kind.heads, v_b.data.numel() // kind.heads,
               *(None if v is None else v.data_ptr() for v in vecs),
               *(ctypes.addressof(arrays[n]) if n in arrays else None
                 for n in ("qkv_a", "q_b", "o")),
               k_b.data.data_ptr(), v_b.data.data_ptr())
    _remember(key, mla, list(arrays.values()))
    return mla


def mla_attention(kind: MlaKind, w: dict, h: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, rows: torch.Tensor, slot: int, mask: torch.Tensor
                  ) -> torch.Tensor | None:
    """h (B, 1, hidden) after DeepSeek's latent attention (``tg_mla_attention``), the new
    token's latent row written to the cache ``rows`` (B, 1, S, kv_rank + rope; float32 or
    float16) at ``slot``, attention over the slots ``mask`` (B, 1, 1, S) allows; cos, sin
    (B, rope), halves equal. ``w``: the layer's "input_norm", "qkv_a", ("q_norm", "q_b"),
    "kv_norm", "k_b", "v_b", "o". None where the C kernels cannot run it."""
    B = h.shape[0]
    fmt = kernels.ACTIVATION_FORMATS.get(kernels.activations())
    kv16 = kernels.kv_format(rows, rows)  # (float32 and float16 caches, as decode_step)
    if (_too_many(B, fmt) or not _usable(h) or not _usable(cos) or not _usable(sin)
            or kv16 not in (0, 1) or rows.stride(-1) != 1 or mask is None or not mask.is_contiguous()
            or mask.dtype != torch.bool or mask.device.type != "cpu"
            or (lib := kernels.library()) is None):
        return None
    if fmt is not None and B >= kernels.TILE_ROWS:
        for n in ("qkv_a", "q_b", "o"):
            if isinstance(w.get(n), Packed):
                kernels.keep_tiles_for(w[n], B, *fmt)
    mla = _mla(kind, fmt, w)
    if mla is None:
        return None
    out = h.clone()
    strides = (ctypes.c_int64 * 3)(*rows.stride()[:3])
    err = lib.tg_mla_attention(ctypes.byref(mla), out.data_ptr(), B, cos.data_ptr(),
                               sin.data_ptr(), rows.data_ptr(), strides, slot, rows.shape[2],
                               mask.data_ptr(), kv16)
    if err == 2:
        raise MemoryError("latent attention: out of memory for its buffers")
    return None if err else out
