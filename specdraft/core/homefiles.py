"""The JSON files this project writes under ``$SPECDRAFT_HOME`` (measured paths, probe verdicts, quantized
variants) and elsewhere (bench results), read back through a schema: a file that is not what this project wrote (torn,
edited, another version's) is one clear error naming the file and its first wrong value, not a traceback wherever a
field is used. A schema is a function (value, where) -> what is wrong, or None; the helpers below build them."""

from __future__ import annotations

import json
import math
import os
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from .errors import ConfigError
from .jsonl import read_json_file

Schema = Callable[[object, str], "str | None"]
MAX_BYTES = 16 << 20  # none of these files is near this; a larger one is not ours


class HomeFileError(ConfigError):
    pass


def of(ok: Callable[[object], bool], what: str) -> Schema:
    return lambda v, at: None if ok(v) else f"{at or 'the document'} must be {what}, got {show(v)}"


def show(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 40 else s[:37] + "..."


ANY: Schema = lambda v, at: None  # noqa: E731
TEXT = of(lambda v: isinstance(v, str), "a string")
BOOL = of(lambda v: isinstance(v, bool), "a boolean")
NUMBER = of(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a finite number")
POSITIVE = of(
    lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
    "a positive number",
)


def nullable(schema: Schema) -> Schema:
    return lambda v, at: None if v is None else schema(v, at)


def items(schema: Schema) -> Schema:
    """A list of ``schema``."""

    def check(v, at):
        if not isinstance(v, list):
            return f"{at} must be a list, got {show(v)}"
        return next((p for i, x in enumerate(v) if (p := schema(x, f"{at}[{i}]"))), None)

    return check


def obj(
    fields: dict[str, Schema], required: tuple[str, ...] = (), keys: Schema | None = None, values: Schema = ANY
) -> Schema:
    """An object with ``fields`` (``required`` among them); other keys only with ``keys`` (a schema of the key
    itself), their values ``values``."""

    def check(v, at):
        if not isinstance(v, dict):
            return f"{at or 'the document'} must be an object, got {show(v)}"
        for k in required:
            if k not in v:
                return f"{at or 'the document'} has no {json.dumps(k)}"
        for k, x in v.items():
            where = f"{at}[{json.dumps(k)}]" if at else k
            if k in fields:
                problem = fields[k](x, where)
            elif keys is None:
                problem = f"{where} is not a key of this file"
            else:
                problem = keys(k, f"the key {where}") or values(x, where)
            if problem:
                return problem
        return None

    return check


def read_json(
    path: Path,
    schema: Schema,
    what: str,
    advice: str = "delete it and it is written again",
    max_bytes: int | None = MAX_BYTES,
):
    """The document in ``path`` (None when there is none), checked against ``schema``; else a HomeFileError:
    "<what> <path>: <what is wrong>; <advice>" (by default: delete it, it is measured / written again)."""

    def bad(problem: str) -> HomeFileError:
        return HomeFileError(f"{what} {path}: {problem}; {advice}")

    if not path.exists() and not path.is_symlink():
        return None
    try:
        doc = read_json_file(path, max_bytes)
    except ValueError as e:
        raise bad(str(e)) from None
    problem = schema(doc, "")
    if problem:
        raise bad(problem)
    return doc


def check_writable(folder: Path, what: str) -> None:
    """A HomeFileError unless files can be written in ``folder`` (made if missing): said before measuring what
    would be kept there, not after."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as e:
        raise HomeFileError(
            f"cannot write {what} in {folder}: {e.strerror or e} (set SPECDRAFT_HOME to a writable directory)"
        ) from None


def private_temp(path: Path, suffix: str = ".tmp") -> Path:
    """A temporary name beside ``path`` that no other writer uses (two writers at once each rename a whole
    file of their own over ``path``; neither finds its temporary file renamed away)."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}{suffix}")


def write_json(path: Path, doc, indent: int | None = 1) -> None:
    """``doc`` into ``path`` whole or not at all (a private temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_temp(path)
    try:
        tmp.write_text(json.dumps(doc, indent=indent))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def locked(path: Path):
    """Held by one process (or thread) at a time: an exclusive lock on the file ``path`` (made if missing), for a
    read-modify-write of a file many commands may update at once, or work a second caller should wait for."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
