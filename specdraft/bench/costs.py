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
    """Median milliseconds of a forward of n tokens after a ``context``-token cache, per n, through the
    model interface (any backend: ``SequenceRows.forward`` as the decode loop calls it). With
    ``tree``, the n tokens are one pending token plus a random (n - 1)-node tree, scored with the
    tree attention mask and depth positions, as the engine scores token trees."""
    from ..engine import _tree_feed

    g = torch.Generator().manual_seed(0)
    vocab = min(model.vocab_size, 1000)
    ctx = torch.randint(0, vocab, (context,), generator=g).tolist()
    rows = model.new_rows()
    rows.add_rows([ctx])
    out = {}
    for n in ns:
        x = torch.randint(0, vocab, (n,), generator=g).tolist()
        trees = [_tree_feed(random_tree(n - 1, g))] if tree and n > 1 else None
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            rows.forward([x], trees=trees)
            dt = time.perf_counter() - t0
            rows.commit([0])  # drop what was scored: the next forward sees the same context
            if i:  # the first one warms up
                times.append(dt)
        out[n] = 1000 * statistics.median(times)
    return out


def main_costs(a) -> int:
    from ..errors import SpecDraftError
    from ..models.backends import backend
    from ..models.loading import load_model, set_threads
    from ..models.lowbit import parse_quant

    threads = set_threads(a.threads)
    ns = [int(x) for x in a.tokens.split(",")]
    rows = []
    dtypes = a.dtype.split(",") if backend(a.backend).uses_dtype else ["gguf"]
    quants = [q for q in a.quantizations.split(",") if q and q != "none"] if a.quantizations else []
    if quants and a.backend != "hf":
        raise SpecDraftError("--quantizations is for the hf backend (a GGUF file carries its own; pass its variant "
                             "as --target NAME:Q4_0)")
    for q in quants:
        parse_quant(q)
    weights = [(d, None) for d in dtypes if "none" in (a.quantizations or "none").split(",")] + \
        [(d, q) for d in dtypes for q in quants]
    for dtype, q in weights:
        m = load_model(a.target + (f":{q}" if q else ""), dtype, backend=a.backend)
        for tree in ([False, True] if a.tree else [False]):
            c = measure_costs(m, ns, a.context, a.repeats, tree=tree)
            rows.append((f"{a.backend} {dtype}" + (f" {q}" if q else "") + (" tree" if tree else " chain"), c))
        del m
    cpu = cpu_name()
    print(f"{a.target}, {a.backend} backend, {threads} threads, {cpu}, {a.context}-token cached context, "
          f"median of {a.repeats} (ms per forward)", file=sys.stderr)
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"target": a.target, "backend": a.backend, "cpu": cpu, "threads": threads, "context": a.context,
                       "repeats": a.repeats, "rows": {name: {str(n): ms for n, ms in c.items()} for name, c in rows}},
                      f, indent=1)
    if a.plot:
        plot_costs(rows, a.plot, f"{a.target} ({a.backend}): one forward scoring n tokens ({threads} threads)")
    print("| backend, weights | " + " | ".join(f"{n} tok" for n in ns) + " |")
    print("|---" * (len(ns) + 1) + "|")
    for dtype, c in rows:
        print(f"| {dtype} | " + " | ".join(f"{c[n]:.0f} ({c[n] / c[ns[0]]:.2f}x)" for n in ns) + " |")
    return 0


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
