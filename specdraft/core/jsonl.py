"""Reading jsonl files with precise errors (file, line, what is wrong): one reader for the bench
dataset, datastore corpora and training prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import SpecDraftError


def iter_jsonl(path: str | Path, error: type[SpecDraftError] = SpecDraftError,
               what: str = "file") -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for every non-blank line; raise ``error`` naming the file and
    line for unreadable files, invalid JSON and lines that are not JSON objects."""
    p = Path(path)
    try:
        f = p.open()
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror}") from None
    with f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{p}:{i}: not valid JSON: {e}") from None
            if not isinstance(r, dict):
                raise error(f"{p}:{i}: expected a JSON object, got {type(r).__name__}")
            yield i, r
