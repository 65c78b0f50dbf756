"""The constraints of configuration fields, declared per field and applied by one loop.

A field declares its constraints in its metadata (``field_with(default, Int(min=1), ...)``, ``param`` for a
method's own parameter): small callables, each ``check(name, value)`` returning the (normalized) value or
raising a ConfigError that names the field. ``checked`` applies them all and returns a checked copy (the
object itself is never changed), then ``check_rules`` the cross-field rules. SamplingParams, SpecConfig
(core/config.py) and the methods' parameters (core/methods.py) are declared this way.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import ConfigError

# Upper bounds on what one request may ask a drafter to hold (a server takes specs from clients): a
# draft at most MAX_DRAFT deep (the cost-aware schedule times a forward of k + 1 tokens), a token tree
# of at most MAX_TREE_NODES nodes (its attention mask is nodes^2; llama.cpp gives each leaf one of its
# 256 sequence ids), Token Recycling's table at most MAX_RECYCLE_TOPK successors per token ([V, top_k]).
MAX_DRAFT = 64
MAX_TREE_NODES = 256
MAX_RECYCLE_TOPK = 16
MAX_NGRAM = 32


# --- constraints: each is called as check(name, value) and returns the (normalized) value or raises --
def and_list(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Int:
    """An integer >= ``min`` (no bound when None); ``what`` explains the field in messages, ``note``
    follows the bound (e.g. "0 = disabled")."""

    min: int | None = None
    what: str = ""
    note: str = ""
    optional: bool = False
    max: int | None = None

    def __call__(self, name, v):
        if v is None and self.optional:
            return v
        label = f"{name} ({self.what})" if self.what else name
        if not is_int(v):
            raise ConfigError(f"{label} must be an integer, got {v!r}")
        if self.min is not None and v < self.min:
            raise ConfigError(f"{label} must be >= {self.min}{f' ({self.note})' if self.note else ''}, got {v}")
        if self.max is not None and v > self.max:
            raise ConfigError(f"{label} must be <= {self.max}, got {v}")
        return v


@dataclass(frozen=True)
class Number:
    """A real number (returned as float) in the interval from ``min`` to ``max``, each end closed
    unless ``*_open``; ``finite`` also rules out infinity (NaN never passes)."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    finite: bool = False
    note: str = ""

    def __call__(self, name, v):
        if not is_num(v):
            raise ConfigError(f"{name} must be a number, got {v!r}")
        ok = not math.isnan(v) and not (self.finite and math.isinf(v))
        if self.min is not None:
            ok = ok and (v > self.min if self.min_open else v >= self.min)
        if self.max is not None:
            ok = ok and (v < self.max if self.max_open else v <= self.max)
        if not ok:
            if self.min is not None and self.max is not None:
                rng = f"in {'(' if self.min_open else '['}{self.min:g}, {self.max:g}{')' if self.max_open else ']'}"
            else:
                bound = self.min if self.max is None else self.max
                op = (">" if self.min_open else ">=") if self.max is None else ("<" if self.max_open else "<=")
                rng = f"{'a finite number ' if self.finite else ''}{op} {bound:g}"
            raise ConfigError(f"{name} must be {rng}{f' ({self.note})' if self.note else ''}, got {v}")
        return float(v)


@dataclass(frozen=True)
class Choice:
    """One of ``choices`` (a tuple, or a dict whose keys are read when checking, e.g. the live
    method registry); ``optional``: None allowed, ``note`` ends the message."""

    choices: Any
    what: str = ""
    optional: bool = False
    note: str = ""

    def __call__(self, name, v):
        if v is None and self.optional:
            return v
        if not (isinstance(v, str) and v in self.choices):
            raise ConfigError(
                f"unknown {self.what or name} {v!r}; choose one of: {', '.join(self.choices)}"
                + (f" {self.note}" if self.note else "")
            )
        return v


@dataclass(frozen=True)
class IntList:
    """A list (a tuple is accepted and made a list) of integers >= ``min`` (any integer when None),
    non-empty unless ``nonempty`` is False."""

    min: int | None = 1
    nonempty: bool = True
    what: str = ""
    max: int | None = None  # each integer's bound
    max_len: int | None = None

    def __call__(self, name, v):
        if isinstance(v, tuple):
            v = list(v)
        if (
            not isinstance(v, list)
            or (self.nonempty and not v)
            or not all(
                is_int(b) and (self.min is None or b >= self.min) and (self.max is None or b <= self.max) for b in v
            )
        ):
            kind = (
                "integers" + (f" >= {self.min}" if self.min is not None else "")
                if self.max is None
                else f"integers in [{self.min}, {self.max}]"
            )
            raise ConfigError(
                f"{name} must be a {'non-empty ' if self.nonempty else ''}list of {kind}"
                f"{f' ({self.what})' if self.what else ''}, got {v!r}"
            )
        if self.max_len is not None and len(v) > self.max_len:
            raise ConfigError(f"{name} has {len(v)} entries; at most {self.max_len}")
        return v


@dataclass(frozen=True)
class StrList:
    """A list of non-empty strings (a single string becomes a list of one), at most ``max_len``."""

    max_len: int | None = None

    def __call__(self, name, v):
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ConfigError(f"{name} must be a list of non-empty strings, got {v!r}")
        if self.max_len is not None and len(v) > self.max_len:
            raise ConfigError(f"{name} has {len(v)} entries; at most {self.max_len}")
        return v


@dataclass(frozen=True)
class Bool:
    def __call__(self, name, v):
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false, got {v!r}")
        return v


@dataclass(frozen=True)
class OptStr:
    """None, or a non-empty string (``what``: what the string is, e.g. a path)."""

    what: str = "a string"

    def __call__(self, name, v):
        if v is not None and (not isinstance(v, str) or not v):
            raise ConfigError(f"{name} must be {self.what} (string) or null, got {v!r}")
        return v


@dataclass(frozen=True)
class PathArg(OptStr):
    """None, or the path of a file or directory its method reads: a path-valued spec key, which a server takes
    from its operator only, by a name (``serve --resource FIELD:NAME=PATH``; config.py ``PATH_FIELDS``)."""

    what: str = "a path"


@dataclass(frozen=True)
class TokenBias:
    """{token id: bias}, OpenAI's ``logit_bias``: ids may arrive as JSON strings ("50256"); biases are
    numbers in [-100, 100]. Normalized to {int: float}."""

    def __call__(self, name, v):
        if not isinstance(v, dict):
            raise ConfigError(f"{name} must be an object mapping token ids to biases, got {v!r}")
        out = {}
        for k, b in v.items():
            # ASCII digits only: "²".isdigit() is True, yet int("²") raises (found by tests/test_fuzz.py)
            tid = int(k) if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit() else k
            if not is_int(tid) or tid < 0:
                raise ConfigError(f"{name} keys must be token ids (integers >= 0), got {k!r}")
            out[tid] = Number(min=-100, max=100)(f"{name}[{k}]", b)
        return out


@dataclass(frozen=True)
class JsonSchema:
    """None, or a JSON schema: an object, or a string holding one."""

    def __call__(self, name, v):
        if v is None:
            return v
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ConfigError(f"{name} is not valid JSON: {e}") from None
        if not isinstance(v, dict):
            raise ConfigError(f"{name} must be a JSON schema (a JSON object), got {type(v).__name__}")
        return v


@dataclass(frozen=True)
class TreeSize:
    """A branching list (children per node at each depth) making at most ``max_nodes`` nodes in at
    most ``max_depth`` depths."""

    max_depth: int
    max_nodes: int

    def __call__(self, name, v):
        if len(v) > self.max_depth:
            raise ConfigError(f"{name} has {len(v)} depths; at most {self.max_depth}")
        n, width = 0, 1
        for b in v:
            width *= b
            n += width
        if n > self.max_nodes:
            raise ConfigError(f"{name} {v} makes a tree of {n} nodes; at most {self.max_nodes}")
        return v


@dataclass(frozen=True)
class Choices:
    """Medusa-style tree choices: None, or a list of paths of child ranks, prefix-closed, ranks contiguous."""

    def __call__(self, name, v):
        if v is not None:
            check_choices(v)
            if len(v) > MAX_TREE_NODES or max(len(c) for c in v) > MAX_DRAFT:
                raise ConfigError(
                    f"{name} makes a tree of {len(v)} nodes, {max(len(c) for c in v)} deep; at most "
                    f"{MAX_TREE_NODES} nodes, {MAX_DRAFT} deep"
                )
        return v


def check_choices(choices) -> None:
    """Medusa-style choices: a list of paths of child ranks, prefix-closed, ranks contiguous."""
    if not isinstance(choices, list) or not choices:
        raise ConfigError(f"tree_choices must be a non-empty list of paths like [[0], [1], [0, 0]], got {choices!r}")
    paths = set()
    for c in choices:
        if not isinstance(c, list) or not c or not all(is_int(r) and r >= 0 for r in c):
            raise ConfigError(f"each tree_choices entry must be a non-empty list of ranks >= 0, got {c!r}")
        paths.add(tuple(c))
    for c in paths:
        if len(c) > 1 and c[:-1] not in paths:
            raise ConfigError(f"tree_choices is not prefix-closed: {list(c)} needs {list(c[:-1])}")
        if c[-1] > 0 and c[:-1] + (c[-1] - 1,) not in paths:
            raise ConfigError(f"tree_choices skips a rank: {list(c)} needs {list(c[:-1] + (c[-1] - 1,))}")


def field_with(default, *checks, **meta):
    """A dataclass field with its constraints (``checks``, applied in order) and any other metadata. A list
    or dict default is copied per instance."""
    md = {"checks": checks, **meta}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=md)
    return field(default=default, metadata=md)


param = field_with  # a method's own parameter, declared in its ``params`` dataclass (core/methods.py)

T = TypeVar("T")


def checked(obj: T) -> T:
    """A copy of dataclass ``obj`` with every field's constraints applied, in declaration order (values may
    be normalized, e.g. ints to floats, a tuple to a list); ``obj`` is left as it was."""
    values = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        for check in f.metadata.get("checks", ()):
            v = check(f.name, v)
        values[f.name] = v
    return dataclasses.replace(obj, **values)  # type: ignore[type-var]


def is_checked(obj) -> bool:
    """Whether ``obj`` came out of a ``validate`` unchanged since (``mark_checked``): checked values pass through
    every later layer without being checked again."""
    return obj.__dict__.get("_checked", False)


def mark_checked(obj: T) -> T:
    object.__setattr__(obj, "_checked", True)  # (frozen dataclasses too; a field set later clears it: Mutable)
    return obj


class Mutable:
    """Mixin of a mutable checked dataclass: setting a field makes it unchecked again."""

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        self.__dict__.pop("_checked", None)


def check_rules(obj, rules) -> None:
    """Cross-field rules: (ok(obj) -> bool, message(obj) -> str) pairs."""
    for ok, message in rules:
        if not ok(obj):
            raise ConfigError(message(obj))


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default
