"""Memory per tier: what a policy needs (exact byte counts, before any work starts), the
budgets it must fit, and what the process really used."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiergen import kernels
from tiergen._platform import cpu_has_fast_bfloat16
from tiergen.cache.attention import SPARSE_PIECE_BYTES
from tiergen.models.layers import UPCAST_ROWS, widened_rows
from tiergen.models.qwen3_next import CHANNEL_CHUNK, CHUNK
from tiergen.config import ModelConfig
from tiergen.errors import TiergenError
from tiergen.offload.policy import TIERS, parse_size

Bytes = dict[str, int]

# what a GPU's matmul libraries take from the allocator on their first calls (cuBLAS keeps a
# workspace per handle and stream) beside tiergen's tensors
GPU_WORKSPACE = 64 << 20


def fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Budgets:
    """Most bytes tiergen may hold on the device and in host RAM (None = no limit)."""

    device: int | None = None
    host: int | None = None

    @classmethod
    def parse(cls, device: int | str | None, host: int | str | None) -> Budgets:
        """Budgets as given by a caller: bytes or sizes such as "8G" (None = no limit)."""
        return cls(None if device is None else parse_size(device),
                   None if host is None else parse_size(host))

    def for_tensors(self, device_type: str) -> Budgets:
        """What is left of the budgets for tiergen's own tensors: on a GPU the device budget
        less the workspace its matmul libraries take (``GPU_WORKSPACE``)."""
        if device_type != "cuda" or self.device is None:
            return Budgets(self.device, self.host)
        return Budgets(max(0, self.device - GPU_WORKSPACE), self.host)

    def less(self, held: Bytes) -> Budgets:
        """What is left of these budgets beside ``held`` (a draft model's weights, say)."""
        return Budgets(*(None if getattr(self, t) is None else
                         max(0, getattr(self, t) - held.get(t, 0)) for t in ("device", "host")))

    def over(self, needs: Bytes) -> list[str]:
        """The tiers whose needs exceed their budgets."""
        return [t for t in ("device", "host")
                if getattr(self, t) is not None and needs.get(t, 0) > getattr(self, t)]

    def fits(self, needs: Bytes) -> bool:
        return not self.over(needs)

    def check(self, needs: Bytes, what: str, hint: dict[str, str]) -> None:
        """Refuse, before any work starts, a plan whose tier needs exceed their budgets."""
        if over := self.over(needs):
            tier, limit = over[0], getattr(self, over[0])
            raise TiergenError(
                f"{what} needs {fmt(needs[tier])} of {tier} memory but the {tier} budget is "
                f"{fmt(limit)} (over by {fmt(needs[tier] - limit)}); {hint[tier]}")


def _attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Numbers per token of the queries and of the new K/V a layer makes (MLA: absorbed
    queries against its latent row)."""
    parts, heads, width = cfg.kv_layout()
    if cfg.mla is not None:
        m = cfg.mla
        return cfg.num_heads * max(m.kv_lora_rank + m.qk_rope_head_dim,
                                   m.qk_nope_head_dim + m.qk_rope_head_dim), parts * heads * width
    return cfg.num_heads * cfg.head_dim, parts * heads * width


def _mlp_width(cfg: ModelConfig) -> int:
    """Widest intermediate a token's MLP makes: the dense one, or its routed experts' (each
    token's top-k gathered) beside the shared experts'."""
    width = cfg.intermediate_size
    if cfg.moe is not None:
        m = cfg.moe
        width = max(width, m.top_k * m.intermediate_size + m.shared_intermediate_size)
    return width


# float32 copies of a decode step's absorbed MLA queries and outputs (per row, head and
# latent + rope channel), by how the matrix library multiplies them: packing the operands;
# bfloat16 on AMX tiles, as they lie; bfloat16 widened on a CPU without native bfloat16
# (measured on the test models' decode steps: tests/test_device_budget.py)
ABSORBED_COPIES = {"packed": 20, "tiles": 8, "widened": 4}


def _attention_bytes(cfg: ModelConfig, dt: int, rows: int, tokens: int, keys: int,
                     products: str = "packed") -> int:
    """Bytes attention itself makes for one step: the decode path's scores and probabilities,
    or a prompt step's mask in the compute dtype, K/V repeated for the query heads of a
    group, a ring's K/V joined with the step's own, gpt-oss's spelled-out scores, the float32
    partial outputs a chunk merges, and MLA's latents expanded into per-head keys and values.
    ``products``: how a decode step's absorbed products multiply (:data:`ABSORBED_COPIES`)."""
    q, _ = _attention_widths(cfg)
    parts, heads, width = cfg.kv_layout()
    expanded = 0
    if cfg.mla is not None:  # a prompt's latents expanded into each head's keys and values,
        m = cfg.mla  # or a decode step's absorbed queries, outputs and their float32 copies
        expanded = (rows * keys * cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim
                                                   + m.v_head_dim) * dt if tokens > 1 else
                    ABSORBED_COPIES[products] * rows * cfg.num_heads
                    * (m.kv_lora_rank + m.qk_rope_head_dim) * 4)
    if cfg.mla is not None and cfg.mla.index_heads:  # sparse attention's pieces of queries
        expanded += 2 * SPARSE_PIECE_BYTES
    if tokens == 1:
        need = rows * cfg.num_heads * keys * (2 * dt + 4)
    else:
        need = rows * tokens * keys * (dt + 1) + 3 * rows * tokens * q * 4
        need += 2 * rows * cfg.num_heads * keys * width * dt  # K/V repeated (GQA) or joined
        if cfg.attention_sinks:
            need += rows * cfg.num_heads * min(tokens, 256) * keys * (8 + dt)
    return max(need + expanded, _delta_rule_bytes(cfg, rows, tokens))


def _delta_rule_bytes(cfg: ModelConfig, rows: int, tokens: int) -> int:
    """Bytes a linear-attention layer makes beside its projections: the delta rule's float32
    chunks (a decode step's recurrent step: copies of the state) and the convolution's."""
    if not cfg.keeps_states:
        return 0
    m = cfg.linear
    if tokens == 1:
        rule = 0
    elif m.per_channel:  # each chunk's pairs of tokens, channel by channel, one at a time
        C = min(CHANNEL_CHUNK, tokens)
        rule = 2 * C * C * m.key_head_dim + tokens * (8 * m.key_head_dim + 6 * m.value_head_dim
                                                      + 2 * C)
    else:
        rule = -(-tokens // CHUNK) * CHUNK * (4 * CHUNK + 6 * m.key_head_dim
                                               + 6 * m.value_head_dim)
    # the state as the step found it and its update (a decode step's: in place on a CPU,
    # decayed into a copy elsewhere), a prompt's chunked rule's too
    states = 2 if tokens == 1 else 3
    return 4 * rows * (m.value_heads * rule + states * m.state_numel + 2 * tokens * m.conv_dim)


def step_transient(cfg: ModelConfig, dtype: torch.dtype, rows: int, tokens: int, keys: int,
                   attends: bool = True, device_type: str = "cuda") -> int:
    """Most bytes one step of ``rows`` x ``tokens`` holds on the compute device at once
    beyond its input hidden states, over ``keys`` cache slots: a layer's largest moment or
    the LM head's. ``attends``: the step's attention runs on the device (not the CPU's).

    A layer keeps its normed input, q/k/v and their rotated copies, the attention output
    and the float32 residual after attention to its end; on top of those comes the largest
    of the norms' float32 copies, RoPE's temporaries, attention's own bytes, the MLP's
    gate|up output, activation and product, or its output with the new residual. The head
    makes the last position's logits in the compute dtype and their float32 copy. A CPU
    multiplying half precision packs the layer matrix it multiplies, or, without native
    bfloat16, widens a product's rows and output to float32. (A GPU's matmul
    workspace comes off the budget instead: ``Budgets.for_tensors``.)"""
    dt, n, hidden = dtype.itemsize, rows * tokens, cfg.hidden_size
    q, kv = _attention_widths(cfg)
    # a CPU without native bfloat16 widens products of many rows (layers._widened_linear)
    # and packs none
    widens = device_type == "cpu" and dtype == torch.bfloat16 and not cpu_has_fast_bfloat16()
    # Few bfloat16 rows multiply on AMX tiles with the matrix as it lies (layers.linear), not
    # packed. gpt-oss's step holds more than the moments below count where its biased expert
    # products go to torch (addmm; the test model's experts are 48 wide, not whole tile
    # steps): the packing's bytes still cover that there.
    tiles = (dtype == torch.bfloat16 and n <= kernels.AMX_DENSE_ROWS and not cfg.attention_sinks
             and kernels.amx_engine())
    held = n * (hidden * dt + 2 * (q + kv) * dt + 2 * q * dt + hidden * 4)
    held += rows * tokens * (keys + 2 * cfg.head_dim * dt)  # the step's mask, RoPE's tables
    moments = [n * hidden * (8 + dt),  # a norm: float32 copy, its squares, the result
               3 * n * q * dt,  # RoPE
               n * (hidden * dt + 4 * _mlp_width(cfg) * dt),  # normed input, gate|up, act, product
               n * hidden * (dt + 4),  # down's output, the new residual
               _attention_bytes(cfg, dt, rows, tokens, keys,
                                "widened" if widens else "tiles" if tiles else "packed")
               if attends else 0]
    if cfg.moe is not None:  # router scores, and the float32 sum the experts add into
        moments.append(n * (cfg.moe.num_experts * 8 + hidden * 8))
    head = rows * (hidden * (4 + dt) + cfg.vocab_size * (dt + 4))
    extra = 0
    if device_type == "cpu" and dtype.itemsize < 4 and not tiles:
        if widens:
            # From UPCAST_ROWS rows, products widen to float32: the input rows and output of
            # the rows widened at a time in float32 beside the bfloat16 ones; fewer rows
            # multiply as they lie.
            mlp = _mlp_width(cfg)
            if n >= UPCAST_ROWS:
                extra = max(min(n, widened_rows(out, k)) * (out + k) * 4 for out, k in
                            ((q + kv, hidden), (hidden, q), (2 * mlp, hidden), (hidden, mlp)))
            if rows >= UPCAST_ROWS:
                vocab = cfg.vocab_size
                head += min(rows, widened_rows(vocab, hidden)) * (hidden + vocab) * 4
        else:
            extra = hidden * max(q + kv, 2 * _mlp_width(cfg)) * dtype.itemsize
    return max(held + max(moments), head) + extra


def largest_step(fits: Callable[[int], bool], tokens: int) -> int:
    """The most tokens per step, at most ``tokens``, for which ``fits`` holds (its needs grow
    with the tokens), or 0 when not even one token fits."""
    if fits(tokens):
        return tokens
    if tokens == 1 or not fits(1):
        return 0
    lo, hi = 1, tokens  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def add(*parts: Bytes) -> Bytes:
    return {t: sum(p.get(t, 0) for p in parts) for t in TIERS}


def available_ram() -> int | None:
    """MemAvailable from /proc/meminfo, or None (no limit) where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_set() -> tuple[int, int]:
    """(current, peak) resident memory of this process in bytes, from /proc."""
    current = peak = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    current = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except OSError:
        pass
    return current, peak


def reset_peak_resident_set() -> None:
    """Start a new peak-RSS measurement (Linux: writing 5 to clear_refs resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def device_peak(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None
