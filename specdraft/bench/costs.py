"""``specdraft costs``: what one target forward costs for n new tokens on a cached context, per
backend, weights and draft shape (the measurement is ``specdraft.costs``).
"""

from __future__ import annotations

import sys

from ..costs import cpu_name, measure_costs


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
