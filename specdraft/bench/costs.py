"""``specdraft costs``: what one target forward costs for n new tokens on a cached context.

This is the number that decides whether speculation can pay on a machine: a step that scores k + 1
tokens must cost well under k + 1 single-token steps.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def random_tree(n: int, g: torch.Generator):
    """A tree of n nodes with random parents (each node's parent is an earlier node or the root)."""
    from ..tree import DraftTree

    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    return DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def measure_costs(model, ns: list[int], context: int = 60, repeats: int = 5, tree: bool = False) -> dict[int, float]:
    """Median milliseconds of a forward of n tokens after a ``context``-token cache, per n. With
    ``tree``, the n tokens are one pending token plus a random (n - 1)-node tree, scored with the
    tree attention mask and depth positions, as the engine scores token trees."""
    g = torch.Generator().manual_seed(0)
    vocab = min(model.vocab_size, 1000)
    ctx = torch.randint(0, vocab, (context,), generator=g)
    out = {}
    for n in ns:
        x = torch.randint(0, vocab, (n,), generator=g)
        kw = {}
        if tree:
            t = random_tree(n - 1, g)
            kw = {"attention_mask": t.attention_mask(context, 1, model.dtype), "position_ids": t.position_ids(context, 1)}
        model.reset()
        model.forward(ctx, keep=1)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            model.forward(x, keep=n, **kw)
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
        for tree in ([False, True] if a.tree else [False]):
            c = measure_costs(m, ns, a.context, a.repeats, tree=tree)
            rows.append((dtype + (" tree" if tree else " chain"), c))
        del m
    print(f"{a.target}, {threads} threads, {a.context}-token cached context, median of {a.repeats} (ms per forward)",
          file=sys.stderr)
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"target": a.target, "threads": threads, "context": a.context, "repeats": a.repeats,
                       "rows": {name: {str(n): ms for n, ms in c.items()} for name, c in rows}}, f, indent=1)
    if a.plot:
        plot_costs(rows, a.plot, f"{a.target}: one target forward scoring n tokens ({threads} threads)")
    print("| dtype | " + " | ".join(f"{n} tok" for n in ns) + " |")
    print("|---" * (len(ns) + 1) + "|")
    for dtype, c in rows:
        print(f"| {dtype} | " + " | ".join(f"{c[n]:.0f} ({c[n] / c[ns[0]]:.1f}x)" for n in ns) + " |")
    return 0


def plot_costs(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in rows:
        ns = sorted(c)
        ax[0].plot(ns, [c[n] for n in ns], marker="o", label=name)
        ax[1].plot(ns, [c[n] / c[ns[0]] for n in ns], marker="o", label=name)
    ax[0].set(xlabel="tokens scored in one forward (pending + draft nodes)", ylabel="ms per forward", xscale="log", yscale="log")
    ax[1].set(xlabel="tokens scored in one forward", ylabel=f"cost relative to {min(min(c) for _, c in rows)} token",
              xscale="log")
    for x in ax:
        x.grid(True, alpha=0.3)
    ax[1].legend(loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
