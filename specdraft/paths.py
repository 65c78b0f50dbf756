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
3. else nothing was measured: the curves of ``DEFAULT_PATHS`` are measured now (about a minute per
   path, once per model and CPU kind) and kept.

The file: ``$SPECDRAFT_HOME/paths/<model>__<cpu key>.json``, {"model", "cpu", "curves": {path: {n: ms}},
"pick": {"path", "tokens_per_s", "tried": [...]}}.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, SpecDraftError

CURVE_TOKENS = (1, 4, 8, 16)
DEFAULT_PATHS = ("hf", "llama", "openvino")  # what --backend auto measures when nothing was


@dataclass(frozen=True)
class ModelPath:
    backend: str
    variant: str = ""  # a suffix of the target's name that the backend reads: w8a8 on hf, Q4_0 on llama

    @classmethod
    def parse(cls, text: str) -> "ModelPath":
        from .models.backends import BACKENDS

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
    from .costs import cpu_key
    from .models.catalog import home

    return home() / "paths" / f"{model.replace('/', '-')}__{cpu_key()}.json"


def read(model: str) -> dict:
    f = file_for(model)
    try:
        doc = json.loads(f.read_text()) if f.is_file() else {}
    except json.JSONDecodeError:
        doc = {}  # a torn write: measured again
    return doc if isinstance(doc, dict) else {}


def write(model: str, **fields) -> Path:
    """Merge ``fields`` ("curves" merges per path) into the model's file for this CPU kind."""
    from .costs import cpu_name

    doc = read(model)
    curves = {**doc.get("curves", {}), **fields.pop("curves", {})}
    doc.update(model=model, cpu=cpu_name(), curves=curves, **fields)
    f = file_for(model)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(f)
    return f


def measure_curves(model: str, paths: list[str], dtype: str = "bfloat16", say=print, fail=None) -> dict[str, dict[int, float]]:
    """ms per forward of CURVE_TOKENS tokens after a 60-token context on each path (one loaded at a
    time); a path that cannot run here goes to ``fail(path, message)`` (default: said) and is skipped.
    Kept in the model's file."""
    from .costs import measure_costs
    from .models.backends import load_model

    curves = {}
    for text in paths:
        p = ModelPath.parse(text)
        t0 = time.time()
        try:
            m = load_model(p.target(model), dtype, backend=p.backend)
            measure_costs(m, [1, 16], repeats=2)  # the first forwards of a process pay for kernel set-up
            c = measure_costs(m, list(CURVE_TOKENS), repeats=3)
        except (SpecDraftError, RuntimeError, OSError) as e:
            (fail or (lambda path, msg: say(f"{path}: cannot run here: {msg}")))(text, str(e))
            continue
        del m
        curves[text] = c
        say(f"{text:11s} {c[1]:6.0f} ms | " + " | ".join(f"{c[n] / c[1]:.2f}x" for n in CURVE_TOKENS[1:])
            + f"   ({time.time() - t0:.0f} s)")
    if curves:
        write(model, curves={k: {str(n): v for n, v in c.items()} for k, c in curves.items()})
    return curves


def curves_of(doc: dict) -> dict[str, dict[int, float]]:
    """The file's curves with int token counts (JSON keeps them as strings)."""
    return {k: {int(n): float(v) for n, v in c.items()} for k, c in doc.get("curves", {}).items()}


def fastest_one_token(curves: dict[str, dict[int, float]]) -> str:
    return min(curves, key=lambda k: curves[k][1])


def resolve(model: str, dtype: str = "bfloat16", say=None) -> tuple[str, str]:
    """``--backend auto`` for ``model``: -> (the target name to load, its backend); says which and why."""
    from .models import catalog

    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    if model not in catalog.MODELS:  # (a NAME:VARIANT is one path already)
        raise ConfigError(f"--backend auto chooses among a catalog model's paths (`specdraft models list`); "
                          f"{model!r} is not one: name a backend (--backend hf | llama | openvino)")
    doc = read(model)
    if doc.get("pick"):
        p = ModelPath.parse(doc["pick"]["path"])
        why = f"`specdraft autotune --paths` measured it fastest here ({doc['pick']['tokens_per_s']:.2f} tok/s)"
    else:
        curves = curves_of(doc)
        if not curves:
            say(f"backend auto: measuring {', '.join(DEFAULT_PATHS)} for {model} on this CPU (once; kept in "
                f"{file_for(model)})")
            curves = measure_curves(model, list(DEFAULT_PATHS), dtype, say=lambda s: say("  " + s))
            if not curves:
                raise ConfigError(f"--backend auto: no backend could run {model} here")
        p = ModelPath.parse(fastest_one_token(curves))
        why = ("the cheapest one-token forward of the measured paths (`specdraft autotune --paths` measures "
               "whole requests)")
    say(f"backend auto: --backend {p.backend} --target {p.target(model)}: {why}")
    return p.target(model), p.backend
