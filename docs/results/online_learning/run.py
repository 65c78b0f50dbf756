"""Online learning of the EAGLE-3 head on traffic the head never saw: MAT and decode-phase tokens/s per
request, learning on against learning off.

    python docs/results/online_learning/run.py --head HEAD_DIR --out docs/results/online_learning/qwen

The requests stream one at a time (``--idle`` seconds apart), greedy, with a chat template: ``--requests`` of
the first domain (Spec-Bench's translation prompts by default, cycled, each pass under another instruction so
no prompt repeats word for word), then ``--second`` of the second domain (math_reasoning), then ``--back`` of
the first domain again, to check that what the head learned of the second domain did not cost it the first
(the back phase against the frozen head's first-domain MAT). Both runs see the same requests; the learning run
starts from the shipped head (``persist`` off: nothing is read from or written to the adapted store) and its
training process takes ``--budget`` of the CPU. Writes OUT.json (every request's figures, the learner's
counts, the phases' means, the date and CPU) and OUT.png (MAT and tokens/s against request number, a rolling
mean, the phases marked).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from specdraft.api import SpecDecoder
from specdraft.core.prompts import preset_rows
from specdraft.learning import LearnConfig

VARIATIONS = (
    "",
    "Please answer the following.\n\n",
    "Answer carefully.\n\n",
    "Here is a task for you.\n\n",
    "Respond to this request.\n\n",
    "Consider the following.\n\n",
)


def domain_prompts(task: str, n: int) -> list[str]:
    """``n`` prompts of Spec-Bench's ``task``, cycled; pass p puts VARIATIONS[p] before each."""
    base = [r["prompt"] for r in preset_rows(None, tasks=[task])]
    return [VARIATIONS[(i // len(base)) % len(VARIATIONS)] + base[i % len(base)] for i in range(n)]


def schedule(a) -> list[tuple[str, str]]:
    """(phase, prompt) of every request, in order."""
    first, second = a.domains.split(",")
    return (
        [("first", p) for p in domain_prompts(first, a.requests)]
        + [("second", p) for p in domain_prompts(second, a.second)]
        + [("back", p) for p in domain_prompts(first, a.requests + a.back)[a.requests :]]
    )


def run(a, learn: bool) -> list[dict]:
    cfg = LearnConfig(budget=a.budget, persist=False, publish_every=a.publish_every, window=a.window) if learn else None
    dec = SpecDecoder.load(a.target, backend=a.backend, dtype=a.dtype, learn=cfg)
    spec = {"method": "eagle3", "head": a.head, "k": a.k}
    rows = []
    try:
        for i, (phase, prompt) in enumerate(schedule(a)):
            out = dec.generate(prompt, sampling={"max_new_tokens": a.max_new_tokens}, spec=spec, chat=True)
            st = out.stats
            decode_s = max(st.wall_s - st.prefill_s, 1e-9)
            row = {
                "i": i,
                "phase": phase,
                "new_tokens": st.new_tokens,
                "mat": st.mat,
                "decode_tok_s": round(st.new_tokens / decode_s, 2),
            }
            if learn:
                s = dec.learner.status()
                row.update(
                    updates=s.updates,
                    kept=s.kept,
                    rollbacks=s.rollbacks,
                    optimizer_steps=s.progress.steps,
                    acceptance=s.acceptance,
                    busy_share=s.progress.busy_share,
                )
            rows.append(row)
            print(json.dumps({"learn": learn, **row}), flush=True)
            time.sleep(a.idle)  # the gap before the next request: the learner trains in idle time
    finally:
        dec.close()
    return rows


def phase_means(rows: list[dict]) -> dict:
    out = {}
    for phase in ("first", "second", "back"):
        sel = [r for r in rows if r["phase"] == phase and r["mat"] is not None]
        if sel:
            out[phase] = {
                "mat": round(sum(r["mat"] for r in sel) / len(sel), 3),
                "decode_tok_s": round(sum(r["decode_tok_s"] for r in sel) / len(sel), 2),
                "requests": len(sel),
            }
    return out


def rolling(ys: list[float], n: int) -> list[float]:
    return [sum(ys[max(0, i - n + 1) : i + 1]) / len(ys[max(0, i - n + 1) : i + 1]) for i in range(len(ys))]


def plot(runs: dict, out: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for (name, rows), color in zip(runs.items(), ("tab:gray", "tab:green")):
        x = [r["i"] for r in rows]
        for ax, key in zip(axes, ("mat", "decode_tok_s")):
            ys = [r[key] or 0.0 for r in rows]
            ax.plot(x, ys, ".", color=color, alpha=0.25, markersize=3)
            ax.plot(x, rolling(ys, window), color=color, label=f"learning {name} (rolling mean of {window})")
    rows = next(iter(runs.values()))
    for ax, label in zip(axes, ("MAT (accepted + 1 per step)", "decode tokens/s")):
        for phase in ("second", "back"):
            starts = [r["i"] for r in rows if r["phase"] == phase]
            if starts:
                ax.axvline(starts[0], color="k", linestyle=":", linewidth=0.8)
        ax.set_ylabel(label)
    axes[0].legend(loc="best", fontsize=8)
    axes[1].set_xlabel("request (first domain | second domain | first domain again)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def cpu_model() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "unknown"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", required=True, help="an EAGLE-3 head directory for --target")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b:Q4_0")
    ap.add_argument("--backend", default="llama")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--domains", default="translation,math_reasoning", help="Spec-Bench tasks: FIRST,SECOND")
    ap.add_argument("--requests", type=int, default=300, help="requests of the first domain")
    ap.add_argument("--second", type=int, default=100, help="requests of the second domain, after the first")
    ap.add_argument("--back", type=int, default=50, help="requests of the first domain again, after the second")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--publish-every", type=int, default=LearnConfig.publish_every)
    ap.add_argument("--window", type=int, default=LearnConfig.window)
    ap.add_argument("--modes", default="off,on", help="learning off, on, or both (in that order)")
    ap.add_argument("--rolling", type=int, default=20)
    ap.add_argument("--idle", type=float, default=0.0, help="seconds between two requests (the learner's time)")
    ap.add_argument("--out", required=True, help="OUT: writes OUT.json and OUT.png")
    a = ap.parse_args()
    runs = {m: run(a, learn=m == "on") for m in a.modes.split(",")}
    doc = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "args": vars(a),
        "means": {m: phase_means(rows) for m, rows in runs.items()},
        "requests": runs,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    plot(runs, out.with_suffix(".png"), a.rolling)
    print(json.dumps(doc["means"], indent=1))


if __name__ == "__main__":
    main()
