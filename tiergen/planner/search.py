"""Search the offloading policies that fit the memory budgets for the fastest one."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tiergen.calibration import Calibration
from tiergen.config import ModelConfig
from tiergen.engine.executor import block_needs, step_needs
from tiergen.errors import TiergenError
from tiergen.models import build_model
from tiergen.models.base import ModelFamily
from tiergen.engine.generate import DEFAULT_PREFILL_CHUNK, prefill_chunk
from tiergen.offload.memory import Budgets, add, fmt, largest_step
from tiergen.offload.policy import Policy
from tiergen.planner.cost import Estimate, PlacedWeights, Workload, blocks, estimate
from tiergen.weights import WeightSource


def weight_splits(device_type: str) -> list[tuple[int, int]]:
    """(device %, host %) of weights; disk takes the rest. On a CPU device and host are the
    same RAM, so only the device share varies (in finer steps: there are fewer choices)."""
    if device_type == "cpu":
        return [(d, 0) for d in range(100, -1, -10)]
    return [(d, h) for d in range(100, -1, -25) for h in range(100 - d, -1, -25)]


def cache_options(device_type: str) -> list[dict]:
    if device_type == "cpu":
        return [dict(cache=(100, 0)), dict(cache=(50, 0)), dict(cache=(0, 0))]
    return [dict(cache=(100, 0)), dict(cache=(0, 100)), dict(cache=(0, 100), cpu_attention=True),
            dict(cache=(0, 50)), dict(cache=(0, 0))]


def expert_options(cfg: ModelConfig, device_type: str) -> list[str | None]:
    """Where routed experts may go besides following the weight split (None): disk, and on a
    GPU host RAM (on a CPU, host RAM is the device)."""
    if cfg.moe is None:
        return [None]
    return [None, "disk"] + (["host"] if device_type != "cpu" else [])


def batch_shapes(batch: int) -> list[tuple[int, list[int]]]:
    """(gpu_batch_size, num_gpu_batches from most to fewest) with blocks of at most
    ``batch``: powers of two, and whatever covers the batch exactly."""
    def downto(n: int) -> list[int]:
        return sorted({n} | {2**i for i in range(n.bit_length()) if 2**i <= n}, reverse=True)

    return [(g, downto(batch // g)) for g in downto(batch)]


def over_budget(needs: dict[str, int], budgets: Budgets, device_type: str) -> dict[str, int]:
    """Bytes by which ``needs`` exceed each budget. On a CPU the device is host RAM: both
    count against the host budget (stricter than the executor, which checks each alone)."""
    used = {"device": needs["device"],
            "host": needs["host"] + (needs["device"] if device_type == "cpu" else 0)}
    return {t: used[t] - getattr(budgets, t) for t in used
            if getattr(budgets, t) is not None and used[t] > getattr(budgets, t)}


def _preference(e: Estimate) -> tuple:
    """Among equally fast plans: more on the device, less on disk, no compression, fewer
    micro-batches."""
    p = e.policy
    return (-float(f"{e.total_tok_s:.4g}"), 200 - p.weights[0] - p.cache[0],
            p.weight_split[2] + p.cache_split[2], p.compress_weights + p.compress_cache,
            p.cpu_attention, p.num_gpu_batches)


@dataclass
class SearchRequest:
    """What a search plans for: a model (``model``: its family, built from ``cfg`` when
    None), a compute dtype, a workload, a machine (its calibration and device type), the
    budgets, and what the search may choose. ``source`` (the checkpoint's tensors) lets
    matrices kept packed count as packed."""

    cfg: ModelConfig
    dtype: torch.dtype
    workload: Workload
    cal: Calibration
    device_type: str
    budgets: Budgets
    max_batch_size: int = 64
    allow_compression: bool = True
    bits: tuple[int, ...] = (4,)
    model: ModelFamily | None = None
    source: WeightSource | None = None
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK  # the LLM's prefill_chunk_size


@dataclass
class Found:
    fits: list[Estimate]
    closest: tuple[int, Policy, dict[str, int]] | None = None  # least over budget


def search(request: SearchRequest) -> Found:
    """Every searched policy that fits, fastest first, and the one closest to fitting."""
    r = request
    cfg, dtype, workload, cal, device_type, budgets = (r.cfg, r.dtype, r.workload, r.cal,
                                                        r.device_type, r.budgets)
    max_batch_size, source = r.max_batch_size, r.source
    model = r.model or build_model(cfg)
    p, g, batch = workload.prompt_len, workload.gen_len, workload.batch
    packs = [(False, False, 4)] + [(w, c, b) for b in r.bits if r.allow_compression
                                   for w, c in ((True, False), (False, True), (True, True))]
    found = Found([])

    def largest_block(policy: Policy, size: int, counts: list[int],
                      placed: PlacedWeights) -> Estimate | None:
        """The most micro-batches of ``size`` rows per block that fit (they share each trip
        of the weights), with their estimate."""
        for n in counts:
            policy = replace(policy, gpu_batch_size=size, num_gpu_batches=n)
            shapes = [(rows, p + g) for rows in blocks(policy, batch, max_batch_size)[0]]

            fixed = block_needs(placed.plan, cfg, dtype, policy, shapes, 0)

            def needs_at(tokens: int) -> dict[str, int]:
                return add(fixed, step_needs(cfg, dtype, policy, shapes, tokens, device_type))

            # the executor's own cut of the prefill chunk (Executor.step_tokens)
            chunk = max(1, largest_step(lambda t: budgets.fits(needs_at(t)),
                                        prefill_chunk(r.prefill_chunk, p)))
            needs = needs_at(chunk)
            over = sum(over_budget(needs, budgets, device_type).values())
            if not over:
                return estimate(cfg, dtype, policy, workload, cal, device_type, max_batch_size,
                                placed, chunk)
            if found.closest is None or over < found.closest[0]:
                found.closest = (over, policy, needs)
        return None

    seen: set[str] = set()  # placements already searched (a tensor goes whole to one tier)
    for weights, experts in [(w, e) for w in weight_splits(device_type)
                             for e in expert_options(cfg, device_type)]:
        placements: dict[tuple[bool, int], PlacedWeights] = {}
        for cw, cc, b in packs:
            base = Policy(weights=weights, compress_weights=cw, compress_cache=cc, compress_bits=b,
                          experts=experts)
            if (cw, b * cw) not in placements:
                placements[cw, b * cw] = PlacedWeights.make(cfg, dtype, base, device_type, model,
                                                                    source)
            placed = placements[cw, b * cw]
            if (key := f"{placed.plan.tiers} {cw} {cc} {b}") in seen:
                continue
            seen.add(key)
            for cache in cache_options(device_type):
                if cc and cache.get("cpu_attention"):
                    continue  # a compressed cache is unpacked on the device
                for size, counts in batch_shapes(batch):
                    e = largest_block(replace(base, **cache), size, counts, placed)
                    if e is not None:
                        found.fits.append(e)
                        if size * e.policy.num_gpu_batches >= batch:
                            break  # one block holds the batch: smaller micro-batches only cost
    found.fits.sort(key=_preference)
    return found


def plan(cfg: ModelConfig, dtype: torch.dtype, workload: Workload, cal: Calibration,
         device_type: str, budgets: Budgets, max_batch_size: int = 64,
         allow_compression: bool = True, bits: tuple[int, ...] = (4,),
         model_family: ModelFamily | None = None, source=None) -> list[Estimate]:
    """Every searched policy that fits ``budgets``, fastest first (see ``weight_splits``,
    ``cache_options``, ``batch_shapes``: for each placement, the largest block that fits for
    each micro-batch size; compression of weights and/or cache at each of ``bits``).
    ``source`` (the checkpoint's tensors) lets matrices kept packed count as packed."""
    return search(SearchRequest(cfg, dtype, workload, cal, device_type, budgets, max_batch_size,
                                allow_compression, bits, model_family, source)).fits


def choose_policy(cfg: ModelConfig, dtype: torch.dtype, workload: Workload, cal: Calibration,
                  device_type: str, budgets: Budgets, max_batch_size: int = 64,
                  allow_compression: bool = True, bits: tuple[int, ...] = (4,),
                  model_family: ModelFamily | None = None, source=None,
                  prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK) -> tuple[Policy, Estimate]:
    """The fastest policy that fits, or a TiergenError saying what is missing."""
    request = SearchRequest(cfg, dtype, workload, cal, device_type, budgets, max_batch_size,
                            allow_compression, bits, model_family, source, prefill_chunk)
    found = search(request)
    if not found.fits:
        raise nothing_fits(found, request)
    return found.fits[0].policy, found.fits[0]


def nothing_fits(found: Found, request: SearchRequest) -> TiergenError:
    """The error for a search that found no plan: how far the closest one was over."""
    workload, budgets = request.workload, request.budgets
    _, policy, needs = found.closest
    excess = over_budget(needs, budgets, request.device_type)
    need = {t: getattr(budgets, t) + n for t, n in excess.items()}
    short = " and ".join(f"{fmt(need[t])} of {t} memory (budget {fmt(getattr(budgets, t))})"
                         for t in excess)
    fixes = [f"raise --{t}-memory to at least {fmt(need[t])}" for t in excess]
    fixes += ["allow compression (drop --no-compression)"] * (not request.allow_compression)
    return TiergenError(
        f"no offloading policy fits {workload.batch} prompt(s) of {workload.prompt_len} + "
        f"{workload.gen_len} tokens in the memory budgets, even with weights and KV cache on "
        f"disk: the smallest plan found ({policy_flags(policy)}) needs {short}; "
        f"{', '.join(fixes)}, or use shorter prompts or fewer generated tokens")


def policy_flags(p: Policy) -> str:
    """The policy as ``tiergen generate`` flags."""
    flags = ["--percent", *(f"{x:g}" for x in (*p.weights, *p.cache, *p.hidden))]
    if p.gpu_batch_size:
        flags += ["--gpu-batch-size", str(p.gpu_batch_size)]
    flags += ["--num-gpu-batches", str(p.num_gpu_batches)]
    flags += ["--cpu-attention"] * p.cpu_attention + ["--compress-weights"] * p.compress_weights
    flags += ["--compress-cache"] * p.compress_cache
    if (p.compress_weights or p.compress_cache) and p.compress_bits != 4:
        flags += ["--compress-bits", str(p.compress_bits)]
    if p.experts:
        flags += ["--experts", p.experts]
    return " ".join(flags)


def kv_cache_line(cfg: ModelConfig, dtype: torch.dtype) -> str:
    """KV cache bytes one token adds, and the attention variant that makes it so."""
    _, heads, width = cfg.kv_layout()
    if cfg.mla is not None:
        kind = (f"MLA latent: {cfg.mla.kv_lora_rank} + {cfg.mla.qk_rope_head_dim} RoPE numbers "
                f"per layer for {cfg.num_heads} heads")
        if cfg.mla.index_heads:
            kind += (f", and the sparse-attention indexer's key of {cfg.mla.index_head_dim}; "
                     f"each query reads its {cfg.mla.index_topk} best latent rows")
    elif heads == cfg.num_heads:
        kind = f"MHA: K and V of {heads} heads x {width}"
    else:
        kind = (f"{'MQA' if heads == 1 else 'GQA'}: K and V of {heads} KV head(s) x {width} "
                f"for {cfg.num_heads} query heads")
    windows = [w for w in map(cfg.window, range(cfg.num_layers)) if w]
    if windows:
        kind += (f"; rolling window {max(windows)} on {len(windows)} of {cfg.num_layers} "
                 f"layers, which never hold more than {max(windows)} tokens")
    return (f"{fmt(cfg.kv_bytes_per_token(dtype.itemsize))} per token "
            f"({kind}; {cfg.num_layers} layers, {str(dtype).removeprefix('torch.')})")


def format_plan(estimate: Estimate, cfg: ModelConfig, dtype: torch.dtype) -> str:
    """The plan as a user reads it: flags, memory per tier, predicted speed, what binds."""
    e, w = estimate, estimate.workload
    memory = ", ".join(f"{t} {fmt(n)}" for t, n in e.memory.items())
    if e.device_type == "cpu":
        ram = e.memory["device"] + e.memory["host"]
        memory += f" (CPU: device and host are one RAM, {fmt(ram)})"
    parts = ", ".join(f"{k.replace('_', ' ')} {v * 1e3:.3g} ms" for k, v in e.per_layer.items())
    name = str(dtype).removeprefix("torch.")
    head = f"plan for {cfg.architecture}, {cfg.num_layers} layers, {name}"
    if w is not None:
        head += (f" on {e.device_type}: {w.batch} prompt(s) of {w.prompt_len} tokens, "
                 f"{w.gen_len} generated each")
    return "\n".join([
        head,
        f"  flags      {policy_flags(e.policy)}",
        f"  memory     {memory}",
        (f"  predicted  prefill {e.prefill_tok_s:.1f} tok/s, decode {e.decode_tok_s:.1f} "
         f"tok/s, total {e.total_tok_s:.1f} generated tok/s"),
        f"  per layer  (one decode step) {parts}: {e.binds.replace('_', ' ')} binds",
        f"  KV cache   {kv_cache_line(cfg, dtype)}"])
