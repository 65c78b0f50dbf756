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
    draft = draft_curve(a, ns, dtypes[0]) if a.draft else None
    cpu = cpu_name()
    print(f"{a.target}, {a.backend} backend, {threads} threads, {cpu}, {a.context}-token cached context, "
          f"median of {a.repeats} (ms per forward)", file=sys.stderr)
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump({"target": a.target, "backend": a.backend, "cpu": cpu, "threads": threads, "context": a.context,
                       "repeats": a.repeats, "rows": {name: {str(n): ms for n, ms in c.items()} for name, c in rows},
                       **({"draft": {"name": draft[0], "ms": {str(n): ms for n, ms in draft[1].items()}}} if draft else {})},
                      f, indent=1)
    if a.plot:
        plot_costs(rows, a.plot, f"{a.target} ({a.backend}): one forward scoring n tokens ({threads} threads)")
    print("| backend, weights | " + " | ".join(f"{n} tok" for n in ns) + " |")
    print("|---" * (len(ns) + 1) + "|")
    for dtype, c in rows:
        print(f"| {dtype} | " + " | ".join(f"{c[n]:.0f} ({c[n] / c[ns[0]]:.2f}x)" for n in ns) + " |")
    if draft:
        print(f"| draft {draft[0]} | " + " | ".join(f"{draft[1][n]:.0f}" for n in ns) + " |")
        for name, c in rows:
            print_break_even(name, c, draft)
    return 0


def draft_curve(a, ns: list[int], dtype: str) -> tuple[str, dict[int, float]]:
    """The draft model's own curve (ms per forward of n tokens), on --draft-backend (default --backend)."""
    from ..models.loading import load_model

    be = a.draft_backend or a.backend
    name = a.target + ":" + a.draft[5:] if a.draft.startswith("self:") else a.draft  # the target's own low-bit copy
    m = load_model(name, dtype, backend=be)
    return f"{a.draft} ({be})", measure_costs(m, ns, a.context, a.repeats)


def chain_tokens(alpha: float, k: int) -> float:
    """Tokens a step of k chained draft tokens yields when each is accepted with probability alpha."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def break_even_acceptance(tokens: float, k: int) -> float | None:
    """The per-token acceptance at which a k-token chain yields ``tokens`` per step (None: beyond k + 1)."""
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tokens(mid, k) < tokens else (lo, mid)
    return hi


def print_break_even(name: str, target: dict[int, float], draft: tuple[str, dict[int, float]]) -> None:
    """A step of k draft tokens (k one-token draft forwards, then one target forward of k + 1): its cost
    in plain target tokens, and the acceptance it needs to beat the target's plain decoding and the draft's own
    (for a self-draft, its low-bit file decoding plainly: what the speculation must outrun to be worth it)."""
    from ..policy import interpolate

    one, d1 = target[min(target)], draft[1][min(draft[1])]
    print(f"\n{name} drafted by {draft[0]} (chain of k): a step costs k x {d1:.0f} ms + the target's forward of k + 1")
    print("| k | step ms | plain target tokens it costs | acceptance to beat target plain | ... to beat draft plain |")
    print("|---|---|---|---|---|")
    show = lambda alpha: "never" if alpha is None else f"{alpha:.2f}"  # noqa: E731
    for k in (1, 2, 4, 6, 8, 12, 16):
        step = k * d1 + interpolate(target, k + 1)
        print(f"| {k} | {step:.0f} | {step / one:.2f} | {show(break_even_acceptance(step / one, k))} | "
              f"{show(break_even_acceptance(step / d1, k))} |")


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
