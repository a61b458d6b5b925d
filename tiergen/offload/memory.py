"""Memory per tier: what a policy needs (exact byte counts, before any work starts), the
budgets it must fit, and what the process really used."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiergen.errors import TiergenError
from tiergen.offload.policy import TIERS

Bytes = dict[str, int]


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
