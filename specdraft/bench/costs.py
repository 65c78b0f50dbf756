"""``specdraft costs``: what one target forward costs for n new tokens on a cached context, per
backend, weights and draft shape (the measurement is ``specdraft.costs``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..costs import cpu_name, measure_costs
from ..flags import add_backend_arg


@dataclass(frozen=True)
class CostsOptions:
    """``specdraft costs``'s flags."""
    target: str = "qwen2.5-coder-1.5b"
    backend: str = "hf"
    dtype: str = "bfloat16"  # a comma list
    quantizations: str | None = None  # a comma list: none, int8, int4[-gN], w8a8
    tokens: str = "1,2,3,5,9,17,33,65"  # a comma list of new tokens per forward
    context: int = 60
    repeats: int = 5
    threads: int | None = None
    tree: bool = False
    json: str | None = None
    plot: str | None = None


def add_parser(sub):
    c = sub.add_parser("costs", help="ms per target forward for n new tokens (does speculation pay here?)")
    c.add_argument("--target", default="qwen2.5-coder-1.5b")
    add_backend_arg(c)
    c.add_argument("--dtype", default="bfloat16", help="comma list, e.g. bfloat16,float32")
    c.add_argument("--quantizations", default=None, metavar="none,int8,int4",
                   help="hf backend: also (or only, without 'none') low-bit copies, per dtype: int8 / int4[-gN] "
                        "(weight-only) or w8a8 (int8 activations too, oneDNN)")
    c.add_argument("--tokens", default="1,2,3,5,9,17,33,65")
    c.add_argument("--context", type=int, default=60)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--tree", action="store_true", help="also score random token trees (4D tree mask) of each size")
    c.add_argument("--json", default=None, help="save the measurements as JSON")
    c.add_argument("--plot", default=None, help="save a PNG of the cost curve")
    return c


def main_costs(opts: CostsOptions) -> int:
    from ..errors import SpecDraftError
    from ..models.backends import backend
    from ..models.loading import load_model, set_threads
    from ..models.lowbit import parse_quant

    threads = set_threads(opts.threads)
    ns = [int(x) for x in opts.tokens.split(",")]
    rows = []
    dtypes = opts.dtype.split(",") if backend(opts.backend).uses_dtype else ["gguf"]
    quants = [q for q in opts.quantizations.split(",") if q and q != "none"] if opts.quantizations else []
    if quants and opts.backend != "hf":
        raise SpecDraftError("--quantizations is for the hf backend (a GGUF file carries its own; pass its variant "
                             "as --target NAME:Q4_0)")
    for q in quants:
        parse_quant(q)
    weights = [(d, None) for d in dtypes if "none" in (opts.quantizations or "none").split(",")] + \
        [(d, q) for d in dtypes for q in quants]
    for dtype, q in weights:
        m = load_model(opts.target + (f":{q}" if q else ""), dtype, backend=opts.backend)
        for tree in ([False, True] if opts.tree else [False]):
            c = measure_costs(m, ns, opts.context, opts.repeats, tree=tree)
            rows.append((f"{opts.backend} {dtype}" + (f" {q}" if q else "") + (" tree" if tree else " chain"), c))
        del m
    cpu = cpu_name()
    print(f"{opts.target}, {opts.backend} backend, {threads} threads, {cpu}, {opts.context}-token cached context, "
          f"median of {opts.repeats} (ms per forward)", file=sys.stderr)
    if opts.json:
        import json

        with open(opts.json, "w") as f:
            json.dump({"target": opts.target, "backend": opts.backend, "cpu": cpu, "threads": threads,
                       "context": opts.context, "repeats": opts.repeats,
                       "rows": {name: {str(n): ms for n, ms in c.items()} for name, c in rows}}, f, indent=1)
    if opts.plot:
        plot_costs(rows, opts.plot, f"{opts.target} ({opts.backend}): one forward scoring n tokens ({threads} threads)")
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
