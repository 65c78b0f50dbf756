"""``specdraft overlap``: the time model of drafting while verifying (PEARL's post-verify, SwiftSpec, DSI),
read from a bench run of the engine's ``remote_draft`` method in turns (``pair_serial``) and drafting ahead
(``pair_overlap``; drafters/remote_draft.py: the draft model in a Ray actor drafts block i + 1 while the
target verifies block i, on the guess that block i is kept whole).

On one 2-core machine the two processes share the cores and the memory bandwidth; with a machine (or GPU)
each, they do not compete: ``model_time`` predicts that case from the per-forward costs and the run's
trace of hits, and ``explain`` checks the model against the measured time first."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import SpecDraftError


def model_time(steps: list[tuple[int, bool]], k: int, costs: dict, overlap: bool) -> float:
    """Predicted decode seconds of a run with this trace of (drafts kept, hit) steps, given per-forward
    ms ``costs`` (``_costs``) and processes that do not compete for cores. A step verifies
    k drafts (the target scores k + 1 tokens); its drafts were made either while the previous step
    verified (a hit: hidden) or after it (k draft forwards on the critical path). Overlapped, a step
    that keeps all k drafts waits for the drafter's k + 1 ahead forwards (the longer of the two); one
    that keeps fewer stops them, waiting on average half a draft forward if they were still running."""
    verify, draft = costs["target_ms"][k + 1], costs["draft_ms"]
    stop_wait = draft / 2 if (k + 1) * draft > verify else 0.0
    ms = 0.0
    for n, hit in steps:
        ms += 0.0 if hit else k * draft
        if not overlap:
            ms += verify
        else:
            ms += max(verify, (k + 1) * draft) if n == k else verify + stop_wait
        ms += costs["rtt_ms"]
    return ms / 1000


def explain(doc: dict, costs_here: dict, costs_apart: dict, k: int) -> dict:
    """Measured against modelled, from a bench results ``doc`` with pair_serial / pair_overlap (and plain)
    records: the model with ``costs_here`` (the actors' own thread counts, as they ran) should match
    the measured decode time; with ``costs_apart`` (each process on a machine of its own) it predicts
    the speedup over plain decoding there (plain = one target forward per token at those costs)."""
    from ..core.metrics import speedup

    out = {"k": k, "costs_here": costs_here, "costs_apart": costs_apart, "methods": {}}
    for method, overlap in (("pair_serial", False), ("pair_overlap", True)):
        recs = [r for r in doc["records"] if r["method"] == method and "steps" in r]
        if not recs:
            continue
        steps = [(s[1], h) for r in recs for s, h in zip(r["steps"], r.get("hits") or [False] * len(r["steps"]))]
        tokens = sum(r["new_tokens"] for r in recs)
        apart = model_time(steps, k, costs_apart, overlap)
        plain_apart = tokens * costs_apart["target_ms"][1] / 1000
        out["methods"][method] = {
            "prompts": len(recs),
            "tokens": tokens,
            "steps": len(steps),
            "hits": sum(h for _, h in steps),
            "decode_s_measured": sum(_decode_s(r) for r in recs),
            "decode_s_model_here": model_time(steps, k, costs_here, overlap),
            "decode_s_model_apart": apart,
            "speedup_model_apart": speedup(tokens, apart, tokens, plain_apart),
        }
    return out


def _decode_s(record: dict) -> float:
    """A run's decode seconds: its wall time less its prompt's prefill (runs of the pair's own loop,
    before session 7, recorded ``decode_s``)."""
    if "decode_s" in record:
        return record["decode_s"]
    if "prefill_s" not in record:
        raise SpecDraftError(
            "the results record no prefill time (a bench of specdraft before session 7): run the bench again"
        )
    return record["wall_s"] - record["prefill_s"]


def render_explain(e: dict) -> str:
    ch, ca = e["costs_here"], e["costs_apart"]
    k = e["k"]
    lines = [
        f"k = {k}; per forward, ms: target {k + 1} tokens {ch['target_ms'][k + 1]:.1f} here / "
        f"{ca['target_ms'][k + 1]:.1f} apart, target 1 token {ca['target_ms'][1]:.1f} apart, draft 1 token "
        f"{ch['draft_ms']:.1f} here / {ca['draft_ms']:.1f} apart, Ray round trip {ch['rtt_ms']:.2f}",
        "",
        "| method | steps | drafted while verifying | decode s measured | model here | error | "
        "model apart | speedup apart (model) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in e["methods"].items():
        err = m["decode_s_model_here"] / m["decode_s_measured"] - 1
        lines.append(
            f"| {name} | {m['steps']} | {m['hits']} | {m['decode_s_measured']:.2f} | "
            f"{m['decode_s_model_here']:.2f} | {err:+.0%} | {m['decode_s_model_apart']:.2f} | "
            f"{m['speedup_model_apart']:.2f}x |"
        )
    return "\n".join(lines)


# --- specdraft overlap ---------------------------------------------------------------------------
@dataclass(frozen=True)
class OverlapOptions:
    """``specdraft overlap``'s flags."""

    results: str  # bench results JSON with pair_serial / pair_overlap records
    target: str | None = None  # default: the results' target
    draft: str | None = None  # default: the results' draft
    threads_apart: int | None = None  # threads each model gets on a machine of its own (default: this one's cores)
    ray_address: str | None = None
    out: str | None = None  # write the figures as JSON


def add_parser(sub):
    ov = sub.add_parser(
        "overlap",
        help="model the overlapped draft/verify pair from a bench run (measured vs "
        "modelled here; predicted with a machine per model)",
    )
    ov.add_argument("results", help="bench results JSON with pair_serial / pair_overlap records")
    ov.add_argument("--target", default=None, help="default: the results' target")
    ov.add_argument("--draft", default=None, help="default: the results' draft")
    ov.add_argument(
        "--threads-apart",
        type=int,
        default=None,
        help="threads each model gets on a machine of its own (default: this machine's cores)",
    )
    ov.add_argument("--ray-address", default=None)
    ov.add_argument("-o", "--out", default=None, help="write the figures as JSON")
    return ov


def main_overlap(opts: OverlapOptions) -> int:
    """Model the overlapped draft/verify pair from a bench run of pair_serial / pair_overlap (docs/scale.md)."""
    path = Path(opts.results)
    if not path.exists():
        raise SpecDraftError(f"no results file {path} (run specdraft bench --methods plain,pair_serial,pair_overlap)")
    doc = json.loads(path.read_text())
    settings = doc.get("settings", {})
    target, draft = opts.target or settings.get("target"), opts.draft or settings.get("draft")
    if not draft:
        raise SpecDraftError("the results name no draft model: pass --draft NAME")
    ran = next((m for n, m in settings.get("methods", {}).items() if n in ("pair_overlap", "pair_serial")), None)
    if ran is None:
        raise SpecDraftError(f"{path} has no pair_serial / pair_overlap results")
    threads, k = ran.get("remote_threads", ran.get("threads", 1)), ran["k"]  # (older runs: "threads")
    apart = opts.threads_apart or os.cpu_count()
    source = {
        "name_or_path": draft,
        "dtype": settings.get("dtype", "bfloat16"),
        "num_layers": settings.get("draft_layers"),
        "backend": settings.get("draft_backend") or settings.get("backend", "hf"),
    }
    here = {"target": doc.get("environment", {}).get("threads") or 1, "draft": threads}
    with _sides(target, source, settings, opts.ray_address) as (tgt, drf, ray):
        e = explain(doc, _costs(tgt, drf, ray, k, here), _costs(tgt, drf, ray, k, {"target": apart, "draft": apart}), k)
    e.update(results=str(path), threads_apart=apart, pair_threads=threads)
    if opts.out:
        Path(opts.out).write_text(json.dumps(e, indent=1))
    print(render_explain(e))
    return 0


@contextlib.contextmanager
def _sides(target: str, source: dict, settings: dict, address: str | None):
    """The target's and the draft's models, each in a Ray actor of its own as in the run."""
    from ..scale.cluster import connect
    from ..scale.remote import ModelSide

    ray = connect(address)
    tsrc = {
        "name_or_path": target,
        "dtype": settings.get("dtype", "bfloat16"),
        "backend": settings.get("backend", "hf"),
    }
    tgt, drf = (ray.remote(num_cpus=1)(ModelSide).remote(s, 1) for s in (tsrc, source))
    try:
        yield tgt, drf, ray
    finally:
        ray.kill(tgt)
        ray.kill(drf)


def _costs(tgt, drf, ray, k: int, threads: dict) -> dict:
    """ms per forward: the target at 1 and k + 1 tokens and the drafter at 1, and a Ray round trip."""
    t = ray.get(tgt.costs.remote([1, k + 1], threads["target"]))
    d = ray.get(drf.costs.remote([1], threads["draft"]))
    ray.get(tgt.ping.remote())
    rtt = []
    for _ in range(20):
        t0 = time.perf_counter()
        ray.get(tgt.ping.remote())
        rtt.append(time.perf_counter() - t0)
    return {"target_ms": t, "draft_ms": d[1], "rtt_ms": 1000 * sorted(rtt)[len(rtt) // 2]}
