"""The offloading policy: what share of weights, KV cache and hidden states lives on each tier,
and how many sequences share each trip of a layer's weights over the slow link."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tiergen.errors import TiergenError

TIERS = ("device", "host", "disk")


def tier_at(percent: float, split: tuple[float, float, float]) -> str:
    """The tier of an item whose middle lies at ``percent`` of the whole: the first
    ``split[0]`` % goes to the device, the next ``split[1]`` % to host RAM, the rest to disk."""
    return "device" if percent < split[0] else "host" if percent < split[0] + split[1] else "disk"


def tiers_for(count: int, split: tuple[float, float, float]) -> list[str]:
    """Tiers of ``count`` equal items (layers of a cache, micro-batches of a block), in order."""
    return [tier_at(100 * (i + 0.5) / count, split) for i in range(count)]


def _split(name: str, pair: tuple[float, float]) -> tuple[float, float, float]:
    try:
        device, host = (float(x) for x in pair)
    except (TypeError, ValueError):
        raise TiergenError(f"policy: {name} must be a pair (device %, host %), got {pair!r}") from None
    if device < 0 or host < 0 or device + host > 100 + 1e-9:
        raise TiergenError(f"policy: {name} percentages must be >= 0 and add up to at most 100 "
                           f"(disk takes the rest), got device {device:g} + host {host:g}")
    return device, host, max(0.0, 100.0 - device - host)


@dataclass
class Policy:
    """Where things live. Percentages are (device, host); disk takes what they leave.

    ``experts`` puts the routed experts of mixture-of-experts layers on one tier ("device",
    "host" or "disk") whatever the weight percentages say; the other weights follow
    ``weights``. Experts off the device run where they are when few tokens chose them (see
    :mod:`tiergen.offload.experts`); from disk only the chosen experts are read, and
    ``expert_cache`` bytes of host RAM ("2G") keep those read for reuse, least recently used
    out first (None: half of what the host budget leaves after the weights; no cache without
    a budget).

    ``compress_weights`` / ``compress_cache`` store layer weight matrices / the KV cache
    quantised group-wise (``compress_bits`` 4 or 8, groups of ``compress_group_size``) on
    whatever tier holds them, dequantised on the compute device just before use.
    ``attn_sparsity`` < 1 keeps only that fraction of the largest attention weights of each
    decode query (and reads only the matching V rows).

    ``keep_tiles``: on a CPU with integer activations, packed weights that stay in host RAM
    keep the integer kernels' tiles (3/2 bytes a value) for decode steps whose products read
    tiles (three sequences or more; five or more for most types with AVX-512), built at the
    first such step, within half of what the host budget leaves after
    the weights (without a budget, half of the RAM available at load). A few rows otherwise
    decode every block again at every step.

    ``gpu_batch_size`` sequences run through a layer at once (a micro-batch);
    ``num_gpu_batches`` micro-batches form a *block* that shares one trip of each layer's
    weights, so weight traffic per token falls as the block grows. ``gpu_batch_size=None``
    makes the whole batch one micro-batch.
    """

    weights: tuple[float, float] = (100, 0)
    cache: tuple[float, float] = (100, 0)
    hidden: tuple[float, float] = (100, 0)  # the hidden states between layers (FlexGen's "activations")
    gpu_batch_size: int | None = None
    num_gpu_batches: int = 1
    pin_memory: bool = True
    cpu_attention: bool = False
    offload_dir: str | Path | None = None
    experts: str | None = None
    expert_cache: int | str | None = None
    compress_weights: bool = False
    compress_cache: bool = False
    compress_bits: int = 4
    compress_group_size: int = 64
    attn_sparsity: float = 1.0
    keep_tiles: bool = True

    def __post_init__(self) -> None:
        self.weight_split = _split("weights", self.weights)
        self.cache_split = _split("cache", self.cache)
        self.hidden_split = _split("hidden", self.hidden)
        if self.gpu_batch_size is not None and (not isinstance(self.gpu_batch_size, int)
                                                or self.gpu_batch_size < 1):
            raise TiergenError(f"policy: gpu_batch_size must be a positive integer, "
                               f"got {self.gpu_batch_size!r}")
        if not isinstance(self.num_gpu_batches, int) or self.num_gpu_batches < 1:
            raise TiergenError(f"policy: num_gpu_batches must be a positive integer, "
                               f"got {self.num_gpu_batches!r}")
        if self.experts is not None and self.experts not in TIERS:
            raise TiergenError(f"policy: experts must be one of {', '.join(TIERS)} (or None to "
                               f"follow the weight percentages), got {self.experts!r}")
        if self.expert_cache is not None:
            self.expert_cache = parse_size(self.expert_cache)
        if self.compress_bits not in (4, 8):
            raise TiergenError(f"policy: compress_bits must be 4 or 8, got {self.compress_bits!r}")
        if (not isinstance(self.compress_group_size, int) or self.compress_group_size < 2
                or self.compress_group_size % 2):
            raise TiergenError("policy: compress_group_size must be an even integer >= 2, got "
                               f"{self.compress_group_size!r}")
        if not 0 < self.attn_sparsity <= 1:
            raise TiergenError(f"policy: attn_sparsity is the fraction of attention weights "
                               f"kept, in (0, 1]; got {self.attn_sparsity!r}")
        if self.cpu_attention and self.compress_cache:
            raise TiergenError("policy: cpu_attention attends over the cache where it lies, but a "
                               "compressed cache is unpacked on the compute device; choose one")
        if self.cpu_attention and self.cache_split[2] > 0:
            raise TiergenError("policy: cpu_attention keeps the KV cache in host RAM; "
                               "set cache=(0, 100) or leave cpu_attention off")

    @classmethod
    def from_percent(cls, percent: list[float], **kwargs: object) -> Policy:
        """FlexGen's six numbers: weights, cache and hidden states as (device %, host %) pairs."""
        if len(percent) != 6:
            raise TiergenError(f"--percent takes six numbers WD WH CD CH HD HH, got {len(percent)}")
        return cls(weights=tuple(percent[0:2]), cache=tuple(percent[2:4]),
                   hidden=tuple(percent[4:6]), **kwargs)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from '512M', '8G', '1.5GiB' or a plain number."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise TiergenError(f"cannot read memory size {text!r}; write e.g. 4G, 512M or 1000000")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)
