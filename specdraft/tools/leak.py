"""``specdraft leak``: how much a streamed response's shape tells an observer about the content,
with normal streaming and with ``stream_mode: "fixed"`` (server/pacing.py).

The observer sees only what an encrypted connection shows: when each SSE event arrives and its size
in bytes. Two prompt classes of similar length differ in what speculation accepts: "repeat this
passage" (prompt lookup drafts most tokens right) and "write a poem about this passage" (it drafts
few right). Every request is greedy with ``ignore_eos`` and the same ``max_tokens``, so the total
length tells nothing. A logistic regression (and, as a stronger observer, a random forest) learns
the class from the events' inter-arrival times and sizes; its 5-fold cross-validated accuracy is
reported for plain decoding, speculation with normal streams and speculation with fixed streams, with
the latency each costs. The server runs in this process on 127.0.0.1; the modes interleave per prompt.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..api import ModelSettings
from ..commands.flags import add_model_args
from ..core.errors import SpecDraftError
from ..core.extras import require_extra
from ..models.cost_curve import cpu_name

K_EVENTS = 32  # events per request the features describe (zero-padded)
CLASSES = ("Repeat the following text word for word.\n\n{p}", "Write a short poem about the following text.\n\n{p}")
MODES = {  # name -> (request's spec, stream_mode)
    "plain, normal stream": ({"method": "plain"}, "normal"),
    "speculation, normal stream": (None, "normal"),
    "speculation, fixed stream": (None, "fixed"),
}


@dataclass(frozen=True)
class LeakOptions:
    """``specdraft leak``'s flags."""

    models: ModelSettings
    method: str = "prompt_lookup"  # the speculative method measured
    per_class: int = 40  # prompts per class (>= 10)
    max_tokens: int = 48  # tokens per response
    chunk: int = 4  # fixed streams: tokens per event
    interval_ms: float | None = None  # fixed streams: ms between events (default: calibrated)
    margin: float = 0.7  # fraction of the slowest warm-up rate the calibrated cadence uses
    pad_bytes: int = 512  # fixed streams: events padded to a multiple of this
    dataset: str | None = None  # Spec-Bench question.jsonl (default: the shared copy)
    quiet: bool = False
    out: str = "leak.json"


def add_parser(sub):
    lk = sub.add_parser(
        "leak",
        help="measure what streamed responses' timing and sizes tell an observer, normal "
        "vs stream_mode fixed (docs/server.md)",
    )
    add_model_args(lk, default_target="smollm2-135m")
    lk.add_argument("--method", default="prompt_lookup", help="the speculative method measured (default prompt_lookup)")
    lk.add_argument("--per-class", type=int, default=40, help="prompts per class (>= 10)")
    lk.add_argument("--max-tokens", type=int, default=48, help="tokens per response (ignore_eos: all the same length)")
    lk.add_argument("--chunk", type=int, default=4, help="fixed streams: tokens per event")
    lk.add_argument(
        "--interval-ms",
        type=float,
        default=None,
        help="fixed streams: ms between events (default: calibrated, chunk at --margin of the slowest warm-up rate)",
    )
    lk.add_argument("--margin", type=float, default=0.7, help="fraction of the slowest warm-up rate the cadence uses")
    lk.add_argument("--pad-bytes", type=int, default=512, help="fixed streams: events padded to a multiple of this")
    lk.add_argument("--dataset", default=None, help="Spec-Bench question.jsonl (default: the shared copy)")
    lk.add_argument("--quiet", action="store_true", help="no progress bar")
    lk.add_argument("--out", default="leak.json", help="JSON results file")
    return lk


def passages(n: int, path: Path) -> list[str]:
    """The first sentences (about 300 characters) of ``n`` Spec-Bench summarization articles."""
    out = []
    for line in path.open():
        row = json.loads(line)
        if row["category"] != "summarization":
            continue
        text = re.sub(r"\s+", " ", row["turns"][0].split("\n", 1)[-1]).strip()
        cut = text.rfind(". ", 0, 320)
        if cut > 150:
            out.append(text[: cut + 1])
        if len(out) == n:
            return out
    raise SpecDraftError(f"the dataset has only {len(out)} usable summarization passages; asked for {n}")


def observe(url: str, body: dict) -> dict:
    """One streamed chat completion as the observer sees it (event arrival times and sizes, from the
    request's start) and as the client sees it (time of the first text, the text)."""
    import httpx

    t0 = time.monotonic()
    times, sizes, text, first = [], [], [], None
    buf = b""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as s:
        if s.status_code != 200:
            raise SpecDraftError(f"the server answered {s.status_code}: {s.read().decode()[:300]}")
        for piece in s.iter_raw():
            buf += piece
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                times.append(time.monotonic() - t0)
                sizes.append(len(ev) + 2)
                data = [ln[6:] for ln in ev.decode().split("\n") if ln.startswith("data: ")]
                if data and data[0] != "[DONE]":
                    delta = json.loads(data[0])["choices"][0]["delta"].get("content") or ""
                    if delta and first is None:
                        first = times[-1]
                    text.append(delta)
    return {"times": times, "sizes": sizes, "first_text_s": first, "total_s": times[-1], "text": "".join(text)}


def features(obs: dict) -> np.ndarray:
    """What the observer can measure: event count, duration, bytes, and the first K_EVENTS events'
    gaps and sizes (zero-padded)."""
    t, s = np.array(obs["times"]), np.array(obs["sizes"], dtype=float)
    gaps = np.diff(np.concatenate([[0.0], t]))
    f = np.zeros(3 + 2 * K_EVENTS)
    f[:3] = len(t), t[-1], s.sum()
    n = min(K_EVENTS, len(t))
    f[3 : 3 + n], f[3 + K_EVENTS : 3 + K_EVENTS + n] = gaps[:n], s[:n]
    return f


def classifier_accuracy(X: np.ndarray, y: np.ndarray) -> dict:
    """5-fold stratified cross-validated accuracy of a logistic regression and a random forest."""
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    cv = StratifiedKFold(5, shuffle=True, random_state=0)
    out = {}
    for name, clf in [
        ("logistic_regression", make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))),
        ("random_forest", RandomForestClassifier(200, random_state=0)),
    ]:
        acc = cross_val_score(clf, X, y, cv=cv, scoring="accuracy")
        out[name] = {"mean": round(float(acc.mean()), 3), "std": round(float(acc.std()), 3)}
    return out


def calibrate_interval(url: str, bodies: list[dict], chunk: int, margin: float) -> tuple[float, float]:
    """Interval for fixed streams: ``chunk`` tokens at ``margin`` times the slowest per-request rate of
    speculative decoding measured on ``bodies`` (time from the request to its last token)."""
    rates = []
    for b in bodies:
        o = observe(url, {**b, "stream": True, "stream_mode": "normal"})
        rates.append(b["max_tokens"] / o["total_s"])
    slowest = min(rates)
    return chunk / (slowest * margin), slowest


def main_leak(opts: LeakOptions) -> int:
    require_extra("leak", "specdraft leak")
    from ..core.prompts import default_dataset
    from ..server.local import serve_in_thread
    from ..server.pacing import StreamPacing

    if opts.per_class < 10:
        raise SpecDraftError(f"--per-class must be >= 10 (5-fold cross-validation), got {opts.per_class}")
    texts = passages(opts.per_class + 2, Path(opts.dataset) if opts.dataset else default_dataset())
    dec = opts.models.load()
    pacing = StreamPacing(opts.chunk, 1.0, opts.pad_bytes)  # the interval is set below, after calibration

    def body(cls: int, i: int) -> dict:
        return {
            "model": "m",
            "messages": [{"role": "user", "content": CLASSES[cls].format(p=texts[i])}],
            "max_tokens": opts.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

    with serve_in_thread(dec, model_name="m", default_spec={"method": opts.method}, stream_pacing=pacing) as (url, app):
        warm = [body(c, opts.per_class + j) for j in range(2) for c in (0, 1)]
        interval, slowest = calibrate_interval(url, warm, opts.chunk, opts.margin)
        if opts.interval_ms:
            interval = opts.interval_ms / 1000
        app.state.stream_pacing = StreamPacing(opts.chunk, interval, opts.pad_bytes)
        print(
            f"slowest warm-up rate {slowest:.1f} tok/s; fixed streams: {opts.chunk} tokens every "
            f"{interval * 1000:.0f} ms, padded to {opts.pad_bytes} B",
            file=sys.stderr,
        )
        obs, labels = observe_modes(url, body, opts.per_class, opts.quiet)
    y = np.array(labels)
    report = {
        "target": opts.models.target,
        "backend": dec.backend,
        "dtype": opts.models.weights(dec.backend),
        "method": opts.method,
        "cpu": cpu_name(),
        "per_class": opts.per_class,
        "max_tokens": opts.max_tokens,
        "chunk_tokens": opts.chunk,
        "interval_ms": round(interval * 1000, 1),
        "pad_bytes": opts.pad_bytes,
        "slowest_warmup_tok_s": round(slowest, 2),
        "chance_band_95": _chance_band(len(y)),
        "modes": {m: mode_report(os_, y) for m, os_ in obs.items()},
    }
    same = all(
        obs["speculation, fixed stream"][j]["text"] == obs["speculation, normal stream"][j]["text"]
        for j in range(len(y))
    )
    report["fixed_text_equals_normal"] = same
    report["examples"] = {m: [{k: os_[j][k] for k in ("times", "sizes")} for j in (0, 1)] for m, os_ in obs.items()}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(report, indent=1) + "\n")
    raw = {m: [{k: o[k] for k in ("times", "sizes")} for o in os_] for m, os_ in obs.items()}
    Path(opts.out).with_suffix(".observations.json").write_text(json.dumps({"labels": labels, "modes": raw}) + "\n")
    plot(report, str(Path(opts.out).with_suffix(".png")))
    print(table(report))
    return 0


def observe_modes(url: str, body, per_class: int, quiet: bool) -> tuple[dict[str, list[dict]], list[int]]:
    """Every mode on every prompt pair, interleaved per prompt: -> ({mode: observations}, class labels).
    The observer runs in its own process, as it would on another machine: in this one its clock would wait
    for the engine thread's turns at the GIL."""
    obs = {m: [] for m in MODES}
    labels = []
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as observer:
        for i in _progress(range(per_class), quiet):
            for cls in (0, 1):
                labels.append(cls)
                for m, (mspec, mode) in MODES.items():
                    b = {**body(cls, i), "stream_mode": mode, **({"spec": mspec} if mspec else {})}
                    obs[m].append(observer.submit(observe, url, b).result())
    return obs, labels


def mode_report(os_: list[dict], y: np.ndarray) -> dict:
    """One mode's figures: the classifiers' accuracy, the latency it costs, what its events look like."""
    X = np.stack([features(o) for o in os_])
    return {
        "accuracy": classifier_accuracy(X, y),
        "mean_total_s": round(statistics.fmean(o["total_s"] for o in os_), 3),
        "mean_total_s_by_class": [
            round(statistics.fmean(o["total_s"] for o, c in zip(os_, y) if c == k), 3) for k in (0, 1)
        ],
        "mean_events_by_class": [
            round(statistics.fmean(len(o["times"]) for o, c in zip(os_, y) if c == k), 2) for k in (0, 1)
        ],
        "mean_first_text_s": round(statistics.fmean(o["first_text_s"] for o in os_ if o["first_text_s"]), 3),
        "mean_events": round(statistics.fmean(len(o["times"]) for o in os_), 1),
        "distinct_event_sizes": len({s for o in os_ for s in o["sizes"]}),
    }


def table(r: dict) -> str:
    lo, hi = r["chance_band_95"]
    rows = [
        f"{r['per_class']} prompts per class, {r['max_tokens']} tokens each; chance: 0.50 (95% band of a coin "
        f"{lo:.2f}-{hi:.2f})",
        "",
        "| mode | logistic regression | random forest | mean total s | mean time to first text s | events |",
        "|---|---|---|---|---|---|",
    ]
    for m, d in r["modes"].items():
        lr, rf = d["accuracy"]["logistic_regression"], d["accuracy"]["random_forest"]
        rows.append(
            f"| {m} | {lr['mean']:.2f} ± {lr['std']:.2f} | {rf['mean']:.2f} ± {rf['std']:.2f} | "
            f"{d['mean_total_s']:.2f} | {d['mean_first_text_s']:.2f} | {d['mean_events']:.0f} |"
        )
    return "\n".join(rows)


def plot(r: dict, path: str) -> None:
    """What the observer sees of one "repeat" and one "poem" request: event sizes over time, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(r["examples"]), figsize=(4.2 * len(r["examples"]), 3.2), sharey=True)
    for ax, (m, ex) in zip(axes, r["examples"].items()):
        for o, label, mark in zip(ex, ("repeat the passage", "poem about it"), ("o", "x")):
            ax.plot(o["times"], o["sizes"], mark, ms=4, label=label)
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("seconds since the request")
    axes[0].set_ylabel("event size (bytes)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{r['target']} ({r['method']}), {r['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _chance_band(n: int) -> list[float]:
    half = 1.96 * math.sqrt(0.25 / n)
    return [round(0.5 - half, 3), round(0.5 + half, 3)]


def _progress(it, quiet: bool):
    if quiet:
        return it
    from tqdm import tqdm

    return tqdm(it, desc="prompt pairs", file=sys.stderr)
