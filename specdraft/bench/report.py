"""Aggregate a results file into tables and plots. All metrics come from specdraft.core.metrics."""

from __future__ import annotations

import re
import statistics
from collections import OrderedDict, defaultdict
from pathlib import Path

from ..core import homefiles as h
from ..core.metrics import (
    StepRecord,
    acceptance_rate,
    decode_phase,
    fidelity_z,
    mean_accepted_tokens,
    per_position_acceptance,
    speedup,
    tokens_per_second,
)
from ..core.prompts import TASKS

_COUNT = h.of(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a count (an integer >= 0)")
_STEP = h.of(
    lambda v: (
        isinstance(v, list) and len(v) in (2, 3) and all(isinstance(x, int) and not isinstance(x, bool) for x in v[:2])
    ),
    "[drafted, accepted, depth]",
)
_NAME = h.of(lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "a name or number")
_RECORD = h.obj(
    {
        "prompt_id": _NAME,
        "task": h.TEXT,
        "method": h.TEXT,
        "repeat": _COUNT,
        "new_tokens": _COUNT,
        "wall_s": h.NUMBER,
        "steps": h.items(_STEP),
        "exact": h.BOOL,
        "arms": h.nullable(h.obj({}, keys=h.TEXT, values=h.NUMBER)),
        "draft_s": h.NUMBER,
        "verify_s": h.NUMBER,
        "first_divergence": _COUNT,
        "top2_gap": h.nullable(h.NUMBER),
        "fid_tokens": h.nullable(h.NUMBER),
        "fid_sum": h.nullable(h.NUMBER),
        "fid_var": h.nullable(h.NUMBER),
    },
    required=("prompt_id", "task", "method", "repeat", "new_tokens", "wall_s"),
    keys=h.TEXT,
)
_SAMPLING = h.obj(
    {n: h.NUMBER for n in ("temperature", "top_k", "top_p", "max_new_tokens")},
    required=("temperature", "top_k", "top_p", "max_new_tokens"),
    keys=h.TEXT,
)
RESULTS = h.obj(
    {  # what render reads of what harness.run_bench writes
        "settings": h.obj(
            {
                "target": h.TEXT,
                "dtype": h.TEXT,
                "backend": h.TEXT,
                "reference": h.TEXT,
                "draft": h.nullable(h.TEXT),
                "draft_backend": h.nullable(h.TEXT),
                "sampling": _SAMPLING,
                "methods": h.obj({}, keys=h.TEXT, values=h.nullable(h.obj({}, keys=h.TEXT))),
            },
            required=("target", "dtype", "sampling"),
            keys=h.TEXT,
        ),
        "environment": h.obj({}, keys=h.TEXT),
        "skipped": h.obj({}, keys=h.TEXT, values=h.TEXT),
        "records": h.items(_RECORD),
        "workers": h.obj({}, keys=h.TEXT, values=h.obj({}, keys=h.TEXT)),
    },
    required=("settings", "environment", "records"),
)


def read_results(path: Path, advice: str) -> dict | None:
    """The results document in ``path`` (None when there is none); a file that is not one (another JSON, a
    binary) is one error naming it, ending with ``advice``."""
    return h.read_json(path, RESULTS, "the results file", advice, max_bytes=None)


OTHER_BASES = ("plain", "hf_generate", "llama_cpp", "ov_genai")  # extra speedup columns, when in the run
FASTEST_PLAIN = "fastest_plain"  # --reference: the plain decoder with the most tokens/s in the run


def is_plain_decoder(name: str) -> bool:
    """The engine's plain decoding (on any backend: BACKEND:plain) and the plain baselines (llama_cpp@MODEL,
    ov_genai@MODEL: another GGUF's)."""
    return name in OTHER_BASES or name.endswith(":plain") or name.startswith(("llama_cpp@", "ov_genai@"))


def other_bases(methods) -> list[str]:
    """The plain decoders in the run, the speedup columns besides the reference's."""
    return [b for b in methods if is_plain_decoder(b)]


def _steps(recs) -> list[StepRecord]:
    return [StepRecord(s[0], s[1], 0, depth=s[2] if len(s) > 2 else None) for r in recs for s in r.get("steps", [])]


def end_to_end(recs: list[dict]) -> tuple[int, float]:
    """(new tokens, wall seconds) of the records: whole calls, prefill included."""
    return sum(r["new_tokens"] for r in recs), sum(r["wall_s"] for r in recs)


def decode_totals(recs: list[dict]) -> tuple[int, float] | None:
    """(tokens after the first, seconds after the first) of the records (metrics.decode_phase); None when a
    record has no first-token time (results written before runners reported it)."""
    if any("first_token_s" not in r for r in recs):
        return None
    parts = [decode_phase(r["new_tokens"], r["wall_s"], r["first_token_s"]) for r in recs]
    return sum(n for n, _ in parts), sum(s for _, s in parts)


def speedup_over(rs: list[dict], base: list[dict], totals=end_to_end) -> float | None:
    """metrics.speedup of records ``rs`` over ``base`` on their ``totals`` (end to end, or decode_totals: the
    decode phase); with records from several Ray workers (bench --ray), per worker (a shard is timed on its
    own worker only), then the mean over workers weighted by the method's new tokens there."""

    def tot(recs):
        return totals(recs) or (0, 0.0)

    workers = {r.get("worker") for r in rs + base}
    if len(workers) <= 1:
        return speedup(*tot(rs), *tot(base))
    parts = []
    for w in workers:
        mine = [r for r in rs if r.get("worker") == w]
        s = speedup(*tot(mine), *tot([r for r in base if r.get("worker") == w]))
        if s is not None:
            parts.append((tot(mine)[0], s))
    weight = sum(n for n, _ in parts)
    return sum(n * s for n, s in parts) / weight if weight else None


def aggregate(doc: dict) -> dict:
    recs = doc["records"]
    methods = list(OrderedDict.fromkeys(r["method"] for r in recs))
    present = set(r["task"] for r in recs)
    tasks = [t for t in TASKS if t in present] + sorted(present - set(TASKS))
    repeats = sorted(set(r["repeat"] for r in recs))
    # only prompts (per repeat) that every method finished, so totals compare like with like
    complete = set()
    by_pr = defaultdict(set)
    for r in recs:
        by_pr[(r["prompt_id"], r["repeat"])].add(r["method"])
    for key, ms in by_pr.items():
        if set(methods) <= ms:
            complete.add(key)
    recs = [r for r in recs if (r["prompt_id"], r["repeat"]) in complete]

    def tot(method, task=None, rep=None):
        rs = [
            r
            for r in recs
            if r["method"] == method and (task is None or r["task"] == task) and (rep is None or r["repeat"] == rep)
        ]
        return (*end_to_end(rs), rs)

    asked = doc.get("settings", {}).get("reference", "plain")
    ref = _reference(asked, methods, lambda b: tot(b)[2], end_to_end)
    decoding = all("first_token_s" in r for r in recs) and bool(recs)
    dref = _reference(asked, methods, lambda b: tot(b)[2], decode_totals) if decoding else None
    out = {
        "methods": methods,
        "tasks": tasks,
        "n_prompts": len({k[0] for k in complete}),
        "repeats": len(repeats),
        "reference": ref,
        "decode_reference": dref,
        "fastest_plain": asked == FASTEST_PLAIN,
        "rows": {},
        "workers": sorted({r["worker"] for r in recs if "worker" in r}),
    }
    for m in methods:
        row = {"task_speedup": {}, "task_mat": {}, "task_decode_speedup": {}}
        for t in tasks + [None]:
            n, w, rs = tot(m, t)
            sp = speedup_over(rs, tot(ref, t)[2])
            dsp = speedup_over(rs, tot(dref, t)[2], decode_totals) if decoding else None
            mat = mean_accepted_tokens(_steps(rs))
            if t is None:
                dn, ds = decode_totals(rs) or (0, 0.0)
                row.update(
                    decode_tokens_per_s=tokens_per_second(dn, ds) if decoding else None,
                    decode_speedup=dsp,
                    first_token_s=sum(r["first_token_s"] for r in rs) / len(rs) if decoding and rs else None,
                )
                row.update(
                    tokens=n,
                    wall_s=w,
                    tokens_per_s=tokens_per_second(n, w),
                    speedup=sp,
                    mat=mat,
                    acceptance_rate=acceptance_rate(_steps(rs)),
                    per_position=per_position_acceptance(_steps(rs)),
                    draft_s=sum(r.get("draft_s", 0.0) for r in rs),
                    verify_s=sum(r.get("verify_s", 0.0) for r in rs),
                )
                row["speedup_vs"] = {b: speedup_over(rs, tot(b)[2]) for b in other_bases(methods) if b != ref}
                per_rep = [speedup_over(tot(m, None, k)[2], tot(ref, None, k)[2]) for k in repeats]
                per_rep = [x for x in per_rep if x is not None]
                row["speedup_std"] = statistics.stdev(per_rep) if len(per_rep) > 1 else 0.0
                row["fidelity_z"] = fidelity_z(rs)
                checked = [r for r in rs if "exact" in r]
                row["exact"] = (sum(r["exact"] for r in checked), len(checked)) if checked else None
                row["mismatches"] = [
                    {k: r.get(k) for k in ("prompt_id", "task", "repeat", "first_divergence", "top2_gap")}
                    for r in checked
                    if not r["exact"]
                ]
            else:
                row["task_speedup"][t] = sp
                row["task_decode_speedup"][t] = dsp
                row["task_mat"][t] = mat
        out["rows"][m] = row
    return out


def _reference(asked: str, methods: list[str], records_of, totals) -> str:
    """The method speedups are over: the one asked, or with FASTEST_PLAIN the plain decoder with the most
    tokens/s on ``totals`` (end to end or the decode phase: each has its own fastest)."""
    ref = asked
    if asked == FASTEST_PLAIN:
        ref = max(other_bases(methods), key=lambda b: tokens_per_second(*(totals(records_of(b)) or (0, 0.0))) or 0.0)
    return ref if ref in methods else "plain"


def engine_methods(doc: dict) -> list[str]:
    """The run's speculative engine methods (not a baseline, not plain decoding, no lossy rule)."""
    specs = doc["settings"].get("methods", {})
    return [m for m, d in specs.items() if d and "method" in d and d["method"] != "plain" and not d.get("lossy")]


def headline(doc: dict, agg: dict) -> str:
    """The README's results row: CPU and date, the generation's length, then for the decode phase and end
    to end apart (each with its own fastest plain decoder) that decoder, specdraft's fastest lossless
    method, its speedup; and how that method's greedy output compared with plain decoding."""
    env, rows = doc["environment"], agg["rows"]
    specs = [m for m in engine_methods(doc) if m in rows]
    if not specs:
        return ""
    phases = [
        ("decode_tokens_per_s", "decode_speedup", agg.get("decode_reference")),
        ("tokens_per_s", "speedup", agg["reference"]),
    ]
    cells, best = [], []
    for rate, gain, ref in phases:
        if ref is None:
            cells.append("- | -")
            continue
        m = max(specs, key=lambda x: rows[x][rate] or 0)
        best.append(m)
        cells.append(f"{ref} {_f(rows[ref][rate])}, {m} {_f(rows[m][rate])} tok/s | **{_f(rows[m][gain], '{:.2f}x')}**")
    same = "; ".join(f"{m} {_identical(rows[m])}" for m in dict.fromkeys(best))
    return (
        "| CPU, date | generation | decode phase: fastest plain, specdraft's fastest lossless | speedup "
        "| end to end: fastest plain, specdraft's fastest lossless | speedup | greedy output vs plain |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {env.get('cpu')}, {str(env.get('date'))[:10]} | {_generation(doc, agg)} | {cells[0]} | {cells[1]} "
        f"| {same} |\n"
    )


def _identical(row: dict) -> str:
    """How a method's greedy outputs compared with plain decoding: 'n/m identical', the near-ties named."""
    if row["exact"] is None:
        return "-"
    gaps = [x["top2_gap"] for x in row["mismatches"] if x.get("top2_gap") is not None]
    return f"{row['exact'][0]}/{row['exact'][1]} identical" + (
        f", divergences at top-2 gaps <= {max(gaps):.3f}" if gaps else ""
    )


def _generation(doc: dict, agg: dict) -> str:
    sp = doc["settings"]["sampling"]
    mode = "greedy" if sp["temperature"] == 0 else f"T={sp['temperature']}"
    return f"{agg['n_prompts']} prompts x {sp['max_new_tokens']} new tokens, {mode}"


def _weights(s: dict) -> str:
    if s.get("backend", "hf") == "hf":
        return s["dtype"]
    return f"GGUF on {s['backend']} (hf: methods {s['dtype']})"


def _draft_on(s: dict) -> str:
    return f" (draft on {s['draft_backend']})" if s.get("draft_backend") else ""


def _ref_label(name: str) -> str:
    return {
        "plain": "the engine's plain decoding",
        "hf:plain": "the engine's plain decoding on transformers",
        "hf_generate": "transformers generate",
        "llama_cpp": "llama.cpp plain decoding",
        "ov_genai": "OpenVINO GenAI plain decoding",
    }.get(name, name)


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def label(doc: dict, method: str) -> str:
    """The method's name, marked when an opt-in lossy rule made its outputs (sampling only)."""
    spec = doc["settings"].get("methods", {}).get(method) or {}
    if spec.get("lossy") and doc["settings"]["sampling"]["temperature"] > 0:
        return f"{method} (LOSSY: {spec['lossy']})"
    return method


def markdown(doc: dict, agg: dict) -> str:
    s = doc["settings"]
    env = doc["environment"]
    sp = s["sampling"]
    mode = "greedy" if sp["temperature"] == 0 else f"T={sp['temperature']}, top-k {sp['top_k']}, top-p {sp['top_p']}"
    lines = [
        f"### {s['target']}"
        + (f" (draft {s['draft']})" if s.get("draft") else "")
        + f", {_weights(s)}, {mode}, {sp['max_new_tokens']} new tokens, "
        f"{agg['n_prompts']} prompts x {agg['repeats']} repeat(s)",
        "",
        f"Speedup = (total new tokens / total wall s) over {_ref_label(agg['reference'])}"
        + (" (the fastest plain decoder of this run)" if agg.get("fastest_plain") else "")
        + "; MAT = mean over steps "
        f"of (accepted + 1). Backend: {s.get('backend', 'hf')}{_draft_on(s)}. "
        f"{env.get('cpu')}, {env.get('threads')} threads, "
        f"torch {env.get('torch')}, llama-cpp-python {env.get('llama_cpp_python')}, "
        f"transformers {env.get('transformers')}, commit {str(env.get('git_commit'))[:10]}, {env.get('date')}.",
        "",
        "| method | " + " | ".join(agg["tasks"]) + " | Overall | MAT | tok/s |",
        "|---" * (len(agg["tasks"]) + 4) + "|",
    ]
    lines[3:3] = worker_lines(doc, agg)
    for m, r in agg["rows"].items():
        cells = [_f(r["task_speedup"][t], "{:.2f}x") for t in agg["tasks"]]
        ov = _f(r["speedup"], "{:.2f}x") + (f" ±{r['speedup_std']:.2f}" if agg["repeats"] > 1 else "")
        lines.append(
            f"| {label(doc, m)} | " + " | ".join(cells) + f" | **{ov}** | {_f(r['mat'])} | {_f(r['tokens_per_s'])} |"
        )
    lines += decode_lines(doc, agg)
    bases = [b for b in other_bases(agg["methods"]) if b != agg["reference"]]
    fid = any(r.get("fidelity_z") is not None for r in agg["rows"].values())
    lines += [
        "",
        "| method | tok/s | "
        + "".join(f"vs {_ref_label(b)} | " for b in bases)
        + "acceptance | draft s | verify s | greedy exact |"
        + (" fidelity Z |" if fid else ""),
        "|---" * (6 + len(bases) + fid) + "|",
    ]
    for m, r in agg["rows"].items():
        ex = "-" if r["exact"] is None else f"{r['exact'][0]}/{r['exact'][1]}"
        vs = "".join(f"{_f(r['speedup_vs'].get(b), '{:.2f}x')} | " for b in bases)
        lines.append(
            f"| {label(doc, m)} | {_f(r['tokens_per_s'])} | {vs}"
            f"{_f(r['acceptance_rate'])} | {_f(r['draft_s'], '{:.1f}')} | {_f(r['verify_s'], '{:.1f}')} | {ex} |"
            + (f" {_f(r['fidelity_z'], '{:+.1f}')} |" if fid else "")
        )
    if fid:
        lines += [
            "",
            "Fidelity Z: the target's log-probability of each sampled token against its expectation, pooled "
            "(metrics.fidelity_z). About N(0, 1) when a method samples the target's distribution; |Z| > 5 "
            "means it does not, and its speed is not a lossless figure.",
        ]
    mism = [(m, x) for m, r in agg["rows"].items() for x in r["mismatches"]]
    if mism:
        lines += [
            "",
            "Greedy mismatches against plain decoding (first diverging token; the target's top-2 logit "
            "gap there: a gap near 0 is a numerical near-tie, a large gap is a bug):",
            "",
        ]
        for m, x in mism:
            lines.append(
                f"- {m}: prompt {x['prompt_id']} ({x['task']}), position {x['first_divergence']}, "
                f"top-2 gap {_f(x.get('top2_gap'), '{:.4f}')}"
            )
    for name, why in doc.get("skipped", {}).items():
        lines.append(f"- {name}: {why}")
    return "\n".join(lines + arm_lines(doc, agg["tasks"])) + "\n"


def decode_lines(doc: dict, agg: dict) -> list[str]:
    """The decode phase's table: each method's speedup over the fastest plain decoder of that phase, per task."""
    dref = agg.get("decode_reference")
    if dref is None:
        return []
    out = [
        "",
        f"Decode phase (the tokens after the first over the seconds after the first arrived; the prompt's "
        f"prefill and the first step apart): speedup over {_ref_label(dref)}"
        + (" (the fastest plain decoder of this phase)" if agg.get("fastest_plain") else "")
        + "; first token: mean seconds from the call to the first new token.",
        "",
        "| method | " + " | ".join(agg["tasks"]) + " | Overall | decode tok/s | first token s |",
        "|---" * (len(agg["tasks"]) + 4) + "|",
    ]
    for m, r in agg["rows"].items():
        cells = [_f(r["task_decode_speedup"][t], "{:.2f}x") for t in agg["tasks"]]
        out.append(
            f"| {label(doc, m)} | " + " | ".join(cells) + f" | **{_f(r['decode_speedup'], '{:.2f}x')}** | "
            f"{_f(r['decode_tokens_per_s'])} | {_f(r['first_token_s'], '{:.2f}')} |"
        )
    return out


def worker_lines(doc: dict, agg: dict) -> list[str]:
    """With results from more than one Ray worker: how the speedups combine them."""
    ws = agg.get("workers", [])
    if len(ws) < 2:
        return []
    info = doc.get("workers", {})
    where = ", ".join(
        f"{w} on {info.get(w, {}).get('host', '?')} ({info.get(w, {}).get('threads', '?')} threads)" for w in ws
    )
    return [
        "",
        f"Sharded over {len(ws)} Ray workers ({where}): each speedup is computed per worker, on that "
        "worker's records only (a prompt's methods all ran on one worker), then averaged over the workers, "
        "weighted by the method's new tokens; tok/s are totals over all workers.",
    ]


def arm_lines(doc: dict, tasks: list[str]) -> list[str]:
    """What composite drafters (auto, hybrid) drafted with, per task: each arm's share of the steps."""
    by: dict = {}
    for r in doc["records"]:
        for arm, n in (r.get("arms") or {}).items():
            cell = by.setdefault(r["method"], {}).setdefault(r["task"], {})
            cell[arm] = cell.get(arm, 0) + n
    if not by:
        return []
    out = [
        "",
        "Steps per arm of the composite drafters (share of the task's steps):",
        "",
        "| method | " + " | ".join(tasks) + " |",
        "|---" * (len(tasks) + 1) + "|",
    ]
    for m, per in by.items():
        cells = []
        for t in tasks:
            c = per.get(t, {})
            n = sum(c.values()) or 1
            cells.append(", ".join(f"{a} {100 * v / n:.0f}%" for a, v in sorted(c.items(), key=lambda x: -x[1])) or "-")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


def _finish(fig, ax, title: str, stem: Path, suffix: str) -> Path:
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title)
    fig.tight_layout()
    p = stem.with_name(stem.name + suffix)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def make_plots(doc: dict, agg: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    methods = [m for m in agg["methods"] if m != agg["reference"]]
    tasks = agg["tasks"] + ["Overall"]
    if methods:
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks)) + 2.5, 4))
        w = 0.8 / len(methods)
        for i, m in enumerate(methods):
            r = agg["rows"][m]
            ys = [r["task_speedup"].get(t) or 0 for t in agg["tasks"]] + [r["speedup"] or 0]
            ax.bar([j + i * w for j in range(len(tasks))], ys, w, label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(tasks))], tasks, rotation=20)
        ax.set_ylabel(f"speedup over {_ref_label(agg['reference'])}")
        files.append(_finish(fig, ax, f"{doc['settings']['target']}: speedup per task", stem, "_speedup.png"))
    curves = {m: agg["rows"][m]["per_position"] for m in methods if agg["rows"][m]["per_position"]}
    if curves:
        fig, ax = plt.subplots(figsize=(8.5, 4))
        for m, ys in curves.items():
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=m)
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | drafted)")
        ax.set_ylim(0, 1)
        files.append(_finish(fig, ax, "per-position acceptance", stem, "_acceptance.png"))
    sweep = defaultdict(list)
    for m in methods:
        mm = re.fullmatch(r"(\w+)\[(\w+)=([^,\]]+)\]", m)
        if mm:
            try:
                sweep[(mm.group(1), mm.group(2))].append((float(mm.group(3)), agg["rows"][m]["tokens_per_s"]))
            except ValueError:
                pass
    if sweep:
        fig, ax = plt.subplots(figsize=(8.5, 4))
        for (m, f), pts in sweep.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{m} ({f})")
        base = agg["rows"][agg["reference"]]["tokens_per_s"]
        if base:
            ax.axhline(base, color="k", lw=0.8, ls="--", label="plain")
        ax.set_xlabel(", ".join(sorted({f for _, f in sweep})))
        ax.set_ylabel("tokens/s")
        files.append(_finish(fig, ax, "tokens/s against the swept field", stem, "_sweep.png"))
    return files


def render(doc: dict, results_path: Path, plots: bool = True) -> str:
    """Markdown report (also written next to the results as *_report.md) and PNG plots."""
    agg = aggregate(doc)
    md = markdown(doc, agg)
    row = headline(doc, agg)
    if row:
        md += (
            "\nspecdraft's fastest lossless configuration against the fastest plain decoder, in the decode phase "
            "and end to end (the README's row):\n\n" + row
        )
    stem = results_path.with_suffix("")
    files = make_plots(doc, agg, stem) if plots else []
    if files:
        md += "\nPlots: " + ", ".join(str(f) for f in files) + "\n"
    stem.with_name(stem.name + "_report.md").write_text(md)
    return md
