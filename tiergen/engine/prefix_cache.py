"""Prompt prefixes kept from one request to the next (the server's scheduler), so that a
system prompt or a few-shot preamble that comes again skips its prefill."""

from __future__ import annotations

from collections import OrderedDict

from tiergen.config import ModelConfig
from tiergen.engine.generate import Sequence, SharedPrefix


class PrefixCache:
    """Prefixes of earlier prompts, each a one-row cache (:class:`SharedPrefix`) held where the
    policy keeps KV caches (device, host RAM or disk), under a byte budget: the least recently
    used leaves first. A micro-batch whose prompts all start with some of an entry's tokens
    copies those instead of computing them."""

    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0
        self._entries: OrderedDict[tuple[int, ...], SharedPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, cfg: ModelConfig, seqs: list[Sequence]) -> tuple[SharedPrefix, int] | None:
        """The entry that serves ``seqs`` the most tokens, and how many; None if none does."""
        best = None
        for entry in self._entries.values():
            n = entry.serves(cfg, seqs)
            if n and (best is None or n > best[1]):
                best = entry, n
        if best is not None:
            self._entries.move_to_end(tuple(best[0].tokens))
        return best

    def add(self, entry: SharedPrefix) -> bool:
        """Keep ``entry``, evicting the least recently used as needed: True when this cache
        owns it from now on, False (the caller still does) when it is larger than the whole
        budget or its tokens are held already."""
        key = tuple(entry.tokens)
        if entry.nbytes > self.budget or key in self._entries:
            return False
        while self.used + entry.nbytes > self.budget:
            _, old = self._entries.popitem(last=False)
            self.used -= old.nbytes
            old.close()
        self._entries[key] = entry
        self.used += entry.nbytes
        return True

    def close(self) -> None:
        for entry in self._entries.values():
            entry.close()
        self._entries.clear()
        self.used = 0
