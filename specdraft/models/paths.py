"""Which backend and weights a model runs on here: ``--backend auto``.

A *path* is a backend and the variant of the target's weights it reads: ``hf`` (the dense weights in
``--dtype``), ``hf:w8a8``, ``llama`` (the model's GGUF file), ``llama:Q4_0`` (a variant made by
``specdraft models quantize``), ``openvino``, ``openvino:Q4_0``. ``--backend auto`` takes, in order:

1. the pick ``specdraft autotune --paths`` made for this model on this CPU kind: each path decoded the
   calibration prompts with ``auto`` and plainly, and the fastest measured tokens/s won (the workload's
   acceptance is in that figure);
2. else the cost curves ``specdraft doctor`` measured for this model here: the cheapest one-token
   forward. ``auto`` never runs much slower than plain decoding on its path, and without the
   workload's acceptance that floor is all a curve can promise;
3. else nothing was measured: the curves of each backend's first path (``Backend.paths``) are measured now (about a minute per
   path, once per model and CPU kind) and kept.

The file: ``$SPECDRAFT_HOME/paths/<model>__<cpu key>.json``, {"model", "cpu", "curves": {path: {n: ms}},
"pick": {"path", "tokens_per_s", "tried": [...]}}.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..core import homefiles
from ..core.errors import ConfigError, SpecDraftError

CURVE_TOKENS = (1, 4, 8, 16)


@dataclass(frozen=True)
class ModelPath:
    backend: str
    variant: str = ""  # a suffix of the target's name that the backend reads: w8a8 on hf, Q4_0 on llama

    @classmethod
    def parse(cls, text: str) -> "ModelPath":
        from .backends import BACKENDS

        backend, _, variant = text.strip().partition(":")
        if backend not in BACKENDS:
            raise ConfigError(f"path {text!r}: unknown backend {backend!r}; a path is BACKEND or BACKEND:VARIANT "
                              f"(e.g. llama:Q4_0, hf:w8a8) with BACKEND one of {', '.join(BACKENDS)}")
        return cls(backend, variant)

    def target(self, model: str) -> str:
        return f"{model}:{self.variant}" if self.variant else model

    def __str__(self) -> str:
        return f"{self.backend}:{self.variant}" if self.variant else self.backend


def file_for(model: str) -> Path:
    from .cost_curve import cpu_key
    from .catalog import home

    return home() / "paths" / f"{model.replace('/', '-')}__{cpu_key()}.json"


def _path_text(v, at) -> str | None:
    """A path's text (BACKEND[:VARIANT] of a known backend)."""
    if not isinstance(v, str):
        return f"{at} must be a path such as 'llama:Q4_0', got {homefiles.show(v)}"
    try:
        ModelPath.parse(v)
    except ConfigError as e:
        return f"{at}: {str(e).split(';')[0]}"
    return None


_CURVE = homefiles.obj({}, required=("1", "8"),  # what --backend auto and doctor read: 1 token, and 8 against it
                       # ASCII digits only: "²".isdigit() is True, yet int("²") raises (curves_of reads int(n))
                       keys=homefiles.of(lambda k: k.isascii() and k.isdigit(), "a token count"),
                       values=homefiles.POSITIVE)
SCHEMA = homefiles.obj({  # what write() keeps: ms per forward of n tokens per path; autotune --paths' pick
    "model": homefiles.TEXT, "cpu": homefiles.TEXT,
    "curves": homefiles.obj({}, keys=_path_text, values=_CURVE),
    "pick": homefiles.obj({"path": _path_text, "tokens_per_s": homefiles.POSITIVE,
                           "tried": homefiles.items(homefiles.obj({}, keys=homefiles.TEXT)),
                           "prompts": homefiles.items(homefiles.ANY), "sampling": homefiles.obj({}, keys=homefiles.TEXT)},
                          required=("path", "tokens_per_s")),
})


def read(model: str) -> dict:
    """The model's file for this CPU kind ({} when there is none), checked against SCHEMA: a bad one is an
    error naming the file and what is wrong in it (not measured again behind the user's back: deleting it is)."""
    return homefiles.read_json(file_for(model), SCHEMA, "the paths file") or {}


def check_writable(model: str) -> dict:
    """Before measuring: the model's file as read() reads it, and an error now if it could not be written."""
    doc = read(model)
    homefiles.check_writable(file_for(model).parent, "the paths file")
    return doc


def write(model: str, **fields) -> Path:
    """Merge ``fields`` ("curves" merges per path) into the model's file for this CPU kind."""
    from .cost_curve import cpu_name

    doc = check_writable(model)
    curves = {**doc.get("curves", {}), **fields.pop("curves", {})}
    doc.update(model=model, cpu=cpu_name(), curves=curves, **fields)
    f = file_for(model)
    homefiles.write_json(f, doc)
    return f


def measure_curves(model: str, paths: list[str], dtype: str | None = None, say=print, fail=None,
                   repeats: int = 3) -> dict[str, dict[int, float]]:
    """ms per forward of CURVE_TOKENS tokens after a 60-token context on each path (one loaded at a
    time), the median of ``repeats``; a path that cannot run here goes to ``fail(path, message)``
    (default: said) and is skipped. Kept in the model's file."""
    from .cost_curve import measure_costs
    from .backends import load_model

    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:  # other processes' threads stall a backend's own (llama.cpp's most)
        say(f"note: load average {load:.1f} on {cores} cores: other work shares this CPU, so these costs may be "
            f"off (`specdraft doctor` measures again)")
    curves = {}
    for text in paths:
        p = ModelPath.parse(text)
        t0 = time.time()
        try:
            m = load_model(p.target(model), dtype, backend=p.backend)
            measure_costs(m, [1, CURVE_TOKENS[-1]], repeats=1)  # the first forwards of a process pay for kernel set-up
            c = measure_costs(m, list(CURVE_TOKENS), repeats=repeats)
        except (SpecDraftError, RuntimeError, OSError) as e:
            (fail or (lambda path, msg: say(f"{path}: cannot run here: {msg}")))(text, str(e))
            continue
        del m
        curves[text] = c
        say(f"{text:11s} {c[1]:6.0f} ms | " + " | ".join(f"{n}: {c[n] / c[1]:.2f}x" for n in CURVE_TOKENS[1:])
            + f"   ({time.time() - t0:.0f} s)")
    if curves:
        write(model, curves={k: {str(n): v for n, v in c.items()} for k, c in curves.items()})
    return curves


def curves_of(doc: dict) -> dict[str, dict[int, float]]:
    """The file's curves with int token counts (JSON keeps them as strings)."""
    return {k: {int(n): float(v) for n, v in c.items()} for k, c in doc.get("curves", {}).items()}


def fastest_one_token(curves: dict[str, dict[int, float]]) -> str:
    return min(curves, key=lambda k: curves[k][1])


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Allowed:
    """The backends ``--backend auto`` may take a path on (those that run the method and honour every option
    given); ``because`` says what narrowed them, in auto's line."""
    backends: tuple[str, ...] | None = None  # None: every backend
    because: tuple[str, ...] = ()  # e.g. ("runs this method", "honours --dtype float32")

    def reason(self) -> str:
        return " and ".join(self.because) or "is allowed"


def allowed_for(method_backends: tuple[str, ...] | None, needs: list, draft_backend: str | None) -> Allowed:
    """What ``--backend auto`` may take for the target: the backends the method runs on (None: any) that honour
    every option given (``backends.option_needs``) which the target's backend answers for: a draft's, when the
    draft follows the target's backend (``draft_backend`` None: so it does, or there is no draft); --dtype,
    unless the draft's backend takes it."""
    from .backends import BACKENDS

    names, because = set(method_backends or BACKENDS), []
    if names != set(BACKENDS):
        because.append("runs this method")
    for n in needs:
        drafts_take_it = n.whose == "draft" or (n.whose == "either" and draft_backend in n.backends)
        if draft_backend is not None and drafts_take_it:
            continue  # the draft's own backend answers for it (backends.check_named)
        names &= set(n.backends)
        because.append(f"honours {n.option}")
    if not names:
        raise ConfigError(f"--backend auto: no backend {' and '.join(because)}")
    return Allowed(tuple(b for b in BACKENDS if b in names), tuple(because))


def ranked(model: str, dtype: str | None = None, say=None, allowed: Allowed = Allowed()) -> list[tuple[ModelPath, str]]:
    """``--backend auto``'s candidates for ``model``, best first, each with why it ranks there; only paths
    on ``allowed``'s backends count. Measures the curves when none were kept."""
    from . import catalog
    from .backends import BACKENDS

    say = say or _say
    if model not in catalog.MODELS:  # (a NAME:VARIANT is one path already)
        raise ConfigError(f"--backend auto chooses among a catalog model's paths (`specdraft models list`); "
                          f"{model!r} is not one: name a backend (--backend {' | '.join(BACKENDS)})")
    names = [b for b in BACKENDS if allowed.backends is None or b in allowed.backends]
    if len(names) == 1:  # nothing to measure: its dense weights (a variant's would not be in --dtype)
        return [(ModelPath(names[0]), f"the only backend that {allowed.reason()}")]
    doc = read(model)
    out = []
    pick = doc.get("pick")
    among = f" (of the paths on backends that {allowed.reason()})" if allowed.because else ""
    if pick and ModelPath.parse(pick["path"]).backend in names:
        out.append((ModelPath.parse(pick["path"]),
                    f"`specdraft autotune --paths` measured it fastest here ({pick['tokens_per_s']:.2f} tok/s){among}"))
    curves = {k: c for k, c in curves_of(doc).items() if ModelPath.parse(k).backend in names}
    if not out and not curves:
        check_writable(model)
        todo = [BACKENDS[b].paths[0] for b in names if BACKENDS[b].paths]  # what auto measures when nothing was
        say(f"backend auto: measuring {', '.join(todo)} for {model} on this CPU (once; kept in "
            f"{file_for(model)})")
        curves = measure_curves(model, todo, dtype, say=lambda s: say("  " + s), repeats=1)  # doctor: 3 repeats
        if not curves:
            raise ConfigError(f"--backend auto: no backend could run {model} here")
    why = ("the cheapest one-token forward of the measured paths (`specdraft autotune --paths` measures whole "
           f"requests){among}")
    out += [(ModelPath.parse(k), why) for k in sorted(curves, key=lambda k: curves[k][1])]
    unique = {}
    for p, why in out:  # the pick is also among the curves
        unique.setdefault(str(p), (p, why))
    return list(unique.values())


def load_fastest(model: str, dtype: str | None = None, say=None, allowed: Allowed = Allowed()):
    """The model on the best of ``ranked``'s paths that loads here -> (model, ModelPath); a path that
    fails to load (a backend missing on this machine) is said and the next one taken."""
    from .backends import load_model

    say = say or _say
    for p, why in ranked(model, dtype, say, allowed):
        try:
            m = load_model(p.target(model), dtype, backend=p.backend)
        except (SpecDraftError, RuntimeError, OSError, ImportError) as e:
            say(f"backend auto: {p} cannot load here ({e}); taking the next measured path")
            continue
        say(f"backend auto: --backend {p.backend} --target {p.target(model)}: {why}")
        return m, p
    raise ConfigError(f"--backend auto: none of {model}'s measured paths loads here")


def resolve(model: str, dtype: str | None = None, say=None, allowed: Allowed = Allowed()) -> tuple[str, str]:
    """``--backend auto`` for ``model`` without loading it: -> (the target name to load, its backend)."""
    p, why = ranked(model, dtype, say, allowed)[0]
    (say or _say)(
        f"backend auto: --backend {p.backend} --target {p.target(model)}: {why}")
    return p.target(model), p.backend
