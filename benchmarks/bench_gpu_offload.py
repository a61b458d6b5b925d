"""FlexGen's question on one GPU held to 8 GiB: a Llama-3.1-8B-shaped model (random bfloat16
weights, 16 GB of safetensors, written here to local disk), 256 prompts of 512 tokens, 32 new
tokens each, greedy, EOS ignored; throughput = generated tokens / the whole run, prefill
included.

Engines, each in its own process with ``torch.cuda.set_per_process_memory_fraction`` holding
it to the cap:

- ``tiergen``: its own plan, ``choose_policy`` under the device budget (as ``--policy auto``
  makes it), run with ``device_memory`` set to the same budget;
- ``accelerate``: transformers with ``device_map="auto"`` and ``max_memory`` (half the cap on
  the GPU, leaving the rest to activations), at the largest batch of ``--accelerate-batches``
  that runs; it runs one batch of prompts, whose throughput stands for the whole workload.

Beside each run: the link bound, the bytes of weights streamed per pass (those not kept on the
GPU) / the measured pinned host-to-device rate, times the passes (one per block per prefill
chunk and per decode step). One JSON line per run goes to ``--json``; a table to stdout.

    python benchmarks/bench_gpu_offload.py                     # on a GPU: at most 6 minutes
    python benchmarks/bench_gpu_offload.py --tiny              # tiny shapes on a CPU, seconds

It needs torch, transformers, accelerate and safetensors, nothing else.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                 max_position_embeddings=1024, tie_word_embeddings=False),
}


@dataclass
class Setup:
    """One workload on one machine: the shape, the prompts, the cap and where things go."""

    shape: str = "8b"
    prompts: int = 256
    prompt_len: int = 512
    new_tokens: int = 32
    cap: int = 8 << 30  # bytes of device memory every engine may use
    device: str = "cuda"
    dtype: str = "bfloat16"
    directory: str = "/tmp/tiergen-offload-bench"
    accelerate_batches: list[int] = field(default_factory=lambda: [16, 8])
    timeout: dict[str, int] = field(default_factory=lambda: {"tiergen": 200, "accelerate": 100})


TINY = dict(shape="tiny", prompts=16, prompt_len=64, new_tokens=8, cap=3 << 20, device="cpu",
            dtype="float32", accelerate_batches=[8, 4], timeout={"tiergen": 120,
                                                               "accelerate": 120})


def write_checkpoint(s: Setup) -> Path:
    """A Llama checkpoint of random weights in s.dtype, one safetensors shard per few layers
    (made on the GPU where there is one: fast), with its config and index."""
    import torch
    import transformers
    from safetensors.torch import save_file

    out = Path(s.directory) / s.shape
    if (out / "model.safetensors.index.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = SHAPES[s.shape]
    transformers.LlamaConfig(**cfg, torch_dtype=s.dtype,
                             architectures=["LlamaForCausalLM"]).save_pretrained(out)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
             "mlp.down_proj.weight": (h, i), "input_layernorm.weight": (h,),
             "post_attention_layernorm.weight": (h,)}
    groups = [{"model.embed_tokens.weight": (v, h)}]
    for j in range(0, cfg["num_hidden_layers"], 4):
        groups.append({f"model.layers.{n}.{k}": shape for n in range(j, min(
            j + 4, cfg["num_hidden_layers"])) for k, shape in layer.items()})
    groups.append({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    gen = torch.Generator(s.device).manual_seed(0)
    weight_map = {}
    for g, names in enumerate(groups):
        shard = f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in names.items():
            t = torch.empty(shape, dtype=getattr(torch, s.dtype), device=s.device)
            t.normal_(1.0 if len(shape) == 1 else 0.0, 0.02, generator=gen)
            tensors[name] = t.cpu()
            weight_map[name] = shard
        save_file(tensors, out / shard, metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                  "weight_map": weight_map}))
    return out


def pinned_rate(device: str) -> float | None:
    """Bytes/s of pinned host-to-device copies (1 GiB, best of 5), or None on a CPU."""
    import torch

    if device != "cuda":
        return None
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    best = 0.0
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, host.numel() / (start.elapsed_time(end) / 1e3))
    return best


def prompts(s: Setup, n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[s.shape]["vocab_size"]
    return torch.randint(10, vocab - 10, (n, s.prompt_len), generator=g).tolist()


def hold_to_cap(s: Setup) -> None:
    import torch

    if s.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, s.cap / total))
        torch.cuda.reset_peak_memory_stats()


def peak(s: Setup) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if s.device == "cuda" else None


def run_tiergen(s: Setup, model: Path) -> dict:
    """tiergen under its own plan; the bytes it streams per pass and its passes."""
    import torch

    from tiergen import LLM, SamplingParams
    from tiergen.engine.generate import chunks, prefill_chunk
    from tiergen.offload.memory import Budgets, available_ram
    from tiergen.planner import calibrate
    from tiergen.planner.cost import Workload, blocks
    from tiergen.planner.search import choose_policy, policy_flags
    from tiergen.weights import open_model

    hold_to_cap(s)
    files, dtype, device = open_model(model), getattr(torch, s.dtype), torch.device(s.device)
    budgets = Budgets(s.cap, available_ram()).for_tensors(device.type)
    policy, est = choose_policy(files.config, dtype, Workload(s.prompt_len, s.new_tokens,
                                s.prompts), calibrate.get(device), device.type, budgets,
                                max_batch_size=s.prompts, source=files.source)
    policy.offload_dir = Path(s.directory) / "offload"
    llm = LLM(model, dtype=s.dtype, device=s.device, policy=policy, device_memory=s.cap,
              max_batch_size=s.prompts)
    ps = prompts(s, s.prompts)
    llm.generate(ps[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    t = time.perf_counter()
    out = llm.generate(ps, SamplingParams(max_tokens=s.new_tokens, temperature=0,
                                          ignore_eos=True))
    seconds = time.perf_counter() - t
    needs = llm.executor.weight_plan.needs()
    streamed = needs["disk"] + (needs["host"] if s.device == "cuda" else 0)
    cut = blocks(policy, s.prompts, s.prompts)
    chunk = llm.executor.step_tokens([(r, s.prompt_len + s.new_tokens) for r in cut[0]],
                                     prefill_chunk(llm.prefill_chunk_size, s.prompt_len))
    passes = len(cut) * (len(chunks(chunk, s.prompt_len)) + s.new_tokens - 1)
    stats = llm.last_stats
    return dict(prompts=s.prompts, tokens=sum(len(r.token_ids) for r in out), seconds=seconds,
                prefill_s=stats.prefill_seconds, decode_s=stats.decode_seconds,
                peak_device=peak(s), streamed_per_pass=streamed, passes=passes,
                setting=f"{policy_flags(policy)}; prefill chunk {chunk}",
                predicted_tok_s=est.total_tok_s)


def run_accelerate(s: Setup, model: Path, batch: int) -> dict:
    """One batch through transformers with accelerate's device_map="auto" under the cap."""
    import torch
    import transformers

    hold_to_cap(s)
    memory = ({0: s.cap // 2, "cpu": 200 << 30} if s.device == "cuda"
              else {"cpu": s.cap})  # on a CPU: the rest on disk
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, s.dtype), device_map="auto", max_memory=memory,
        offload_folder=str(Path(s.directory) / "accelerate-offload"))
    streamed = sum(p.numel() * p.element_size() for n, p in hf.named_parameters()
                   if p.device.type != s.device or p.device.type == "meta")
    ids = torch.tensor(prompts(s, batch), device=s.device)
    mask, greedy = torch.ones_like(ids), dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        t = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=s.new_tokens,
                          min_new_tokens=s.new_tokens, **greedy)
        if s.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    return dict(prompts=batch, tokens=(out.shape[1] - s.prompt_len) * batch, seconds=seconds,
                peak_device=peak(s), streamed_per_pass=streamed, passes=s.new_tokens,
                setting=f"device_map=auto, max_memory {memory}, batch {batch}")


@dataclass
class Row:
    """One run as the JSON line and the table show it."""

    engine: str
    workload: str
    tok_s: float | None = None
    link_bound_s: float | None = None
    share_of_bound: float | None = None
    result: dict = field(default_factory=dict)
    error: str | None = None


def child(s: Setup, engine: str, batch: int) -> None:
    model = Path(s.directory) / s.shape
    result = (run_tiergen(s, model) if engine == "tiergen" else
              run_accelerate(s, model, batch))
    print(json.dumps(result))


def spawn(s: Setup, engine: str, batch: int, rate: float | None) -> Row:
    """Run one engine in its own process; its result with the link bound beside it."""
    workload = f"{s.shape} {s.prompts}x{s.prompt_len}+{s.new_tokens}"
    row = Row(engine, workload)
    cmd = [sys.executable, __file__, "--child", engine, str(batch), json.dumps(asdict(s))]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=s.timeout[engine])
    except subprocess.TimeoutExpired:
        row.error = f"over its {s.timeout[engine]} s"
        return row
    if out.returncode:
        row.error = out.stderr.strip().splitlines()[-1][-300:] if out.stderr.strip() else "failed"
        return row
    r = row.result = json.loads(out.stdout.strip().splitlines()[-1])
    row.tok_s = r["tokens"] / r["seconds"]
    if rate:
        row.link_bound_s = r["streamed_per_pass"] * r["passes"] / rate
        row.share_of_bound = row.link_bound_s / r["seconds"] if row.link_bound_s else None
    return row


def table(rows: list[Row]) -> str:
    lines = ["| workload | engine | tok/s | seconds | link bound s | share of bound | peak GiB "
             "| setting |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.error:
            lines.append(f"| {r.workload} | {r.engine} | failed: {r.error} | | | | | |")
            continue
        x = r.result
        bound = "-" if r.link_bound_s is None else f"{r.link_bound_s:.1f}"
        share = "-" if r.share_of_bound is None else f"{100 * r.share_of_bound:.0f} %"
        gib = "-" if x["peak_device"] is None else f"{x['peak_device'] / 2**30:.2f}"
        lines.append(f"| {r.workload} | {r.engine} | {r.tok_s:.1f} | {x['seconds']:.1f} "
                     f"| {bound} | {share} | {gib} | {x['setting']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes on a CPU: the whole path")
    p.add_argument("--dir", default=None, help="where the checkpoint and offloads go")
    p.add_argument("--json", default="bench_gpu_offload.jsonl", help="one line per run")
    p.add_argument("--engines", default="tiergen,accelerate")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(Setup(**json.loads(args.child[2])), args.child[0], int(args.child[1]))
        return
    s = Setup(**TINY) if args.tiny else Setup()
    s.directory = args.dir or s.directory
    t0 = time.perf_counter()
    write_checkpoint(s)
    rate = pinned_rate(s.device)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s; pinned host-to-device "
          + ("-" if rate is None else f"{rate / 1e9:.1f} GB/s"), flush=True)
    rows = []
    for engine in args.engines.split(","):
        for batch in s.accelerate_batches if engine == "accelerate" else [s.prompts]:
            row = spawn(s, engine, batch, rate)
            rows.append(row)
            with open(args.json, "a") as f:
                f.write(json.dumps(asdict(row) | {"pinned_rate": rate}) + "\n")
            print(table([row]).splitlines()[-1], flush=True)
            if row.error is None:
                break  # accelerate: the largest batch that runs
    print(table(rows))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
