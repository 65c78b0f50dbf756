"""``specdraft costs``: what one target forward costs for n new tokens on a cached context.

This is the number that decides whether speculation can pay on a machine: a step that scores k + 1
tokens must cost well under k + 1 single-token steps.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def measure_costs(model, ns: list[int], context: int = 60, repeats: int = 5) -> dict[int, float]:
    """Median milliseconds of a forward of n tokens after a ``context``-token cache, per n."""
    g = torch.Generator().manual_seed(0)
    vocab = min(model.vocab_size, 1000)
    ctx = torch.randint(0, vocab, (context,), generator=g)
    out = {}
    for n in ns:
        x = torch.randint(0, vocab, (n,), generator=g)
        model.reset()
        model.forward(ctx, keep=1)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model.forward(x, keep=n)
            dt = time.perf_counter() - t0
            model.crop(context)
            if i:  # the first one warms up
                times.append(dt)
        out[n] = 1000 * statistics.median(times)
    model.reset()
    return out


def main_costs(a) -> int:
    from ..models.loading import load_model, set_threads

    threads = set_threads(a.threads)
    ns = [int(x) for x in a.tokens.split(",")]
    rows = []
    for dtype in a.dtype.split(","):
        m = load_model(a.target, dtype)
        c = measure_costs(m, ns, a.context, a.repeats)
        rows.append((dtype, c))
        del m
    print(f"{a.target}, {threads} threads, {a.context}-token cached context, median of {a.repeats} (ms per forward)",
          file=sys.stderr)
    print("| dtype | " + " | ".join(f"{n} tok" for n in ns) + " |")
    print("|---" * (len(ns) + 1) + "|")
    for dtype, c in rows:
        print(f"| {dtype} | " + " | ".join(f"{c[n]:.0f} ({c[n] / c[ns[0]]:.1f}x)" for n in ns) + " |")
    return 0
