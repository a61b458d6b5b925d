"""Search the offloading policies that fit the memory budgets for the fastest one, and the
``tiergen plan`` command that prints it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

import torch

from tiergen.config import ModelConfig
from tiergen.engine.executor import block_needs
from tiergen.errors import TiergenError
from tiergen.models import build_model
from tiergen.models.base import ModelFamily
from tiergen.offload.memory import Budgets, fmt
from tiergen.offload.policy import Policy
from tiergen.planner import paper
from tiergen.planner.calibrate import Calibration
from tiergen.planner.cost import Estimate, PlacedWeights, Workload, blocks, estimate


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
class _Found:
    fits: list[Estimate]
    closest: tuple[int, Policy, dict[str, int]] | None = None  # least over budget


def _search(cfg: ModelConfig, dtype: torch.dtype, workload: Workload, cal: Calibration,
            device_type: str, budgets: Budgets, max_batch_size: int, allow_compression: bool,
            bits: tuple[int, ...], model: ModelFamily | None, source=None) -> _Found:
    model = model or build_model(cfg)
    p, g, batch = workload.prompt_len, workload.gen_len, workload.batch
    packs = [(False, False, 4)] + [(w, c, b) for b in bits if allow_compression
                                   for w, c in ((True, False), (False, True), (True, True))]
    found = _Found([])

    def largest_block(policy: Policy, size: int, counts: list[int],
                      placed: PlacedWeights) -> Estimate | None:
        """The most micro-batches of ``size`` rows per block that fit (they share each trip
        of the weights), with their estimate."""
        for n in counts:
            policy = replace(policy, gpu_batch_size=size, num_gpu_batches=n)
            rows = blocks(policy, batch, max_batch_size)[0]
            needs = block_needs(placed.plan, cfg, dtype, policy, [(r, p + g) for r in rows], p)
            over = sum(over_budget(needs, budgets, device_type).values())
            if not over:
                return estimate(cfg, dtype, policy, workload, cal, device_type, max_batch_size,
                                placed)
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
    return _search(cfg, dtype, workload, cal, device_type, budgets, max_batch_size,
                   allow_compression, bits, model_family, source).fits


def choose_policy(cfg: ModelConfig, dtype: torch.dtype, workload: Workload, cal: Calibration,
                  device_type: str, budgets: Budgets, max_batch_size: int = 64,
                  allow_compression: bool = True, bits: tuple[int, ...] = (4,),
                  model_family: ModelFamily | None = None, source=None
                  ) -> tuple[Policy, Estimate]:
    """The fastest policy that fits, or a TiergenError saying what is missing."""
    found = _search(cfg, dtype, workload, cal, device_type, budgets, max_batch_size,
                    allow_compression, bits, model_family, source)
    if not found.fits:
        raise _nothing_fits(found, workload, budgets, device_type, allow_compression)
    return found.fits[0].policy, found.fits[0]


def _nothing_fits(found: _Found, workload: Workload, budgets: Budgets, device_type: str,
                  allow_compression: bool) -> TiergenError:
    _, policy, needs = found.closest
    excess = over_budget(needs, budgets, device_type)
    need = {t: getattr(budgets, t) + n for t, n in excess.items()}
    short = " and ".join(f"{fmt(need[t])} of {t} memory (budget {fmt(getattr(budgets, t))})"
                         for t in excess)
    fixes = [f"raise --{t}-memory to at least {fmt(need[t])}" for t in excess]
    fixes += ["allow compression (drop --no-compression)"] * (not allow_compression)
    return TiergenError(
        f"no offloading policy fits {workload.batch} prompt(s) of {workload.prompt_len} + "
        f"{workload.gen_len} tokens in the memory budgets, even with weights and KV cache on "
        f"disk: the smallest plan found ({policy_flags(policy)}) needs {short}; "
        f"{', '.join(fixes)}, or use shorter prompts or fewer generated tokens")


def policy_flags(p: Policy) -> str:
    """The policy as ``tiergen generate`` flags."""
    flags = ["--percent", *(f"{x:g}" for x in (*p.weights, *p.cache, *p.activations))]
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


# ----------------------------------------------------------------------------- CLI


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


def main(args: argparse.Namespace) -> int:
    """``tiergen plan``: the fastest policy for a workload under the memory budgets, for the
    model and machine here, or on paper (``--config``, ``--machine``)."""
    for name in ("prompt_len", "gen_len", "batch", "top", "pipeline_parallel",
                 "tensor_parallel"):
        if getattr(args, name) < 1:
            raise TiergenError(f"--{name.replace('_', '-')} must be a positive integer, "
                               f"got {getattr(args, name)}")
    if args.config:
        (cfg, checkpoint_dtype), source = paper.load_config(args.config), None
    else:
        from tiergen.weights import open_model

        files = open_model(args.model, packed=not getattr(args, "dequantize", False))
        cfg, checkpoint_dtype, source = files.config, files.default_dtype, files.source
    workload = Workload(args.prompt_len, args.gen_len, args.batch)
    if workload.prompt_len + workload.gen_len > cfg.context_length:
        raise TiergenError(f"--prompt-len {workload.prompt_len} plus --gen-len "
                           f"{workload.gen_len} exceeds the model's context of "
                           f"{cfg.context_length} tokens")
    cal, budgets, dtype = _machine(args, checkpoint_dtype)
    device_type = cal.device_type
    compress = not args.no_compression
    stages, tensor = args.pipeline_parallel, args.tensor_parallel
    if stages * tensor > 1:
        from tiergen.planner.parallel import format_parallel, plan_parallel, with_link

        if args.host_memory is None and budgets.host is not None:  # ranks share the RAM
            budgets = Budgets(budgets.device, budgets.host // (stages * tensor))
        e = plan_parallel(cfg, dtype, workload, cal if args.machine else with_link(cal, True),
                          budgets, stages, tensor, allow_compression=compress, source=source)
        print(format_parallel(e, cfg, dtype))
        return 0
    found = _search(cfg, dtype, workload, cal, device_type, budgets, 64, compress, (4,), None,
                    source)
    if not found.fits:
        raise _nothing_fits(found, workload, budgets, device_type, compress)
    print(format_plan(found.fits[0], cfg, dtype))
    for e in found.fits[1:args.top]:
        print(f"  or         {policy_flags(e.policy)}: {e.total_tok_s:.1f} tok/s, "
              + ", ".join(f"{t} {fmt(n)}" for t, n in e.memory.items()))
    return 0


def _machine(args: argparse.Namespace, checkpoint_dtype: torch.dtype | None
             ) -> tuple[Calibration, Budgets, torch.dtype]:
    """The calibration, budgets and compute dtype of the plan: a machine profile's, or this
    machine's (measured now if it was never calibrated)."""
    from tiergen.offload.policy import parse_size

    def budget(text: str | None, default: int | None) -> int | None:
        return parse_size(text) if text else default

    if args.machine:
        m = paper.load_machine(args.machine)
        if args.device:
            raise TiergenError("--device and --machine exclude each other: the profile says "
                               f"which device it describes ({m.calibration.device})")
        dtype = (paper.default_dtype(m.calibration, checkpoint_dtype) if args.dtype == "auto"
                 else getattr(torch, args.dtype))
        print(f"machine: {m.name}" + (f" ({m.note})" if m.note else ""))
        return (m.calibration, Budgets(budget(args.device_memory, m.budgets.device),
                                       budget(args.host_memory, m.budgets.host)), dtype)
    from tiergen.engine.llm import _resolve_device, _resolve_dtype
    from tiergen.planner import calibrate

    device = _resolve_device(args.device)
    dtype = _resolve_dtype(args.dtype, device, checkpoint_dtype)
    gpu = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    cal = calibrate.load(device)
    if cal is None:
        print(f"tiergen: note: {device} is not calibrated yet; measuring it now (saved for "
              "next time, or run tiergen calibrate)", file=sys.stderr)
        cal = calibrate.get(device, progress=True)
    return cal, Budgets(budget(args.device_memory, gpu),
                        budget(args.host_memory, available_ram())), dtype


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the ``tiergen`` command's subparsers (``func`` = ``main``)."""
    p = sub.add_parser(
        "plan", help="choose the fastest offloading policy that fits the memory budgets",
        description="Search offloading policies (weights, KV cache and activations over device, "
                    "host RAM and disk; micro-batch and block sizes; compression) for a workload, "
                    "predict each one's memory and speed from this machine's calibration, and "
                    "print the fastest that fits as tiergen generate flags.")
    p.add_argument("-m", "--model", default="smollm2",
                   help="short name (smollm2), a model directory or a .gguf file "
                        "(default: smollm2)")
    p.add_argument("--config", metavar="CONFIG",
                   help="plan on paper for a model's Hugging Face config.json instead of --model "
                        "(no weights needed), or a shipped one: " + ", ".join(paper.names(paper.CONFIGS)))
    p.add_argument("--machine", metavar="PROFILE",
                   help="plan for another machine: a profile JSON (tiergen calibrate's output, "
                        "or the same fields by hand) or a shipped one: "
                        + ", ".join(paper.names(paper.MACHINES)))
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default: 512)")
    p.add_argument("--gen-len", type=int, default=128,
                   help="tokens generated per prompt (default: 128)")
    p.add_argument("--batch", type=int, default=1, help="number of prompts (default: 1)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="device budget, e.g. 8G (default: the GPU's memory; none on a CPU)")
    p.add_argument("--host-memory", default=None, metavar="SIZE",
                   help="host RAM budget, e.g. 16G (default: the RAM available now, or the "
                        "profile's under --machine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: auto, as tiergen generate picks it)")
    p.add_argument("--device", default=None,
                   help="compute device, e.g. cpu or cuda (default: cuda if present, else cpu)")
    p.add_argument("--no-compression", action="store_true",
                   help="consider only uncompressed weights and KV cache")
    p.add_argument("--pipeline-parallel", type=int, default=1, metavar="P",
                   help="plan P pipeline stages, each a process with its span of layers, its "
                        "share of the cores and its own budgets (default: 1)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                   help="plan T tensor-parallel shards per stage (default: 1)")
    p.add_argument("--top", type=int, default=1, metavar="N",
                   help="also show the next best plans, N in all (default: 1)")
    p.set_defaults(func=main)
