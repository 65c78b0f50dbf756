"""Reading JSON and jsonl files with precise errors (file, line, what is wrong): one parser for the bench
dataset, datastore corpora, training prompts, the files under $SPECDRAFT_HOME and head configs, and
``AppendedJsonl`` for the files training appends to row by row."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

from .errors import SpecDraftError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff: half of a pair, or alone


def decode_json(raw: bytes):
    """The JSON document in ``raw``; a ValueError saying what is wrong (not UTF-8, not JSON, nested too
    deeply, a lone surrogate escape: text no tokenizer or encoder takes) otherwise."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg}, line {e.lineno})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):  # a lone surrogate can only come from an escape: the bytes decoded strictly
        try:
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate escape (\\ud800-\\udfff), not Unicode text") from None
    return doc


def read_json_file(path: Path, max_bytes: int | None = 16 << 20):
    """The JSON document in the file ``path``; a ValueError saying what is wrong otherwise (also: not a
    regular file, larger than ``max_bytes`` (None: any size), unreadable)."""
    if not path.is_file():
        raise ValueError("not a regular file")
    if max_bytes is not None and path.stat().st_size > max_bytes:
        raise ValueError(f"{path.stat().st_size} bytes, more than this project writes")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot be read ({e.strerror})") from None
    return decode_json(raw)


def _object(p: Path, i: int, line: bytes, error: type[SpecDraftError]) -> dict:
    try:
        r = decode_json(line)
    except ValueError as e:
        raise error(f"{p}:{i}: {e}") from None
    if not isinstance(r, dict):
        raise error(f"{p}:{i}: expected a JSON object, got {type(r).__name__}")
    return r


def iter_jsonl(
    path: str | Path, error: type[SpecDraftError] = SpecDraftError, what: str = "file"
) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for every non-blank line; raise ``error`` naming the file and
    line for unreadable files, invalid JSON and lines that are not JSON objects."""
    p = Path(path)
    try:
        f = p.open("rb")
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror}") from None
    with f:
        try:
            for i, line in enumerate(f, 1):
                if line.strip():
                    yield i, _object(p, i, line, error)
        except OSError as e:  # a directory opens, and fails on the first read
            raise error(f"cannot read {what} {p}: {e.strerror}") from None


class AppendedJsonl:
    """A jsonl file this program appends to a batch of rows at a time, run after run (training data that
    grows). ``rows``: its complete lines, read on opening. A stopped run can leave a torn last line (no
    newline): the only damage appending does; it is left out, and cut off before the next append, so
    that the rows written after it start on a line of their own and stay readable. Any other bad line,
    or a row without the ``need``ed fields, is an error naming the file and line."""

    def __init__(self, path: Path, need: tuple[str, ...] = ()):
        self.path = Path(path)
        try:
            raw = self.path.read_bytes() if self.path.exists() else b""
        except OSError as e:
            raise SpecDraftError(f"cannot read {self.path}: {e.strerror}") from None
        self.complete = raw.rfind(b"\n") + 1  # bytes up to the end of the last complete line
        self.rows = []
        for i, line in enumerate(raw[: self.complete].split(b"\n")[:-1], 1):
            if not line.strip():
                continue
            r = _object(self.path, i, line, SpecDraftError)
            missing = [k for k in need if k not in r]
            if missing:
                raise SpecDraftError(f"{self.path}:{i}: no {', '.join(missing)} (not a row this program wrote)")
            self.rows.append(r)

    def append(self, rows: list[dict]) -> None:
        """Write ``rows`` after the complete lines, durably (a crash after this keeps them)."""
        with open(self.path, "ab") as f:
            if f.tell() != self.complete:
                f.truncate(self.complete)
            f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
            f.flush()
            os.fsync(f.fileno())
            self.complete = f.tell()
        self.rows += rows
