"""What one target forward costs for n new tokens on a cached context, on this machine (``cpu_name``).

This is the number that decides whether speculation can pay on a machine: a step that scores k + 1
tokens must cost well under k + 1 single-token steps. The decoder's cost curve, ``auto``, ``doctor``
and ``specdraft costs`` (bench/costs.py) measure it here.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..core.device import wait
from ..core.tree import DraftTree, feed_mask


def random_tree(n: int, g: torch.Generator):
    """A tree of n nodes with random parents (each node's parent is an earlier node or the root)."""
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    return DraftTree.of([0] * n, parents)


def measure_costs(model, ns: list[int], context: int = 60, repeats: int = 5, tree: bool = False) -> dict[int, float]:
    """Median milliseconds of a forward of n tokens after a ``context``-token cache, per n, through the
    model interface (any backend: ``SequenceRows.forward`` as the decode loop calls it). With
    ``tree``, the n tokens are one pending token plus a random (n - 1)-node tree, scored with the
    tree attention mask and depth positions, as the engine scores token trees."""
    g = torch.Generator().manual_seed(0)
    vocab = min(model.vocab_size, 1000)
    ctx = torch.randint(0, vocab, (context,), generator=g).tolist()
    rows = model.new_rows()
    rows.add_rows([ctx])
    out = {}
    for n in ns:
        x = torch.randint(0, vocab, (n,), generator=g).tolist()
        trees = [feed_mask(random_tree(n - 1, g))] if tree and n > 1 else None
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            rows.forward([x], trees=trees)
            wait(model.device)
            dt = time.perf_counter() - t0
            rows.commit([0])  # drop what was scored: the next forward sees the same context
            if i:  # the first one warms up
                times.append(dt)
        out[n] = 1000 * statistics.median(times)
    return out


def measure_prefill(model, ns: list[int], repeats: int = 3) -> dict[int, float]:
    """Median milliseconds to prefill a prompt of n tokens into a fresh row, per n: what a request pays
    before its first token (``SequenceRows.add_rows``, as the engine admits a request)."""
    g = torch.Generator().manual_seed(1)
    vocab = min(model.vocab_size, 1000)
    rows = model.new_rows()
    out = {}
    for n in ns:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            rows.add_rows([ids])
            wait(model.device)
            dt = time.perf_counter() - t0
            rows.remove_rows([0])
            if i:  # the first one warms up
                times.append(dt)
        out[n] = 1000 * statistics.median(times)
    return out


def cpu_key() -> str:
    """A short key of this CPU kind (file names of what was measured on it)."""
    import hashlib

    return hashlib.sha256(cpu_name().encode()).hexdigest()[:10]


def cpu_name() -> str:
    """The CPU model and whether it has AVX-512 / AVX512_BF16 (the cost curve depends on them)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        import platform

        return platform.processor() or "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown CPU")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = "AVX-512 + AVX512_BF16" if "avx512_bf16" in flags else ("AVX-512" if "avx512f" in flags else "AVX2 only")
    return f"{name} ({isa})"
