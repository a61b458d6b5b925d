"""Attention: KV bytes per second that CPU decode attention scans, and FLOP/s of a prompt's
attention as tiergen runs it."""

from __future__ import annotations

import math

import torch

from tiergen.cache.attention import attention
from tiergen.kernels import rows_on_amx
from tiergen.planner.calibrate.timing import cpu_seconds, seconds


ATTENTION = (8, 8, 8, 2048, 64)  # (B, H, KVH, S, D): q (B, H, 1, D), K/V (B, KVH, S, D)
ATTENTION_BYTES = 256 * 2**20  # KV caches cycled per run (one per layer, as in decode)
PROMPT_ATTENTION = (8, 2, 1024, 64)  # (H, KVH, T, D): one prompt of T tokens, causal


def measure_cpu_attention() -> float:
    """KV bytes/s of decode attention as tiergen runs it on the CPU (cache.attention.attention,
    T == 1): query heads folded per KV head into one batched matmul, softmax, matmul by V."""
    b, h, kvh, s, d = ATTENTION
    q = torch.randn(b, h, 1, d)
    k = torch.randn(b, kvh, s, d)
    v = torch.randn(b, kvh, s, d)
    count = max(1, math.ceil(ATTENTION_BYTES / (k.nbytes + v.nbytes)))
    caches = [(k, v)] + [(k.clone(), v.clone()) for _ in range(count - 1)]  # like layers

    def run() -> None:
        for kc, vc in caches:
            scores = torch.matmul(q.view(b, kvh, h // kvh, d), kc.transpose(-1, -2)) * d**-0.5
            torch.matmul(torch.softmax(scores, dim=-1), vc)

    return count * (k.nbytes + v.nbytes) / cpu_seconds(run)


def measure_prompt_attention(dev: torch.device, dtype: torch.dtype, amx: bool = False) -> float:
    """FLOP/s of one prompt's causal attention as tiergen runs it (cache.attention.attention;
    on a CPU with AMX, bfloat16 queries on the tiles). ``amx``: the integer path's long
    prompt, whose float32 attention goes to the tiles too."""
    h, kvh, t, d = PROMPT_ATTENTION
    q = torch.randn(1, h, t, d, device=dev).to(dtype)
    k, v = (torch.randn(1, kvh, t, d, device=dev).to(dtype) for _ in range(2))
    with rows_on_amx(torch.ones(1, dtype=torch.bool) if amx else None):
        took = seconds(lambda: attention(q, k, v, None), dev, quick=True)
    return 4 * h * d * t * (t + 1) / 2 / took
