"""The compute device and dtype a run uses, from what a caller or the command line asked."""

from __future__ import annotations

import torch

from tiergen._platform import cpu_has_fast_bfloat16
from tiergen.errors import TiergenError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATIONS = ("auto", "float32", "int8", "int16")


def cpu_auto_dtype(checkpoint: torch.dtype | None, fast_bfloat16: bool) -> torch.dtype:
    """``dtype="auto"`` on a CPU. Fast (native) bfloat16 halves the bytes read per token and
    more than doubles batched matmul throughput. Without it a bfloat16 checkpoint still stays
    bfloat16 (half the bytes to hold and stream; ``linear`` multiplies many rows widened to
    float32), and others run in float32."""
    return torch.bfloat16 if fast_bfloat16 or checkpoint == torch.bfloat16 else torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: torch.device,
                  checkpoint: torch.dtype | None, packed: bool = False) -> torch.dtype:
    """The compute dtype a model runs in: ``dtype`` as given, or for "auto" the one that
    suits ``device`` and the checkpoint's own dtype. On a CPU a model whose matrices stay
    packed runs in float32: its products take float32 (or integer) activations either way,
    and bfloat16 between them would only round."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32 if packed else cpu_auto_dtype(checkpoint, cpu_has_fast_bfloat16())
        return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in DTYPES:
        raise TiergenError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_activations(activations: str, device: torch.device) -> str:
    """How products with packed (quantised) weights treat their activations: "float32" (the
    float path, decode-then-multiply), "int8" or "int16" (quantised per row to 8 or 16 bits
    and multiplied by the integer kernels, on a CPU), or "auto": int8 on a CPU, float32
    elsewhere."""
    if activations not in ACTIVATIONS:
        raise TiergenError(f"unknown activations {activations!r}; choose one of "
                           f"{', '.join(ACTIVATIONS)}")
    if activations == "auto":
        return "int8" if device.type == "cpu" else "float32"
    return activations


def resolve_device(device: str | None) -> torch.device:
    """The compute device: ``device`` ("cpu", "cuda", "cuda:N"), or CUDA when present."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise TiergenError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TiergenError(f"device {device!r} asked for, but torch sees no CUDA GPU; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise TiergenError(f"device type {dev.type!r} is not supported; use cpu or cuda")
    return dev
