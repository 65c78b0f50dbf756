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
3. else nothing was measured: the curves of each backend's first path (``Backend.paths``) are measured now (about a
   minute per path, once per model and CPU kind) and kept.

Given a request's shape (``RequestShape``: its prompt's tokens and the tokens it may generate; the CLI's
``generate`` knows both, the library takes ``SpecDecoder.load(..., shape=)``), ``--backend auto`` takes the
path fastest end to end for it instead: each path's measured prefill of that prompt plus that many tokens
at its decoding speed (``PathCost``). A long prompt with a short answer goes where prefill is cheap, a
short prompt with a long answer where decoding is. That needs every candidate path's prefill costs, which
files written before they were measured lack: then the rules above choose, and say so (`specdraft doctor`
measures them).

Devices: the paths are measured on the CPU. A ``--device`` other than auto keeps the backends that run on
that kind of device (``Backend.devices``); where torch sees a CUDA GPU and the device is auto or cuda, auto
takes transformers on it (``Backend.cuda_first``) without measuring: a GPU decodes a dense model faster than
any CPU path here (not measured by this program: scripts/gpu_check.sh measures the GPU).

The file: ``$SPECDRAFT_HOME/paths/<model>__<cpu key>.json``, {"model", "cpu", "curves": {path: {n: ms}},
"prefill": {path: {prompt tokens: ms}}, "pick": {"path", "tokens_per_s", "tried": [...]}} ("prefill" and the
tried entries' "prefill_ms_per_token" and "decode_tokens_per_s" are optional: older files have none).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..core import homefiles
from ..core.device import AUTO, cuda_count, device_kind
from ..core.errors import ConfigError, SpecDraftError
from ..core.policy import interpolate

CURVE_TOKENS = (1, 4, 8, 16)
PREFILL_TOKENS = (32, 512)  # prompt lengths whose prefill is measured (linear between, extended beyond)
# What --backend auto measures itself when nothing was kept (seconds per path; doctor measures the above)
QUICK_CURVE_TOKENS = (1, 4, 8)
QUICK_PREFILL_TOKENS = (32, 128)


@dataclass(frozen=True)
class ModelPath:
    backend: str
    variant: str = ""  # a suffix of the target's name that the backend reads: w8a8 on hf, Q4_0 on llama

    @classmethod
    def parse(cls, text: str) -> "ModelPath":
        from .backends import BACKENDS

        backend, _, variant = text.strip().partition(":")
        if backend not in BACKENDS:
            raise ConfigError(
                f"path {text!r}: unknown backend {backend!r}; a path is BACKEND or BACKEND:VARIANT "
                f"(e.g. llama:Q4_0, hf:w8a8) with BACKEND one of {', '.join(BACKENDS)}"
            )
        return cls(backend, variant)

    def target(self, model: str) -> str:
        return f"{model}:{self.variant}" if self.variant else model

    def __str__(self) -> str:
        return f"{self.backend}:{self.variant}" if self.variant else self.backend


def file_for(model: str) -> Path:
    from .catalog import home
    from .cost_curve import cpu_key

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


# ASCII digits only: "²".isdigit() is True, yet int("²") raises (curves_of reads int(n))
_TOKEN_COUNT = homefiles.of(lambda k: k.isascii() and k.isdigit(), "a token count")
_CURVE = homefiles.obj(
    {},
    required=("1", "8"),  # what --backend auto and doctor read: 1 token, and 8 against it
    keys=_TOKEN_COUNT,
    values=homefiles.POSITIVE,
)
_PREFILL = homefiles.obj({}, keys=_TOKEN_COUNT, values=homefiles.POSITIVE)
SCHEMA = homefiles.obj(
    {  # what write() keeps: ms per forward of n tokens per path; autotune --paths' pick
        "model": homefiles.TEXT,
        "cpu": homefiles.TEXT,
        "curves": homefiles.obj({}, keys=_path_text, values=_CURVE),
        "prefill": homefiles.obj({}, keys=_path_text, values=_PREFILL),
        "pick": homefiles.obj(
            {
                "path": _path_text,
                "tokens_per_s": homefiles.POSITIVE,
                "tried": homefiles.items(homefiles.obj({}, keys=homefiles.TEXT)),
                "prompts": homefiles.items(homefiles.ANY),
                "sampling": homefiles.obj({}, keys=homefiles.TEXT),
            },
            required=("path", "tokens_per_s"),
        ),
    }
)


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
    """Merge ``fields`` ("curves" and "prefill" merge per path) into the model's file for this CPU kind."""
    from .cost_curve import cpu_name

    doc = check_writable(model)
    for per_path in ("curves", "prefill"):
        if per_path in fields or per_path == "curves":
            fields[per_path] = {**doc.get(per_path, {}), **fields.get(per_path, {})}
    doc.update(model=model, cpu=cpu_name(), **fields)
    f = file_for(model)
    homefiles.write_json(f, doc)
    return f


def measure_curves(
    model: str,
    paths: list[str],
    dtype: str | None = None,
    say=print,
    fail=None,
    repeats: int = 3,
    tokens: tuple[int, ...] = CURVE_TOKENS,
    prefill_tokens: tuple[int, ...] = PREFILL_TOKENS,
) -> dict[str, dict[int, float]]:
    """ms per forward of ``tokens`` tokens after a 60-token context on each path (one loaded at a
    time), the median of ``repeats``, and ms to prefill prompts of ``prefill_tokens``; a path that cannot run
    here goes to ``fail(path, message)`` (default: said) and is skipped. Kept in the model's file."""
    from .backends import load_model
    from .cost_curve import measure_costs, measure_prefill

    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores / 2:  # other processes' threads stall a backend's own (llama.cpp's most)
        say(
            f"note: load average {load:.1f} on {cores} cores: other work shares this CPU, so these costs may be "
            f"off (`specdraft doctor` measures again)"
        )
    curves, prefill = {}, {}
    for text in paths:
        p = ModelPath.parse(text)
        t0 = time.time()
        try:
            m = load_model(p.target(model), dtype, backend=p.backend, device="cpu")  # this CPU's paths
            measure_costs(m, [1, tokens[-1]], repeats=1)  # the first forwards of a process pay for kernel set-up
            c = measure_costs(m, list(tokens), repeats=repeats)
            prefill[text] = measure_prefill(m, list(prefill_tokens), repeats=repeats)
        except (SpecDraftError, RuntimeError, OSError) as e:
            (fail or (lambda path, msg: say(f"{path}: cannot run here: {msg}")))(text, str(e))
            continue
        del m
        curves[text] = c
        say(
            f"{text:11s} {c[1]:6.0f} ms | "
            + " | ".join(f"{n}: {c[n] / c[1]:.2f}x" for n in tokens[1:])
            + " | prefill "
            + " / ".join(f"{n}: {ms:.0f} ms" for n, ms in prefill[text].items())
            + f"   ({time.time() - t0:.0f} s)"
        )
    if curves:
        write(
            model,
            curves={k: {str(n): v for n, v in c.items()} for k, c in curves.items()},
            prefill={k: {str(n): v for n, v in c.items()} for k, c in prefill.items()},
        )
    return curves


def curves_of(doc: dict) -> dict[str, dict[int, float]]:
    """The file's curves with int token counts (JSON keeps them as strings)."""
    return {k: {int(n): float(v) for n, v in c.items()} for k, c in doc.get("curves", {}).items()}


def fastest_one_token(curves: dict[str, dict[int, float]]) -> str:
    return min(curves, key=lambda k: curves[k][1])


CHARS_PER_TOKEN = 4  # a prompt's tokens, estimated before any tokenizer loads (English text and code)
CHAT_TOKENS = 30  # what a chat template adds (Qwen2.5's system turn and role markers)


@dataclass(frozen=True)
class RequestShape:
    """A request's size, as --backend auto weighs prefill against decoding: its prompt's tokens and the
    tokens it may generate (max_new_tokens)."""

    prompt_tokens: int
    new_tokens: int

    @classmethod
    def of_text(cls, text: str, new_tokens: int, chat: bool = False) -> "RequestShape":
        """A text prompt's shape before its model (and tokenizer) loads: CHARS_PER_TOKEN characters a token."""
        return cls(max(1, round(len(text) / CHARS_PER_TOKEN)) + (CHAT_TOKENS if chat else 0), new_tokens)


@dataclass(frozen=True)
class PathCost:
    """What a request costs on one path, as measured here: ms to prefill prompts of n tokens, ms per
    decoded token, and where the decoding speed comes from."""

    prefill_ms: dict[int, float]
    decode_ms: float
    decode_from: str

    def seconds(self, shape: RequestShape) -> tuple[float, float]:
        """(prefill, decoding) seconds of a request of ``shape``."""
        return interpolate(self.prefill_ms, shape.prompt_tokens) / 1000, shape.new_tokens * self.decode_ms / 1000


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def path_costs(doc: dict) -> dict[str, PathCost]:
    """Each path's PathCost where the file has both sides: prefill from doctor's "prefill" (else the prefill
    per token autotune --paths measured); decoding from autotune --paths' decode phase (the better of plain
    and auto on the calibration prompts), else doctor's one-token forward."""
    tried = {t["path"]: t for t in (doc.get("pick") or {}).get("tried", []) if isinstance(t.get("path"), str)}
    curves = curves_of(doc)
    out = {}
    for path in sorted(set(curves) | set(tried)):
        t = tried.get(path, {})
        if doc.get("prefill", {}).get(path):
            prefill = {int(n): float(v) for n, v in doc["prefill"][path].items()}
        elif _positive(t.get("prefill_ms_per_token")):
            prefill = {1: t["prefill_ms_per_token"], 1000: 1000 * t["prefill_ms_per_token"]}
        else:
            continue
        if _positive(t.get("decode_tokens_per_s")):
            out[path] = PathCost(prefill, 1000 / t["decode_tokens_per_s"], "`specdraft autotune --paths`' decode phase")
        elif path in curves:
            out[path] = PathCost(prefill, curves[path][1], "`specdraft doctor`'s one-token forward")
    return out


def by_shape(
    doc: dict, model: str, allowed: list[str], shape: RequestShape, say
) -> list[tuple["ModelPath", str]] | None:
    """The measured paths on ``allowed`` backends, fastest end to end for ``shape`` first, each with why; None
    (said) when a path lacks its prefill or decoding costs (a file written before prefill was measured)."""
    known = set(curves_of(doc)) | ({doc["pick"]["path"]} if doc.get("pick") else set())
    known = {k for k in known if ModelPath.parse(k).backend in allowed}
    costs = {k: c for k, c in path_costs(doc).items() if k in known}
    missing = sorted(known - set(costs))
    if missing or not costs:
        say(
            f"backend auto: no prefill costs kept for {', '.join(missing) or model} (`specdraft doctor --model "
            f"{model}` measures them); choosing without the request's shape"
        )
        return None
    times = {k: c.seconds(shape) for k, c in costs.items()}
    order = sorted(times, key=lambda k: sum(times[k]))

    def why(k: str) -> str:
        pre, dec = times[k]
        others = ", ".join(f"{o} {sum(times[o]):.1f} s" for o in order if o != k)
        return (
            f"{'the fastest' if k == order[0] else 'a'} path end to end for {shape.prompt_tokens} prompt tokens "
            f"and {shape.new_tokens} new tokens: about {pre + dec:.1f} s (prefill {pre:.1f} s, decoding at "
            f"{1000 / costs[k].decode_ms:.1f} tok/s, {costs[k].decode_from})" + (f"; {others}" if others else "")
        )

    return [(ModelPath.parse(k), why(k)) for k in order]


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


def allowed_for(
    method_backends: tuple[str, ...] | None, needs: list, draft_backend: str | None, device: str = AUTO
) -> Allowed:
    """What ``--backend auto`` may take for the target: the backends the method runs on (None: any) that run on
    ``device``'s kind and honour every option given (``backends.option_needs``) which the target's backend
    answers for: a draft's, when the draft follows the target's backend (``draft_backend`` None: so it does,
    or there is no draft); --dtype, unless the draft's backend takes it."""
    from .backends import BACKENDS

    names, because = set(method_backends or BACKENDS), []
    if names != set(BACKENDS):
        because.append("runs this method")
    kind = device_kind(device)
    if kind != AUTO:
        names &= {n for n, b in BACKENDS.items() if kind in b.devices}
        because.append(f"runs on --device {device}")
    for n in needs:
        drafts_take_it = n.whose == "draft" or (n.whose == "either" and draft_backend in n.backends)
        if draft_backend is not None and drafts_take_it:
            continue  # the draft's own backend answers for it (backends.check_named)
        names &= set(n.backends)
        because.append(f"honours {n.option}")
    if not names:
        raise ConfigError(f"--backend auto: no backend {' and '.join(because)}")
    return Allowed(tuple(b for b in BACKENDS if b in names), tuple(because))


def ranked(
    model: str,
    dtype: str | None = None,
    say=None,
    allowed: Allowed = Allowed(),
    shape: RequestShape | None = None,
    device: str = AUTO,
) -> list[tuple[ModelPath, str]]:
    """``--backend auto``'s candidates for ``model``, best first, each with why it ranks there; only paths
    on ``allowed``'s backends count; on a CUDA GPU (``device`` auto or cuda where torch sees one) the backend
    that runs dense weights there; with a request's ``shape``, fastest end to end for it first (by_shape)
    where every path's costs were kept. Measures the curves when none were kept."""
    from . import catalog
    from .backends import BACKENDS

    say = say or _say
    if model not in catalog.MODELS:  # (a NAME:VARIANT is one path already)
        raise ConfigError(
            f"--backend auto chooses among a catalog model's paths (`specdraft models list`); "
            f"{model!r} is not one: name a backend (--backend {' | '.join(BACKENDS)})"
        )
    names = [b for b in BACKENDS if allowed.backends is None or b in allowed.backends]
    if len(names) == 1:  # nothing to measure: its dense weights (a variant's would not be in --dtype)
        return [(ModelPath(names[0]), f"the only backend that {allowed.reason()}")]
    gpu = [b for b in names if BACKENDS[b].cuda_first] if device_kind(device) in (AUTO, "cuda") and cuda_count() else []
    if gpu:  # (the measured paths are CPU paths: module doc)
        return [(ModelPath(gpu[0]), "torch sees a CUDA GPU: its dense weights run there")]
    doc = read(model)
    out = []
    pick = doc.get("pick")
    among = f" (of the paths on backends that {allowed.reason()})" if allowed.because else ""
    if pick and ModelPath.parse(pick["path"]).backend in names:
        out.append(
            (
                ModelPath.parse(pick["path"]),
                f"`specdraft autotune --paths` measured it fastest here ({pick['tokens_per_s']:.2f} tok/s){among}",
            )
        )
    curves = {k: c for k, c in curves_of(doc).items() if ModelPath.parse(k).backend in names}
    if not out and not curves:
        curves = _measure_first(model, names, dtype, say)
        doc = read(model)
    if shape is not None and (fit := by_shape(doc, model, names, shape, say)):
        return fit
    why = (
        "the cheapest one-token forward of the measured paths (`specdraft autotune --paths` measures whole "
        f"requests){among}"
    )
    out += [(ModelPath.parse(k), why) for k in sorted(curves, key=lambda k: curves[k][1])]
    unique = {}
    for p, why in out:  # the pick is also among the curves
        unique.setdefault(str(p), (p, why))
    return list(unique.values())


def _measure_first(model: str, names: list[str], dtype: str | None, say) -> dict[str, dict[int, float]]:
    """Nothing kept for ``model`` here: each backend's first path measured briefly (QUICK_*: seconds a path),
    once, leaving out the paths whose weights would first be converted (minutes: ``Backend.converts``) unless
    nothing else runs; `specdraft doctor` measures every path at length."""
    from .backends import BACKENDS

    check_writable(model)
    todo = [BACKENDS[b].paths[0] for b in names if BACKENDS[b].paths]
    ready = [p for p in todo if not BACKENDS[ModelPath.parse(p).backend].converts(model)]
    if ready and ready != todo:
        later = [p for p in todo if p not in ready]
        say(
            f"backend auto: not measuring {', '.join(later)} (its weights would first be converted, minutes; "
            f"`specdraft doctor --model {model}` measures every path)"
        )
    todo = ready or todo
    say(f"backend auto: measuring {', '.join(todo)} for {model} on this CPU (once; kept in {file_for(model)})")
    curves = measure_curves(
        model,
        todo,
        dtype,
        say=lambda s: say("  " + s),
        repeats=1,
        tokens=QUICK_CURVE_TOKENS,
        prefill_tokens=QUICK_PREFILL_TOKENS,
    )
    if not curves:
        raise ConfigError(f"--backend auto: no backend could run {model} here")
    return curves


LOAD_ERRORS = (SpecDraftError, RuntimeError, OSError, ImportError)  # what a path that cannot load here raises


def load_fastest(
    model: str,
    dtype: str | None = None,
    say=None,
    allowed: Allowed = Allowed(),
    shape: RequestShape | None = None,
    device: str = AUTO,
    companion=None,
):
    """The model on the best of ``ranked``'s paths (for a request of ``shape``, if given) that loads here, on
    ``device``; a path that fails to load (a backend missing on this machine, a file
    its backend cannot read) is said and the next one taken. ``companion(model, path)``, if given, loads
    what must run beside it on that path (a draft on the target's backend): its failure also moves on to
    the next path; -> (model, ModelPath, what ``companion`` returned or None)."""
    from .backends import device_kw, load_model

    say = say or _say
    for p, why in ranked(model, dtype, say, allowed, shape, device):
        try:
            m = load_model(p.target(model), dtype, backend=p.backend, **device_kw(device))
        except LOAD_ERRORS as e:
            say(f"backend auto: {p} cannot load here ({e}); taking the next measured path")
            continue
        try:
            beside = companion(m, p) if companion is not None else None
        except LOAD_ERRORS as e:
            say(f"backend auto: {p} cannot run the draft here ({e}); taking the next measured path")
            continue
        say(f"backend auto: --backend {p.backend} --target {p.target(model)}: {why}")
        return m, p, beside
    raise ConfigError(f"--backend auto: none of {model}'s measured paths loads here")


def resolve(
    model: str,
    dtype: str | None = None,
    say=None,
    allowed: Allowed = Allowed(),
    shape: RequestShape | None = None,
    device: str = AUTO,
) -> tuple[str, str]:
    """``--backend auto`` for ``model`` without loading it: -> (the target name to load, its backend)."""
    p, why = ranked(model, dtype, say, allowed, shape, device)[0]
    (say or _say)(f"backend auto: --backend {p.backend} --target {p.target(model)}: {why}")
    return p.target(model), p.backend
