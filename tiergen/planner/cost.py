"""Predict what a policy costs: memory per tier exactly (the executor's own ``block_needs``),
and seconds of prefill and decode from a calibration's bandwidths and rates.

The block schedule overlaps a layer's compute with the next layer's weight load (I/O threads)
and with the cache's loads and stores (one FIFO thread), so a layer takes
``max(weight load, cache load + cache store, compute)``, and no less than the traffic on a
link that weights and cache share (disk; host-to-device). Each micro-batch pays its own compute
and cache traffic; a block pays each layer's weight load once.

Simplifications (``benchmarks/bench_plan.py`` measures how far they hold):
- A matmul costs what calibration measured for its kind of weights (the compute dtype, or
  packed blocks) at its number of rows, interpolated between the row counts measured; without
  those figures, FLOPs at the large-GEMM rate plus weight bytes at the batch-1 GEMV rate (they
  add up rather than overlap: measured). Each layer call adds the calibrated dispatch overhead
  (``LAYER_OVERHEAD_S`` without one); unmeasured dtypes use the float32 figures. Chunked
  prefill loads the weights once per chunk. A prompt of ``AMX_PROMPT`` tokens or more
  multiplies packed weights at the rates measured on AMX tiles, where the calibration has them.
- Attention costs max(FLOPs at the GEMM rate, cache bytes read at the CPU attention rate on a
  CPU, the GEMV rate (device memory) on a GPU); ``attn_sparsity`` shrinks the V half. A
  prompt step's FLOPs run at the rate calibration measured for a prompt's attention, where it
  has one (a long prompt's on the integer path: on AMX tiles).
- MoE: b tokens make b * top_k independent uniform picks among E routed experts, touching
  E * (1 - (1 - 1/E)**(b * top_k)) distinct experts, which are read and streamed (FLOPs count
  top_k per token). Host experts behind a GPU count as shipped to it.
- Compression: stored and moved bytes are WeightPlan's and block_needs' compressed counts;
  dequantising writes the full-precision bytes at the host memcpy rate (CPU) or the GEMV rate
  (GPU) over ``DEQUANT_SLOWDOWN`` unless calibration measured it: weights once per block on the
  compute thread, the cache on every load (the executor unpacks a compressed cache wherever it
  lives; on a CPU it does so on the compute thread unless the cache is on disk).
- Disk writes run at the disk read rate; hidden states off the device move synchronously.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from tiergen.calibration import Calibration
from tiergen.config import ModelConfig
from tiergen.engine.executor import block_needs, cache_compression
from tiergen.engine.generate import DEFAULT_PREFILL_CHUNK, chunks
from tiergen.engine.generate import prefill_chunk as prefill_chunk_of
from tiergen.errors import TiergenError
from tiergen.kernels import AMX_PROMPT
from tiergen.models import build_model
from tiergen.models.base import ModelFamily
from tiergen.offload.experts import is_expert
from tiergen.offload.kv import cache_moves, stored_width
from tiergen.offload.policy import TIERS, Policy, tiers_for
from tiergen.offload.weights import WeightPlan

LAYER_OVERHEAD_S = 1e-4  # Python and kernel dispatch per layer call; dominates small models
DEQUANT_SLOWDOWN = 2.5  # 4-bit dequantisation vs a memcpy of its output: 1.6-3.6x (idle CPU)
PARTS = ("weights_load", "cache_load", "cache_store", "compute")


@dataclass
class Workload:
    """``batch`` prompts of ``prompt_len`` tokens, each generating ``gen_len`` tokens."""

    prompt_len: int
    gen_len: int
    batch: int = 1

    def __post_init__(self) -> None:
        if min(self.prompt_len, self.gen_len, self.batch) < 1:
            raise TiergenError(f"a workload needs positive prompt_len, gen_len and batch, "
                               f"got {self}")


@dataclass
class Estimate:
    """A policy's predicted memory (bytes per tier of its largest block) and speed."""

    policy: Policy
    memory: dict[str, int]
    prefill_seconds: float
    decode_seconds: float
    prefill_tok_s: float
    decode_tok_s: float
    total_tok_s: float  # generated tokens / (prefill + decode seconds)
    per_layer: dict[str, float]  # mean seconds per layer of one decode step, by part
    workload: Workload | None = None
    device_type: str = "cpu"
    prefill_chunk: int | None = None  # prompt tokens per prefill step (``memory`` is at it)

    @property
    def binds(self) -> str:
        return max(self.per_layer, key=self.per_layer.get)


@dataclass(frozen=True)
class LayerShape:
    """What one layer stores and computes under a weight placement."""

    weights: tuple[int, int, int]  # bytes stored on (device, host, disk), routed experts aside
    experts: tuple[int, int, int]  # routed experts' bytes per tier
    params: int  # parameters every token uses
    expert_params: int  # parameters of one routed expert (0: a dense layer)
    window: int | None
    packed_params: int = 0  # of ``params``, those multiplied packed (GGML blocks)


@dataclass
class PlacedWeights:
    """A weight placement made once and shared by every policy that places weights alike."""

    plan: WeightPlan
    layers: list[LayerShape]

    @classmethod
    def make(cls, cfg: ModelConfig, dtype: torch.dtype, policy: Policy, device_type: str,
             model: ModelFamily | None = None, source=None) -> PlacedWeights:
        plan = WeightPlan.make(model or build_model(cfg), dtype, policy, torch.device(device_type),
                               source)
        needs = plan.needs()
        plan.needs = lambda: needs  # fixed once made; block_needs asks for it many times
        experts = cfg.moe.num_experts if cfg.moe else 1
        layers = []
        for j, shapes in enumerate(plan.shapes):
            numel = {n: torch.Size(s).numel() for n, s in shapes.items()}
            layers.append(LayerShape(
                tuple(plan.layer_bytes(j, t, experts=False) for t in TIERS),
                tuple(plan.layer_bytes(j, t, experts=True) for t in TIERS),
                sum(v for n, v in numel.items() if not is_expert(n)),
                sum(v for n, v in numel.items() if is_expert(n)) // experts, cfg.window(j),
                sum(v for n, v in numel.items() if not is_expert(n) and plan.packed(j, n))))
        return cls(plan, layers)


def blocks(policy: Policy, batch: int, max_batch_size: int) -> list[list[int]]:
    """Rows of each micro-batch of each block, as ``LLM`` cuts a batch."""
    micro = policy.gpu_batch_size or max_batch_size
    size = micro * policy.num_gpu_batches
    return [[min(micro, rows - i) for i in range(0, rows, micro)]
            for rows in (min(size, batch - s) for s in range(0, batch, size))]


def touched_experts(picks: float, experts: int) -> float:
    """Expected distinct experts hit by ``picks`` independent uniform picks among ``experts``."""
    return experts * (1 - (1 - 1 / experts) ** picks)


def attention_pairs(new: int, before: float, window: int | None) -> float:
    """(query, key) pairs of ``new`` causal queries after ``before`` cached tokens."""
    lo, hi = before + 1, before + new
    if window is None or window >= hi:
        return (lo + hi) * new / 2
    if window <= lo:
        return window * new
    return (lo + window) * (window - lo + 1) / 2 + window * (hi - window)


@dataclass
class _Env:
    """Everything a layer's cost depends on besides the layer itself."""

    cfg: ModelConfig
    policy: Policy
    cal: Calibration
    cuda: bool
    itemsize: int
    matmul: float
    gemv: float
    slot_bytes: int  # one token's cache in one layer, one row, uncompressed
    cache_ratio: float  # stored / uncompressed cache bytes

    dtype_name: str = "float32"
    head: int = 0  # LM head parameters (vocabulary x hidden) this model's last step runs
    prompt_len: int = 0  # the workload's, which decides whether its rows take AMX tiles

    @property
    def dequant(self) -> float:
        """Bytes/s written by dequantisation: measured by calibration, or else estimated from
        host memcpy (CPU) or device memory (GPU) over DEQUANT_SLOWDOWN."""
        measured = self.cal.dequant.get(self.dtype_name)
        return measured or (self.gemv if self.cuda else self.cal.host_memcpy) / DEQUANT_SLOWDOWN

    @property
    def cache_unpack(self) -> float:
        """Bytes/s written unpacking compressed KV-cache rows (many small groups)."""
        return self.cal.cache_unpack.get(self.dtype_name) or self.dequant

    @property
    def overhead(self) -> float:
        """Seconds of dispatch per layer call: measured by calibration, else a guess."""
        return self.cal.layer_overhead or LAYER_OVERHEAD_S

    def linear(self, params: float, rows: float, packed: bool = False,
               amx: bool = False) -> float:
        """Seconds to multiply ``params`` weights by ``rows`` rows: from the calibrated
        rates at each row count (interpolated; beyond the largest, compute grows with the
        rows), or else FLOPs at the GEMM rate plus the weights' bytes at the GEMV rate (they
        add up rather than overlap on a CPU: measured). ``amx``: a long prompt's rows, whose
        packed products take AMX tiles where the calibration measured them there."""
        if not params:
            return 0.0
        names = ([f"packed-amx-{self.dtype_name}"] * amx + [f"packed-{self.dtype_name}"]
                 if packed else [self.dtype_name])
        table = next((t for n in names if (t := self.cal.linear_rows.get(n))), None)
        if not table:
            return 2 * params * rows / self.matmul + params * self.itemsize / self.gemv
        points = sorted((int(r), 1 / v) for r, v in table.items())  # (rows, s per param)
        lo = max((p for p in points if p[0] <= rows), default=points[0])
        hi = min((p for p in points if p[0] >= rows), default=None)
        if hi is None:  # more rows than measured: compute-bound, linear in the rows
            return params * lo[1] * rows / lo[0]
        if hi[0] == lo[0]:
            return params * lo[1]
        return params * (lo[1] + (hi[1] - lo[1]) * (rows - lo[0]) / (hi[0] - lo[0]))

    def attention(self, prompt: bool, amx: bool) -> float:
        """FLOP/s of attention: a prompt step's as calibration measured it (``amx``: a long
        prompt's rows, on AMX tiles where measured there), else the GEMM rate."""
        rates = self.cal.prompt_attention if prompt else {}
        return ((amx and rates.get(f"amx-{self.dtype_name}")) or rates.get(self.dtype_name)
                or self.matmul)

    def picks(self, tokens: float) -> float:
        moe = self.cfg.moe
        return touched_experts(tokens * moe.top_k, moe.num_experts) if moe else 0.0

    def per_byte(self, tier: str, out: bool = False) -> float:
        """Seconds per byte between ``tier`` and the compute device (``out``: towards tier)."""
        t = 1 / self.cal.disk_read if tier == "disk" else 0.0
        if self.cuda and tier != "device":
            t += 1 / (self.cal.device_to_host if out else self.cal.host_to_device)
        return t

    def cache_moves(self, tier: str, prompt: bool = False) -> bool:
        """Whether a layer's cache on ``tier`` is loaded and stored around its use in a
        prompt step or a decode step (the executor unpacks a compressed cache wherever it
        lives; a prompt's attention runs on the device even with cpu_attention)."""
        p = self.policy
        return cache_moves(tier, "cuda" if self.cuda else "cpu", p.compress_cache,
                           p.cpu_attention, prompt)


def _weight_traffic(layer: LayerShape, tokens: int, env: _Env) -> tuple[float, float]:
    """Bytes of a layer read from disk and copied to a GPU, once per block."""
    frac = env.picks(tokens) / env.cfg.moe.num_experts if env.cfg.moe else 0.0
    host = layer.weights[1] + layer.experts[1] * frac
    disk = layer.weights[2] + layer.experts[2] * frac
    return disk, (host + disk if env.cuda else 0.0)


def _cache_io(layer: LayerShape, tier: str, rows: int, new: int, before: float,
              env: _Env) -> tuple[float, float, float, float]:
    """Seconds one micro-batch's cache of a layer takes on the cache thread to load (the
    slots before the step) and to store (the new ones), and its disk and host-to-GPU bytes."""
    if not env.cache_moves(tier, new > 1):
        return 0.0, 0.0, 0.0, 0.0
    dense = env.slot_bytes * rows
    old, fresh = min(before, layer.window or before), min(new, layer.window or new)
    unpack = 1 / env.cache_unpack if env.policy.compress_cache else 0.0
    stored = dense * env.cache_ratio
    return (old * (stored * env.per_byte(tier) + dense * unpack),
            fresh * (stored * env.per_byte(tier, out=True) + dense * unpack),
            (old + fresh) * stored * (tier == "disk"),
            old * stored * (env.cuda and tier != "device"))


def _compute(layer: LayerShape, tier: str, rows: int, new: int, before: float,
             act_tier: str, env: _Env) -> float:
    """Seconds one micro-batch spends in a layer on the compute thread."""
    c, tokens = env.cfg, rows * new
    amx = new > 1 and env.prompt_len >= AMX_PROMPT  # kernels.amx_prompt, by the whole prompt
    t = env.linear(layer.params - layer.packed_params, tokens) + env.overhead \
        + env.linear(layer.packed_params, tokens, packed=True, amx=amx)
    if c.moe and layer.expert_params:  # each touched expert multiplies its share of the picks
        touched = env.picks(tokens)
        t += touched * env.linear(layer.expert_params, tokens * c.moe.top_k / touched)
    pairs = attention_pairs(new, before, layer.window)
    attn_flops = 4 * rows * c.num_heads * c.kv_layout()[2] * pairs
    slots = min(before + new, layer.window or before + new)
    read = rows * slots * env.slot_bytes * (1 + env.policy.attn_sparsity) / 2
    if c.mla is not None and c.mla.index_heads:
        # sparse attention: the indexer scores every slot, each query attends to its
        # index_topk; a step reads every indexer key and only the chosen latent rows
        m, width = c.mla, c.kv_layout()[2]
        latent = width - m.index_head_dim
        attn_flops = 2 * rows * pairs * m.index_heads * m.index_head_dim \
            + 4 * rows * c.num_heads * latent * attention_pairs(new, before, m.index_topk)
        read = rows * env.slot_bytes * (slots * m.index_head_dim
                                        + min(slots, m.index_topk) * latent) / width
    on_cpu = not env.cuda or (tier == "host" and not env.cache_moves(tier, new > 1))
    t += max(attn_flops / env.attention(new > 1, amx),
             read / (env.cal.cpu_attention if on_cpu else env.gemv))
    hidden = 2 * tokens * c.hidden_size * env.itemsize  # into the layer and out of it
    return t + hidden * (env.per_byte(act_tier) + env.per_byte(act_tier, out=True)) / 2


def _layer_step(layer: LayerShape, tier: str, rows: list[int], act_tiers: list[str],
                new: int, before: float, env: _Env) -> tuple[dict[str, float], float]:
    """Seconds of each part of one layer in one step of a block, and the layer's step time."""
    cal = env.cal
    w_disk, w_h2d = _weight_traffic(layer, sum(rows) * new, env)
    io = [_cache_io(layer, tier, r, new, before, env) for r in rows]
    compute = sum(_compute(layer, tier, r, new, before, a, env) for r, a in zip(rows, act_tiers))
    if env.policy.compress_weights:  # dequantised on the compute thread, once per block
        compute += layer.params * env.itemsize / env.dequant
    parts = {"weights_load": w_disk / cal.disk_read + w_h2d / cal.host_to_device,
             "cache_load": sum(x[0] for x in io), "cache_store": sum(x[1] for x in io),
             "compute": compute}
    if not env.cuda and tier != "disk":  # the executor unpacks such caches on the compute thread
        compute += parts["cache_load"] + parts["cache_store"]
        parts["cache_load"] = parts["cache_store"] = 0.0
    links = max((w_disk + sum(x[2] for x in io)) / cal.disk_read,  # shared by weights and cache
                (w_h2d + sum(x[3] for x in io)) / cal.host_to_device)
    return parts, max(parts["weights_load"], parts["cache_load"] + parts["cache_store"],
                      compute, links)


def _step(groups: Counter, rows: list[int], act_tiers: list[str], new: int, before: float,
          env: _Env) -> tuple[float, dict[str, float]]:
    """Seconds of one step of a block through every layer and the LM head, and the mean
    seconds per layer of each part."""
    total, parts = 0.0, dict.fromkeys(PARTS, 0.0)
    for (layer, tier), count in groups.items():
        layer_parts, seconds = _layer_step(layer, tier, rows, act_tiers, new, before, env)
        total += count * seconds
        for k, v in layer_parts.items():
            parts[k] += count * v / env.cfg.num_layers
    head = env.head  # logits of the last position only
    total += sum(env.linear(head, r) for r in rows)
    return total, parts


def estimate(cfg: ModelConfig, dtype: torch.dtype, policy: Policy, workload: Workload,
             cal: Calibration, device_type: str = "cpu", max_batch_size: int = 64,
             placed: PlacedWeights | None = None,
             prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
             head: int | None = None) -> Estimate:
    """Memory and speed of running ``workload`` under ``policy`` (``placed``: the policy's
    weight placement, when the caller already made it; ``head``: the LM head's parameters,
    if not the whole vocabulary's, e.g. 0 for a pipeline stage that does not end the model)."""
    placed = placed or PlacedWeights.make(cfg, dtype, policy, device_type)
    p, g, batch = workload.prompt_len, workload.gen_len, workload.batch
    name = str(dtype).removeprefix("torch.")  # unmeasured dtypes: the float32 figures
    env = _Env(cfg, policy, cal, device_type == "cuda", dtype.itemsize,
               cal.matmul.get(name) or cal.matmul["float32"],
               cal.gemv.get(name) or cal.gemv["float32"],
               cfg.kv_bytes_per_token(dtype.itemsize) // cfg.num_layers,
               _cache_ratio(cfg, dtype, policy), name,
               cfg.vocab_size * cfg.hidden_size if head is None else head, p)
    groups = Counter(zip(placed.layers, tiers_for(cfg.num_layers, policy.cache_split)))
    cut = blocks(policy, batch, max_batch_size)
    prefill = decode = 0.0
    per_layer: dict[str, float] = {}
    for rows in cut:
        acts = tiers_for(len(rows), policy.hidden_split)
        for span in chunks(prefill_chunk, p):
            prefill += _step(groups, rows, acts, len(span), span.start, env)[0]
        seconds, parts = _step(groups, rows, acts, 1, p + g / 2, env)  # mean context
        decode += (g - 1) * seconds
        per_layer = per_layer or parts
    memory = block_needs(placed.plan, cfg, dtype, policy, [(r, p + g) for r in cut[0]],
                         prefill_chunk_of(prefill_chunk, p))
    return Estimate(policy, memory, prefill, decode, batch * p / prefill,
                    batch * (g - 1) / decode if decode else 0.0, batch * g / (prefill + decode),
                    per_layer, workload, device_type, prefill_chunk_of(prefill_chunk, p))


def _cache_ratio(cfg: ModelConfig, dtype: torch.dtype, policy: Policy) -> float:
    """Stored / uncompressed bytes of the KV cache (see offload.kv.stored_width)."""
    width, stored_dtype = stored_width(cfg, dtype, cache_compression(policy))
    return width * stored_dtype.itemsize / (cfg.kv_layout()[2] * dtype.itemsize)