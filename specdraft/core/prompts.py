"""Prompts: Spec-Bench's question.jsonl, or any jsonl with a prompt/turns field, and the presets shipped
in specdraft/bench/ (the bench, autotune, tune-skip, training data and the demo read them here)."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from .errors import SpecDraftError
from .jsonl import iter_jsonl

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
BENCH_FILES = Path(__file__).parents[1] / "bench"  # the prompt and schema files shipped
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


# Spec-Bench's 480 questions (Apache-2.0, see its NOTICE.md), shipped with the package so that the
# demo, the bench, autotune and train read the same file wherever the project is installed.
SPEC_BENCH = BENCH_FILES / "spec_bench" / "question.jsonl"


def default_dataset() -> Path:
    env = os.environ.get("SPECDRAFT_DATASET")
    return Path(env) if env else SPEC_BENCH


# Presets with a prompt file of their own (--preset NAME, whatever --dataset says): code_edit = 9 prompts
# that rewrite a given snippet (type hints, renames, docstrings, SQL and text fixes), the repetitive
# workload users run locally, where most of the answer copies the prompt.
PRESET_FILES = {"code_edit": BENCH_FILES / "code_edit.jsonl"}


# structured: Spec-Bench's first 4 prompts of each task, each wrapped in an instruction to describe it as
# JSON (STRUCTURED_SCHEMA: its task, language, a summary and keywords); run with --json-schema that file.
STRUCTURED_SCHEMA = BENCH_FILES / "structured_schema.json"
STRUCTURED_INSTRUCTION = (
    'Read the request below; do not answer it. Reply with one JSON object only, with the keys "task" (one of '
    'writing, translation, summarization, question, math, coding, other), "language" (the request\'s language), '
    '"summary" (one sentence, at most 160 characters) and "keywords" (up to 5 short keywords).\n\n'
    "Request:\n"
)


def structured_rows(rows: list[dict], tasks: list[str] | None = None, per_task: int | None = None) -> list[dict]:
    out = []
    for t in tasks or TASKS:
        out += [{**r, "prompt": STRUCTURED_INSTRUCTION + r["prompt"]} for r in rows if r["task"] == t][: per_task or 4]
    return out


def preset_dataset(preset: str | None) -> Path | None:
    return PRESET_FILES.get(preset or "")


def task_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def load_prompts(path: str | Path | None = None) -> list[dict]:
    path = Path(path) if path else default_dataset()
    if not path.exists():
        raise SpecDraftError(f"dataset {path} not found (pass --dataset PATH.jsonl)")
    rows = []
    for i, r in iter_jsonl(path, SpecDraftError, "dataset"):
        turns = r.get("turns")
        if isinstance(turns, list) and turns:
            prompt = turns[0]
        else:
            prompt = next((r[k] for k in ("prompt", "question", "text", "instruction") if k in r), None)
        if not isinstance(prompt, str) or not prompt:
            raise SpecDraftError(f"{path}:{i}: no prompt (need a 'turns', 'prompt', 'question' or 'text' field)")
        cat = str(r.get("category", "default"))
        rows.append(
            {
                "id": str(r.get("question_id", r.get("id", i - 1))),
                "category": cat,
                "task": task_of(cat),
                "prompt": prompt,
            }
        )
    if not rows:
        raise SpecDraftError(
            f"dataset {path} has no rows (need one JSON object a line with a 'turns' or 'prompt' field)"
        )
    return rows


def select(
    rows: list[dict], tasks: list[str] | None = None, n_per_task: int | None = None, preset: str | None = None
) -> list[dict]:
    if preset == "structured":
        return structured_rows(rows, tasks, n_per_task)
    if preset == "core18":
        # 18 generic prompts: the first 3 of each of translation, summarization, qa, math_reasoning, rag,
        # and the first of writing, coding, reasoning (n_per_task caps each category).
        out = []
        for cat, n in [
            ("translation", 3),
            ("summarization", 3),
            ("qa", 3),
            ("math_reasoning", 3),
            ("rag", 3),
            ("writing", 1),
            ("coding", 1),
            ("reasoning", 1),
        ]:
            out += [r for r in rows if r["category"] == cat][: min(n, n_per_task or n)]
        return [r for r in out if not tasks or r["task"] in tasks]
    if preset and preset not in PRESET_FILES:
        raise SpecDraftError(f"unknown preset {preset!r}; known: core18, structured, {', '.join(PRESET_FILES)}")
    by: OrderedDict[str, list[dict]] = OrderedDict()
    for r in rows:
        by.setdefault(r["task"], []).append(r)
    if tasks:
        unknown = [t for t in tasks if t not in by]
        if unknown:
            raise SpecDraftError(f"unknown task(s) {unknown}; this dataset has: {list(by)}")
        by = OrderedDict((t, by[t]) for t in tasks)
    out = []
    for t, rs in by.items():
        if t == "mt_bench" and n_per_task:
            # spread over the eight MT-bench categories rather than taking 'writing' only
            seen, picked = set(), []
            for r in rs:
                if r["category"] not in seen:
                    picked.append(r)
                    seen.add(r["category"])
            rs = picked + [r for r in rs if r not in picked]
        out += rs[:n_per_task] if n_per_task else rs
    return out


def preset_rows(
    preset: str | None, dataset=None, tasks: list[str] | None = None, n_per_task: int | None = None
) -> list[dict]:
    """The prompts of ``--preset`` (presets joined by "+" are concatenated: core18+code_edit), else of
    ``dataset`` (Spec-Bench by default); ``tasks`` and ``n_per_task`` narrow either."""
    parts = preset.split("+") if preset else [None]
    out = []
    for p in parts:
        rows = load_prompts(preset_dataset(p) or dataset)
        mine = tasks if not tasks or len(parts) == 1 else [t for t in tasks if any(r["task"] == t for r in rows)]
        if mine != []:  # joined presets: each keeps the asked tasks it has
            out += select(rows, mine, n_per_task, p)
    missing = sorted(set(tasks or ()) - {r["task"] for r in out})
    if missing:
        raise SpecDraftError(f"unknown task(s) {missing} in --preset {preset}")
    return out
