"""``specdraft costs``: what one target forward costs for n new tokens on a cached context, per
backend, weights and draft shape (the measurement is ``specdraft.models.cost_curve``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..commands.flags import add_backend_arg, add_device_args, add_draft_backend_arg
from ..core.policy import chain_tokens
from ..models.cost_curve import cpu_name, measure_costs, measure_prefill
from ..models.paths import PREFILL_TOKENS


@dataclass(frozen=True)
class CostsOptions:
    """``specdraft costs``'s flags."""

    target: str = "qwen2.5-coder-1.5b"
    backend: str = "hf"
    dtype: str | None = None  # a comma list; None: not given (DEFAULT_DTYPE)
    quantizations: str | None = None  # a comma list: none, int8, int4[-gN], w8a8
    tokens: str = "1,2,3,5,9,17,33,65"  # a comma list of new tokens per forward
    context: int = 60
    repeats: int = 5
    threads: int | None = None
    tree: bool = False
    json: str | None = None
    plot: str | None = None
    draft: str | None = None  # NAME[:TYPE] or self:TYPE: its curve beside the target's, and per k what pays
    draft_backend: str | None = None
    device: str = "auto"  # core/device.py
    draft_device: str | None = None  # None: --device's


def add_parser(sub):
    c = sub.add_parser("costs", help="ms per target forward for n new tokens (does speculation pay here?)")
    c.add_argument("--target", default="qwen2.5-coder-1.5b")
    add_backend_arg(c, default="hf")  # a measurement of one backend: the one named
    c.add_argument("--dtype", default=None, help="hf backend: a comma list, e.g. bfloat16,float32 (default bfloat16)")
    c.add_argument(
        "--quantizations",
        default=None,
        metavar="none,int8,int4",
        help="hf backend: also (or only, without 'none') low-bit copies, per dtype: int8 / int4[-gN] "
        "(weight-only) or w8a8 (int8 activations too, oneDNN)",
    )
    c.add_argument(
        "--draft",
        default=None,
        metavar="NAME[:TYPE]",
        help="also measure this draft model and print, per k, what a step costs in plain target tokens "
        "and the acceptance it needs to pay (e.g. self:Q4_K_M --draft-backend llama)",
    )
    add_draft_backend_arg(c)
    add_device_args(c)
    c.add_argument("--tokens", default="1,2,3,5,9,17,33,65")
    c.add_argument("--context", type=int, default=60)
    c.add_argument("--repeats", type=int, default=5)
    c.add_argument("--threads", type=int, default=None)
    c.add_argument("--tree", action="store_true", help="also score random token trees (4D tree mask) of each size")
    c.add_argument("--json", default=None, help="save the measurements as JSON")
    c.add_argument("--plot", default=None, help="save a PNG of the cost curve")
    return c


def main_costs(opts: CostsOptions) -> int:
    from ..core.errors import SpecDraftError
    from ..models.backends import DEFAULT_DTYPE, backend, load_model, placement
    from ..models.loading import set_threads
    from ..models.lowbit import parse_quant

    threads = set_threads(opts.threads)
    placement(opts.backend, opts.device)  # before anything loads
    if opts.draft:
        placement(opts.draft_backend or opts.backend, opts.draft_device or opts.device, "--draft-device")
    ns = [int(x) for x in opts.tokens.split(",")]
    rows = []
    dtypes = (opts.dtype or DEFAULT_DTYPE).split(",") if backend(opts.backend).uses_dtype else ["gguf"]
    quants = [q for q in opts.quantizations.split(",") if q and q != "none"] if opts.quantizations else []
    if quants and opts.backend != "hf":
        raise SpecDraftError(
            "--quantizations is for the hf backend (a GGUF file carries its own; pass its variant "
            "as --target NAME:Q4_0)"
        )
    for q in quants:
        parse_quant(q)
    weights = [(d, None) for d in dtypes if "none" in (opts.quantizations or "none").split(",")] + [
        (d, q) for d in dtypes for q in quants
    ]
    prefill = {}  # weights -> {prompt tokens: ms}: what a request pays before its first token
    for dtype, q in weights:
        m = load_model(opts.target + (f":{q}" if q else ""), dtype, backend=opts.backend, device=opts.device)
        name = f"{opts.backend} {dtype}" + (f" {q}" if q else "")
        for tree in [False, True] if opts.tree else [False]:
            c = measure_costs(m, ns, opts.context, opts.repeats, tree=tree)
            rows.append((name + (" tree" if tree else " chain"), c))
        prefill[name] = measure_prefill(m, list(PREFILL_TOKENS), opts.repeats)
        del m
    draft = draft_curve(opts, ns, dtypes[0]) if opts.draft else None
    cpu = cpu_name()
    print(
        f"{opts.target}, {opts.backend} backend, --device {opts.device}, {threads} threads, {cpu}, "
        f"{opts.context}-token cached context, "
        f"median of {opts.repeats} (ms per forward)",
        file=sys.stderr,
    )
    if opts.json:
        import json

        with open(opts.json, "w") as f:
            json.dump(
                {
                    "target": opts.target,
                    "backend": opts.backend,
                    "device": opts.device,
                    "cpu": cpu,
                    "threads": threads,
                    "context": opts.context,
                    "repeats": opts.repeats,
                    "rows": {name: {str(n): ms for n, ms in c.items()} for name, c in rows},
                    "prefill": {name: {str(n): ms for n, ms in c.items()} for name, c in prefill.items()},
                    **(
                        {"draft": {"name": draft[0], "ms": {str(n): ms for n, ms in draft[1].items()}}} if draft else {}
                    ),
                },
                f,
                indent=1,
            )
    if opts.plot:
        plot_costs(rows, opts.plot, f"{opts.target} ({opts.backend}): one forward scoring n tokens ({threads} threads)")
    print("| backend, weights | " + " | ".join(f"{n} tok" for n in ns) + " |")
    print("|---" * (len(ns) + 1) + "|")
    for dtype, c in rows:
        print(f"| {dtype} | " + " | ".join(f"{c[n]:.0f} ({c[n] / c[ns[0]]:.2f}x)" for n in ns) + " |")
    for name, c in prefill.items():
        print(
            f"{name}: prefill of "
            + " / ".join(map(str, c))
            + " prompt tokens: "
            + " / ".join(f"{ms:.0f}" for ms in c.values())
            + " ms"
        )
    if draft:
        print(f"| draft {draft[0]} | " + " | ".join(f"{draft[1][n]:.0f}" for n in ns) + " |")
        for name, c in rows:
            print_break_even(name, c, draft)
    return 0


def draft_curve(opts: CostsOptions, ns: list[int], dtype: str) -> tuple[str, dict[int, float]]:
    """The draft model's own curve (ms per forward of n tokens), on --draft-backend (default --backend)."""
    from ..models.backends import load_model

    be = opts.draft_backend or opts.backend
    name = opts.target + ":" + opts.draft[5:] if opts.draft.startswith("self:") else opts.draft  # its own low-bit copy
    m = load_model(name, dtype, backend=be, device=opts.draft_device or opts.device)
    return f"{opts.draft} ({be})", measure_costs(m, ns, opts.context, opts.repeats)


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
    from ..core.policy import interpolate

    one, d1 = target[min(target)], draft[1][min(draft[1])]
    print(f"\n{name} drafted by {draft[0]} (chain of k): a step costs k x {d1:.0f} ms + the target's forward of k + 1")
    print("| k | step ms | plain target tokens it costs | acceptance to beat target plain | ... to beat draft plain |")
    print("|---|---|---|---|---|")
    show = lambda alpha: "never" if alpha is None else f"{alpha:.2f}"  # noqa: E731
    for k in (1, 2, 4, 6, 8, 12, 16):
        step = k * d1 + interpolate(target, k + 1)
        print(
            f"| {k} | {step:.0f} | {step / one:.2f} | {show(break_even_acceptance(step / one, k))} | "
            f"{show(break_even_acceptance(step / d1, k))} |"
        )


def plot_costs(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in rows:
        ns = sorted(c)
        ax[0].plot(ns, [c[n] for n in ns], marker="o", label=name)
        ax[1].plot(ns, [c[n] / c[ns[0]] for n in ns], marker="o", label=name)
    ax[0].set(
        xlabel="tokens scored in one forward (pending + draft nodes)",
        ylabel="ms per forward",
        xscale="log",
        yscale="log",
    )
    ax[1].set(
        xlabel="tokens scored in one forward",
        ylabel=f"cost relative to {min(min(c) for _, c in rows)} token",
        xscale="log",
    )
    for x in ax:
        x.grid(True, alpha=0.3)
    ax[1].legend(loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
