"""A datastore corpus that does not contain the bench prompts.

    python -m specdraft.bench.corpus OUT.jsonl [--exclude-preset core18] [--max-chars 25000000]
    python -m specdraft.bench.corpus OUT.jsonl --prompts-only [--every N]


Writes one ``{"text": ...}`` line per document: every Spec-Bench prompt except those of the
excluded preset (so a store built from it never contains a test prompt), then the source files of
this Python's standard library (tests excluded) as a code corpus, up to ``--max-chars`` characters.
This is the corpus of the ``suffix_ds`` results in docs/benchmark-log.md.

``--prompts-only`` writes the same Spec-Bench prompts as ``{"question_id", "category", "turns"}``
rows (every N-th with ``--every N``) and no code: the training prompts of ``specdraft train``, which
must not contain the bench prompts either.
"""

from __future__ import annotations

import argparse
import glob
import json
import sysconfig

from ..core import prompts


def write_corpus(
    out: str, exclude_preset: str | None = "core18", max_chars: int = 25_000_000, dataset: str | None = None
) -> dict:
    rows = prompts.load_prompts(dataset)
    excluded = {r["id"] for r in prompts.select(rows, preset=exclude_preset)} if exclude_preset else set()
    n_docs = chars = 0
    with open(out, "w") as f:

        def put(text: str) -> None:
            nonlocal n_docs, chars
            f.write(json.dumps({"text": text}) + "\n")
            n_docs += 1
            chars += len(text)

        for r in rows:
            if r["id"] not in excluded:
                put(r["prompt"])
        std = sysconfig.get_paths()["stdlib"]
        for path in sorted(glob.glob(std + "/**/*.py", recursive=True)):
            if "/test" in path or "site-packages" in path or chars > max_chars:
                continue
            try:
                with open(path, encoding="utf-8") as src:
                    put(src.read())
            except (OSError, UnicodeDecodeError):
                continue
    return {"documents": n_docs, "chars": chars, "excluded_prompt_ids": sorted(excluded)}


def write_prompts(out: str, exclude_preset: str | None = "core18", every: int = 1, dataset: str | None = None) -> dict:
    rows = prompts.load_prompts(dataset)
    excluded = {r["id"] for r in prompts.select(rows, preset=exclude_preset)} if exclude_preset else set()
    keep = [r for r in rows if r["id"] not in excluded][:: max(every, 1)]
    with open(out, "w") as f:
        for r in keep:
            f.write(json.dumps({"question_id": r["id"], "category": r["category"], "turns": [r["prompt"]]}) + "\n")
    return {"prompts": len(keep), "excluded_prompt_ids": sorted(excluded)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--exclude-preset", default="core18")
    ap.add_argument("--max-chars", type=int, default=25_000_000)
    ap.add_argument("--dataset")
    ap.add_argument("--prompts-only", action="store_true", help="write training prompts (no code corpus)")
    ap.add_argument("--every", type=int, default=1, help="with --prompts-only: keep every N-th prompt")
    a = ap.parse_args(argv)
    if a.prompts_only:
        print(json.dumps(write_prompts(a.out, a.exclude_preset or None, a.every, a.dataset)))
    else:
        print(json.dumps(write_corpus(a.out, a.exclude_preset or None, a.max_chars, a.dataset)))


if __name__ == "__main__":
    main()
