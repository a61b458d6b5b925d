"""Prompt prefixes kept from one request to the next (the server's scheduler), so that a
system prompt or a few-shot preamble that comes again skips its prefill."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from tiergen.config import ModelConfig
from tiergen.engine.generate import Sequence, SharedPrefix


class PrefixCache:
    """Prefixes of earlier prompts, each a one-row cache (:class:`SharedPrefix`), in two tiers
    under a byte budget each: where the policy keeps KV caches (device or host RAM), then,
    with ``disk`` bytes and a ``spill_dir``, in spill files. The least recently used entry
    leaves the first tier for the second, and the second altogether. A micro-batch whose
    prompts all start with some of an entry's tokens copies those instead of computing them,
    from either tier."""

    def __init__(self, budget: int, disk: int = 0, spill_dir: Path | None = None) -> None:
        self._tiers = [_Tier(budget), _Tier(disk if spill_dir is not None else 0)]
        self._spill_dir = spill_dir

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self._tiers)

    @property
    def used(self) -> int:
        """Bytes held in the first tier."""
        return self._tiers[0].used

    @property
    def spilled(self) -> int:
        """Bytes held in spill files."""
        return self._tiers[1].used

    def find(self, cfg: ModelConfig, seqs: list[Sequence]) -> tuple[SharedPrefix, int] | None:
        """The entry that serves ``seqs`` the most tokens, and how many; None if none does."""
        best = None
        for tier in self._tiers:
            for entry in tier.entries.values():
                n = entry.serves(cfg, seqs)
                if n and (best is None or n > best[1]):
                    best = entry, n, tier
        if best is None:
            return None
        entry, n, tier = best
        tier.entries.move_to_end(tuple(entry.tokens))
        return entry, n

    def add(self, entry: SharedPrefix) -> bool:
        """Keep ``entry``, moving the least recently used on as needed: True when this cache
        owns it from now on, False (the caller still does) when it is larger than the first
        tier's whole budget or its tokens are held already."""
        key = tuple(entry.tokens)
        near, far = self._tiers
        if entry.nbytes > near.budget or any(key in t.entries for t in self._tiers):
            return False
        while near.used + entry.nbytes > near.budget:
            _, old = near.pop()
            if old.nbytes <= far.budget:
                while far.used + old.nbytes > far.budget:
                    far.pop()[1].close()
                far.put(old.spilled(self._spill_dir))
            else:
                old.close()
        near.put(entry)
        return True

    def close(self) -> None:
        for tier in self._tiers:
            while tier.entries:
                tier.pop()[1].close()


class _Tier:
    """Entries by their tokens, least recently used first, and the bytes they hold."""

    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0
        self.entries: OrderedDict[tuple[int, ...], SharedPrefix] = OrderedDict()

    def put(self, entry: SharedPrefix) -> None:
        self.entries[tuple(entry.tokens)] = entry
        self.used += entry.nbytes

    def pop(self) -> tuple[tuple[int, ...], SharedPrefix]:
        key, entry = self.entries.popitem(last=False)
        self.used -= entry.nbytes
        return key, entry
