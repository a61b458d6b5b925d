"""Attention: KV bytes per second that CPU decode attention scans."""

from __future__ import annotations

import math

import torch

from tiergen.planner.calibrate.timing import cpu_seconds


ATTENTION = (8, 8, 8, 2048, 64)  # (B, H, KVH, S, D): q (B, H, 1, D), K/V (B, KVH, S, D)
ATTENTION_BYTES = 256 * 2**20  # KV caches cycled per run (one per layer, as in decode)


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
