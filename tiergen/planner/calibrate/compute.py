"""Compute: matmuls at large and few-row shapes (dense and GGML-packed), 4-bit unpacking,
and the dispatch cost of one decoder layer call."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from tiergen.cache.kv import KVView
from tiergen.cache.step import StepMeta
from tiergen.calibration import ONE_THREAD
from tiergen.config import ModelConfig
from tiergen.devices import resolve_activations
from tiergen.kernels import AMX_PROMPT, activations_set, amx_prompt, rows_on_amx
from tiergen.models import layers
from tiergen.models.llama import Llama
from tiergen.offload.compress import decompress, decompress_rows, compress, compress_rows
from tiergen.planner.calibrate.timing import seconds
from tiergen.weights.packed import Packed
from tiergen.weights.quant import GGMLType


GEMM = (256, 1024, 4096)  # (M, K, N): (M, K) @ (K, N)
GEMV = (2048, 8192)  # (K, N): (1, K) @ (K, N)
GEMV_BYTES = 256 * 2**20  # weights cycled per gemv run: more than any L2/L3, so it hits RAM
LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64, 256)  # rows of the (rows, K) @ (K, N) products timed
LINEAR_BYTES = 64 * 2**20  # weights cycled at the few-row counts (those read weights)
AMX_ROWS = (32, 128, 256, 512)  # prompt rows timed on AMX tiles, where a long prompt's go


def matmul_dtypes(dev: torch.device) -> list[torch.dtype]:
    """The dtypes worth measuring on ``dev``.

    On a CPU: float32 and bfloat16 (natively where the CPU has it, else as ``linear`` runs it:
    widened to float32 from a few rows on). float16 is left out on CPUs: tiergen never picks
    it there, and PyTorch emulates it (hundreds of times slower than float32), so measuring it
    would take most of the calibration time. On CUDA: float32,
    float16, and bfloat16 where the GPU runs it natively (compute capability 8.0 and up, or
    ROCm), not where PyTorch would emulate it.
    """
    if dev.type == "cuda":
        out = [torch.float32, torch.float16]
        if torch.version.hip or torch.cuda.get_device_properties(dev).major >= 8:
            out.insert(1, torch.bfloat16)
        return out
    return [torch.float32, torch.bfloat16]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure_matmul(dev: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large product, as the model multiplies (``linear``)."""
    m, k, n = GEMM
    a = torch.randn(m, k, device=dev).to(dtype)
    w = torch.randn(n, k, device=dev).to(dtype)
    return 2 * m * k * n / seconds(lambda: layers.linear(a, w), dev)


def measure_gemv(dev: torch.device, dtype: torch.dtype) -> float:
    k, n = GEMV
    base = torch.randn(n, k, device=dev).to(dtype)
    count = max(1, math.ceil(GEMV_BYTES / base.nbytes))
    weights = [base] + [base.clone() for _ in range(count - 1)]
    x = torch.randn(1, k, device=dev).to(dtype)

    def run() -> None:
        for w in weights:
            layers.linear(x, w)

    return count * base.nbytes / seconds(run, dev)


def random_q4_0(n: int, k: int, dev: torch.device):
    """An (n, k) matrix of random GGML Q4_0 blocks (each: a float16 scale, 32 4-bit values)."""
    blocks = torch.randint(0, 256, (n * k // 32, 18), dtype=torch.uint8)
    blocks[:, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    return Packed(blocks.reshape(-1).to(dev), (n, k), ((GGMLType.Q4_0, n),))


def measure_linear_rows(dev: torch.device, dtype: torch.dtype, packed: bool = False,
                        amx: bool = False) -> dict[str, float]:
    """Weight parameters/s that tiergen's ``linear`` multiplies by (rows, 2048) inputs, for
    each row count of LINEAR_ROWS: few rows read the weights (cycled through more memory
    than the caches hold, as a model's layers are), many rows compute. Each kind of weight
    has its own steps between the two (bfloat16 without native support, packed blocks).
    ``amx``: packed products of a long prompt's rows, on AMX tiles, at AMX_ROWS instead."""
    k, n = GEMV
    first = random_q4_0(n, k, dev) if packed else torch.randn(n, k, device=dev).to(dtype)
    weights = [first] + [(replace(first, data=first.data.clone()) if packed else first.clone())
                         for _ in range(max(1, LINEAR_BYTES // first.nbytes) - 1)]
    out = {}
    for rows in AMX_ROWS if amx else LINEAR_ROWS:
        x = torch.randn(rows, k, device=dev).to(dtype)
        if amx:  # one prompt's rows, as a step gives them
            x = x[None]
        use = weights if rows < 32 else weights[:1]

        def run() -> None:
            for w in use:
                layers.linear(x, w)

        with rows_on_amx(torch.ones(1, dtype=torch.bool) if amx else None):
            out[str(rows)] = len(use) * n * k / seconds(run, dev, quick=True)
    return out


def products(dev: torch.device, dtype: torch.dtype, name: str) -> dict[str, dict[str, float]]:
    """linear_rows's tables for ``dtype``: dense and packed, with all threads and (on a CPU
    of several) with one. Packed products are measured as an LLM runs them by default
    (``activations="auto"``: the integer path on a CPU), and on a CPU on the float path too
    ("packed-exact-"); where a long prompt's rows take AMX tiles there, those too
    ("packed-amx-")."""
    out = {}
    threads = torch.get_num_threads()
    paths = [("packed-", resolve_activations("auto", dev))]
    if dev.type == "cpu":
        paths.append(("packed-exact-", "float32"))
    for suffix, n in [("", threads)] + [(ONE_THREAD, 1)] * (dev.type == "cpu" and threads > 1):
        torch.set_num_threads(n)
        try:
            out[name + suffix] = measure_linear_rows(dev, dtype)
            for prefix, kind in paths:
                with activations_set(kind):
                    out[f"{prefix}{name}{suffix}"] = measure_linear_rows(dev, dtype, packed=True)
                    if prefix == "packed-" and dtype == torch.float32 and amx_prompt(
                            AMX_PROMPT, kind):
                        out[f"packed-amx-{name}{suffix}"] = measure_linear_rows(
                            dev, dtype, packed=True, amx=True)
        finally:
            torch.set_num_threads(threads)
    return out


def measure_dequant(dev: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """Bytes/s of ``dtype`` output that unpacking 4-bit groups of 64 writes: for weight
    matrices the size of a small model's MLP, and for a KV cache's rows (a layer of 32
    sequences x 96 slots)."""
    q = compress(torch.randn(3072, 576, device=dev).to(dtype), 4, 64)
    out = torch.empty(3072, 576, device=dev, dtype=dtype)
    count = max(1, math.ceil(GEMV_BYTES / 8 / out.nbytes))
    rows = compress_rows(torch.randn(2, 32, 4, 96, 64, device=dev).to(dtype), 4, 64)

    def run() -> None:
        for _ in range(count):
            decompress(q, out)

    def run_rows() -> None:
        decompress_rows(rows, 64, 4, 64, dtype)

    return (count * out.nbytes / seconds(run, dev),
            2 * 32 * 4 * 96 * 64 * dtype.itemsize / seconds(run_rows, dev))


def measure_layer_overhead(dev: torch.device) -> float:
    """Seconds of one decode step through a decoder layer too small to cost anything but
    dispatch: the fixed price of every layer call of tiergen's Llama family."""
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, max_position=64)
    model = Llama(cfg)
    w = {n: torch.randn(shape, device=dev) for n, shape in model.fused_specs(0).items()}
    kv = torch.zeros(2, 1, 1, 16, 4, device=dev)
    valid = torch.ones(1, 16, dtype=torch.bool, device=dev)
    meta = StepMeta.build(valid, 8, 1)
    shared = model.prepare(meta, torch.float32)
    h = torch.randn(1, 1, 8, device=dev)

    def run() -> None:
        with torch.inference_mode():
            for _ in range(20):
                model.layer(0, w, h, meta, KVView(kv), shared)

    return seconds(run, dev) / 20
