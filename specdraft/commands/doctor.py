"""``specdraft doctor``: what this machine is, what works on it, and which backend and method to pick.

It prints the CPU and its instruction set, the torch and llama.cpp builds, the llama.cpp probe's
verdict (llama_probe.py), the models that are ready, a short cost curve per backend (ms per forward
of 1 / 4 / 8 / 16 tokens) and a recommendation read off that curve. Exit status 1 when something the
README promises does not work here (a backend that cannot load or decode), 0 otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def say(self, what: str, text: str) -> None:
        self.lines.append((what, text))
        print(f"{what:8s} {text}", flush=True)

    def problem(self, what: str, text: str) -> None:
        self.problems.append(f"{what}: {text}")
        self.say(what, "PROBLEM: " + text)


def isa_summary(flags: list[str]) -> str:
    names = {
        "avx2": "AVX2",
        "avx512f": "AVX-512",
        "avx512_vnni": "AVX512_VNNI",
        "avx512_bf16": "AVX512_BF16",
        "avx_vnni": "AVX_VNNI",
        "amx_tile": "AMX (tile)",
        "amx_int8": "AMX_INT8",
        "amx_bf16": "AMX_BF16",
    }
    return " ".join(names[f] for f in names if f in flags) or "no AVX2"


def check_cpu_and_torch(r: Report, threads: int) -> None:
    import os

    import torch

    from ..models.cost_curve import cpu_name
    from ..models.llama_probe import cpu_flags

    r.say("cpu", f"{cpu_name().split(' (')[0]}, {os.cpu_count()} cores; {isa_summary(cpu_flags())}")
    r.say(
        "torch",
        f"{torch.__version__}, kernels for {torch.backends.cpu.get_cpu_capability()}, "
        f"bf16 matmul {'native' if 'avx512_bf16' in cpu_flags() or 'amx_bf16' in cpu_flags() else 'emulated'}"
        f", {threads} threads",
    )


def ready_models() -> list[str]:
    from ..models import catalog

    return [s["name"] for s in catalog.status() if s["dense"]]


def check_models(r: Report) -> list[str]:
    from ..models import catalog

    ready = ready_models()
    missing = [s["name"] for s in catalog.status() if s["name"] not in ready]
    r.say(
        "models",
        (f"ready: {', '.join(ready)}" if ready else "none ready")
        + (f"; not pulled: {', '.join(missing)} (`make models`)" if missing else ""),
    )
    return ready


def measure(r: Report, model: str, paths: list[str]) -> dict[str, dict[int, float]]:
    from ..models.backends import BACKENDS
    from ..models.paths import CURVE_TOKENS, measure_curves

    r.say(
        "costs",
        f"ms per forward of {' / '.join(map(str, CURVE_TOKENS))} tokens, {model}, 60-token context "
        "(ratio to one token); kept for --backend auto",
    )
    # an optional backend that cannot take this model is a note, not a problem
    optional = lambda path: BACKENDS[path.partition(":")[0]].optional  # noqa: E731
    fail = lambda path, msg: (r.say if optional(path) else r.problem)("", f"{path}: {msg}")  # noqa: E731
    return measure_curves(model, paths, say=lambda s: r.say("", s), fail=fail)


def recommend(r: Report, curves: dict[str, dict[int, float]], model: str) -> None:
    """Read the pick off the measured curves: the fastest one-token path (what --backend auto takes
    without an autotune pick), and whether a step that scores 8 tokens is cheap enough there for
    speculation to pay on generic prompts."""
    from ..models.backends import BACKENDS
    from ..models.paths import ModelPath, fastest_one_token, read

    pick = read(model).get("pick")
    if pick:
        p = ModelPath.parse(pick["path"])
        r.say(
            "path",
            f"--backend auto takes --backend {p.backend} --target {p.target(model)}: `specdraft autotune "
            f"--paths` measured it fastest here ({pick['tokens_per_s']:.2f} tok/s)",
        )
    if not curves:
        r.say("pick", f"--backend {next(iter(BACKENDS))} (nothing was measured)")
        return
    fast = fastest_one_token(curves)
    c = curves[fast]
    r8 = c[8] / c[1]
    p = ModelPath.parse(fast)
    why = f"its one-token forward is the cheapest here ({c[1]:.0f} ms); scoring 8 tokens costs {r8:.2f}x one, " + (
        "so a step must keep about that many tokens to pay: `auto` speculates where drafts are long "
        "(code edits, repeated text) and decodes plainly elsewhere"
        if r8 > 2
        else "so speculation pays on most prompts"
    )
    r.say(
        "pick",
        f"--backend {p.backend} --target {p.target(model)} --method auto"
        + (" (what --backend auto takes here)" if not pick else "")
        + f": {why}",
    )
    r.say(
        "",
        f"`specdraft autotune --target {model} --paths {','.join(curves)}` measures whole requests on each "
        "and makes --backend auto take the fastest",
    )
    shape_advice(r, model)
    for path, curve in curves.items():  # what each other path is good for: its backend's own words
        line = path != fast and BACKENDS[ModelPath.parse(path).backend].advice
        if line and (text := line(path, curve, fast, c, model)):
            r.say("", text)


LONG_PROMPT, LONG_ANSWER = (2000, 64), (50, 512)  # (prompt tokens, new tokens): a RAG request, a chat request


def shape_advice(r: Report, model: str) -> None:
    """Where a request's shape moves --backend auto (generate passes it): the path fastest end to end for a
    long prompt with a short answer, and for a short prompt with a long answer."""
    from ..models.paths import RequestShape, path_costs, read

    costs = path_costs(read(model))
    if len(costs) < 2:
        return
    best = {}
    for prompt, new in (LONG_PROMPT, LONG_ANSWER):
        shape = RequestShape(prompt, new)
        best[prompt, new] = min(costs, key=lambda k: sum(costs[k].seconds(shape)))
    r.say(
        "",
        "by a request's shape (--backend auto weighs prefill against decoding): "
        + ", ".join(f"a {p}-token prompt with a {n}-token answer runs fastest on {k}" for (p, n), k in best.items()),
    )


def add_parser(sub):
    """``specdraft doctor``'s flags (main_doctor's arguments)."""
    dr = sub.add_parser("doctor", help="start here: this CPU, what works on it, which backend and method to pick")
    dr.add_argument(
        "--model",
        default=None,
        help="the model whose cost curves are measured (default: the Qwen 1.5B target if pulled, else SmolLM2)",
    )
    dr.add_argument("--no-costs", action="store_true", help="skip the cost curves (a few seconds to a minute)")
    dr.add_argument("--threads", type=int, default=None)
    return dr


def main_doctor(model: str | None = None, costs: bool = True, threads: int | None = None) -> int:
    """``model``: the one whose cost curves are measured (default: the Qwen 1.5B target if pulled, else
    SmolLM2); ``costs`` False skips the curves."""
    from ..models.backends import BACKENDS
    from ..models.loading import set_threads

    threads = set_threads(threads)
    model = model or next((m for m in ("qwen2.5-coder-1.5b", "smollm2-135m") if m in ready_models()), None)
    if costs and model:  # a bad paths file, an unwritable home: one error now, before any report line
        from ..models.paths import check_writable

        check_writable(model)
    r = Report()
    print(f"specdraft doctor, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    check_cpu_and_torch(r, threads)
    check_models(r)
    runs = [b for b in BACKENDS.values() if b.check is None or b.check(r)]  # each backend's own check
    if costs and model:
        paths = [p for b in runs for p in b.paths]
        recommend(r, measure(r, model, paths), model)
    print(f"{'status':8s} " + ("ok" if not r.problems else f"{len(r.problems)} problem(s): " + "; ".join(r.problems)))
    return 1 if r.problems else 0
