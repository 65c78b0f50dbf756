"""Prefixes the engine computed, kept across requests, so a request that resends them prefills only the rest.

Chat clients and agents send the whole history with every turn; without this each turn pays again for
the previous turns' prompt and answer. When a row leaves the engine, its committed tokens' keys and values
are saved (``SequenceRows.save_prefix``: a copy the backend owns, models/base.py ``SavedPrefix``) under its
tokens; a new request starts from the entry sharing the longest prefix with its prompt.

- Only committed tokens are saved (a row's cache after ``commit``): rejected drafts and a tree's losing
  branches never enter, so speculation cannot lower the hit rate.
- Entries are partitioned (``partition``: the server's API key and the request's ``cache_salt``): a
  lookup sees its own partition only, so no request can learn from timing what another tenant sent.
- A saved prefix is a copy: evicting it never touches a row that started from it.
- Memory: entries are evicted least recently used first while their bytes pass ``budget_bytes``; an entry
  that another covers (its tokens a prefix of the other's) is dropped for it.

The lookup compares a prompt with every entry of its partition (numpy, a few microseconds per entry): a
linear scan, not a radix tree, because entries are whole histories (tens to a few hundred under a budget
of a few GB) and a scan keeps eviction and partitions trivial.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Protocol, Sequence

import numpy as np


class Saved(Protocol):
    n: int  # tokens it holds
    nbytes: int


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens not computed again
    looked_up_tokens: int = 0  # prompt tokens of every lookup (hit_tokens / this: the token hit rate)
    inserts: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Entry:
    tokens: np.ndarray  # the tokens whose keys and values ``saved`` holds (its first len(tokens))
    saved: Any


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[tuple[Hashable, int], _Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self._lock = threading.Lock()
        self.stats = PrefixCacheStats()

    def lookup(self, tokens: Sequence[int], partition: Hashable = None, counted: bool = True) -> tuple[Any, int] | None:
        """(saved, m): the entry of ``partition`` sharing the longest prefix with ``tokens`` and that prefix's
        length m >= 1; None when none shares a token. ``counted``: in ``stats`` (the requests' prompts; a
        draft model's rows look up uncounted, so the hit rate is the prompts')."""
        t = np.asarray(tokens, np.int64)
        with self._lock:
            if counted:
                self.stats.lookups += 1
                self.stats.looked_up_tokens += len(t)
            best, m = None, 0
            for key, e in self._entries.items():
                if key[0] == partition:
                    k = _common(e.tokens, t)
                    if k > m:
                        best, m = key, k
            if best is None:
                return None
            self._entries.move_to_end(best)
            if counted:
                self.stats.hits += 1
                self.stats.hit_tokens += m
            return self._entries[best].saved, m

    def insert(self, tokens: Sequence[int], saved: Saved, partition: Hashable = None) -> None:
        """Keep ``saved`` (holding the keys and values of ``tokens``, at least) for later lookups."""
        t = np.asarray(tokens, np.int64)[: saved.n]
        if len(t) == 0 or saved.nbytes > self.budget:
            return
        with self._lock:
            for key, e in list(self._entries.items()):
                if key[0] != partition:
                    continue
                k = _common(e.tokens, t)
                if k == len(t):  # an entry holds all of these already
                    self._entries.move_to_end(key)
                    return
                if k == len(e.tokens):  # these cover that entry
                    self._drop(key)
            self._entries[(partition, self._next)] = _Entry(t, saved)
            self._next += 1
            self.stats.inserts += 1
            self.stats.bytes += saved.nbytes
            while self.stats.bytes > self.budget:
                self._drop(next(iter(self._entries)))
                self.stats.evictions += 1
            self.stats.entries = len(self._entries)

    def _drop(self, key) -> None:
        self.stats.bytes -= self._entries.pop(key).saved.nbytes
        self.stats.entries = len(self._entries)

    def entries(self, partition: Hashable = None) -> list[list[int]]:
        """The token lists held for ``partition`` (tests, diagnostics)."""
        with self._lock:
            return [e.tokens.tolist() for key, e in self._entries.items() if key[0] == partition]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats.bytes = self.stats.entries = 0


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of a's and b's common prefix."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def default_budget_bytes() -> int:
    """5% of the machine's memory, at most 4 GiB: a few hundred conversations of a 1.5B model's history."""
    try:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return min(total // 20, 4 << 30)
