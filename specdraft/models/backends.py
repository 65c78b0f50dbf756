"""The model backends: one entry per implementation of the model interface (models/base.py).

``hf``: transformers (models/hf.py), weights in float32 / bfloat16, or weight-only int8 / int4
(``NAME:int8``, ``NAME:int4``; models/lowbit.py), every method.
``llama``: llama.cpp through llama-cpp-python (models/llama.py), GGUF files with their own
quantization (Q4_K_M, Q8_0, ...), the methods whose registry entry lists it.
``openvino``: OpenVINO (models/openvino.py), the same GGUF files converted once to its IR; chains and token trees (an
attention-bias input replaces its mask).

Adding a backend = one file implementing ``TargetModel`` / ``SequenceRows`` + one entry here. The entry
describes the backend: what it offers (token trees, the target's features, layer views: the methods that
need them read ``offers``), the devices it runs on (``--device``: core/device.py), the paths ``--backend
auto`` and ``specdraft doctor`` measure on it, and the check doctor runs. The CLI's ``--backend`` choices,
``SpecDecoder.load``, the method registry, the paths and doctor read this table; nothing else names a backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..core.device import AUTO, device_kind, torch_device
from ..core.errors import ConfigError

DEFAULT_DTYPE = "bfloat16"  # the dense weights' dtype when no --dtype is given
OFFERS = ("trees", "hidden", "layers", "views")  # token trees scored; final-norm / decoder-layer features handed
# over with the embedding and LM head (Capabilities.head_io); layer views (views.py)


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    load: Callable  # (name_or_path, dtype, num_layers) -> a TargetModel
    uses_dtype: bool  # dense weights: whether --dtype means anything (a GGUF file carries its own weight types)
    offers: frozenset = frozenset()  # of OFFERS
    truncates: bool = False  # loads a layer-truncated copy (num_layers: --draft-layers)
    paths: tuple[str, ...] = ()  # what doctor measures here (models/paths.py); the first: what auto measures
    check: Callable | None = None  # (report) -> whether it runs here; doctor's lines on it (report.say / .problem)
    advice: Callable | None = None  # (path, its curve, fastest path, its curve, model) -> doctor's line or None
    optional: bool = False  # a model it cannot take is a note in doctor, not a problem
    devices: frozenset = frozenset({"cpu"})  # the device kinds it runs on (core/device.device_kind)
    place: Callable | None = None  # (device setting, flag) -> what its loader takes as 4th argument: where the
    # weights go (a ConfigError naming the flag when this machine cannot); None: the CPU only, ``load`` takes 3
    cuda_first: bool = False  # --backend auto takes it where torch sees a CUDA GPU (auto measures CPU paths)
    converts: Callable[[str], bool] = lambda model: False  # whether loading a catalog model first converts its
    # weights (minutes: transformers' dense copy, OpenVINO's IR), which --backend auto does not do just to measure

    def __post_init__(self):
        assert set(self.offers) <= set(OFFERS), (
            f"backend {self.name!r}: unknown offers {set(self.offers) - set(OFFERS)}"
        )
        assert all(p.partition(":")[0] == self.name for p in self.paths), f"backend {self.name!r}: paths {self.paths}"


def _load_hf(name_or_path: str, dtype, num_layers: int | None, device=None):
    """``NAME:int8`` / ``NAME:int4[-gN]`` / ``NAME:w8a8`` loads NAME with low-bit linear layers (lowbit.py);
    ``device``: a torch device (``_place_hf``; None: the CPU)."""
    from .loading import load_hf
    from .lowbit import is_quant_suffix, parse_quant, quantize_linears

    base, _, quant = name_or_path.rpartition(":")
    if not (quant.startswith("int") or is_quant_suffix(quant)):  # "int..." suffixes get parse_quant's error
        base, quant = name_or_path, ""
    if quant:
        parse_quant(quant)  # a bad suffix fails before the weights load
        check_cpu_kernels(device, quant)
    m = load_hf(base, dtype, num_layers, device=device or "cpu")
    if quant:
        m.quantization = quantize_linears(m.model, quant)
        m.name = f"{m.name}:{quant}"
    return m


def check_cpu_kernels(device, quant: str) -> None:
    """Low-bit linear layers (lowbit.py) are torch CPU kernels: refused on another device before loading."""
    if device is not None and device.type != "cpu":
        raise ConfigError(
            f"{quant} weights run on torch's CPU kernels: load them with --device cpu (--draft-device cpu for a draft)"
        )


def _place_hf(device: str, flag: str):
    return torch_device(device, flag)


def _place_llama(device: str, flag: str) -> bool:
    from .llama import gpu_offload

    return gpu_offload(device, flag)


def _place_openvino(device: str, flag: str) -> str:
    """OpenVINO's device name: GPU (an Intel GPU) for ``gpu``, else CPU (``auto`` included: its GPU device is no
    CUDA device, and auto means CUDA when torch sees one)."""
    return "GPU" if device == "gpu" else "CPU"


def resolve_gguf(name_or_path: str) -> tuple[Path, str]:
    """-> (the GGUF file, where its tokenizer loads from: a transformers directory or the file).

    A known name (or a quantized variant of one, ``NAME:TYPE`` from ``specdraft models quantize``)
    is pulled and SHA-256 checked like for the hf backend; its tokenizer is the dense copy's."""
    from . import catalog, quantize
    from .loading import resolve

    base, _, qtype = name_or_path.partition(":")
    if base in catalog.MODELS:
        tok_dir = catalog.tokenizer_dir(base)  # (pulls the GGUF file and checks it)
        return (quantize.variant_path(base, qtype) if qtype else catalog.gguf_path(base)), str(tok_dir)
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        raise ConfigError(
            f"{p} is a directory; the llama backend loads .gguf files (or a model name). "
            "Use --backend hf for a transformers directory"
        )
    path, gguf = resolve(name_or_path)
    return path / gguf, str(path / gguf)


def _load_llama(name_or_path: str, dtype, num_layers: int | None, offload: bool = False):
    if num_layers is not None:
        raise ConfigError("--draft-layers (a layer-truncated copy) needs --backend hf")
    from .llama import LlamaModel
    from .loading import load_tokenizer

    path, tok_from = resolve_gguf(name_or_path)
    tok = load_tokenizer(tok_from)
    return LlamaModel(path, tok, name=name_or_path, offload=offload)


def _load_openvino(name_or_path: str, dtype, num_layers: int | None, ov_device: str = "CPU"):
    if num_layers is not None:
        raise ConfigError("--draft-layers (a layer-truncated copy) needs --backend hf")
    from .loading import load_tokenizer
    from .openvino import OVModel

    path, tok_from = resolve_gguf(name_or_path)
    return OVModel(path, load_tokenizer(tok_from), name=name_or_path, ov_device=ov_device)


def _hf_converts(model: str) -> bool:
    from . import catalog

    return model in catalog.MODELS and not (catalog.dense_dir(model) / "specdraft.json").exists()


def _openvino_converts(model: str) -> bool:
    from . import catalog
    from .openvino import ir_ready

    return model in catalog.MODELS and not ir_ready(catalog.gguf_path(model), model)


def _check_llama(report) -> bool:
    from .llama_setup import check_build

    return check_build(report)


def _check_openvino(report) -> bool:
    import importlib.util

    ok = importlib.util.find_spec("openvino") is not None
    report.say("openvino", "installed" if ok else "not installed (requirements.txt)")
    return ok


def _ratio_note(curve, fast, fast_curve) -> str:
    return f"8 tokens cost {curve[8] / curve[1]:.2f}x one; its one token costs {curve[1] / fast_curve[1]:.1f}x {fast}'s"


def _advise_hf(path, curve, fast, fast_curve, model) -> str:
    if path.endswith(":w8a8"):
        return (
            f"flat verification at 8-bit bytes: --backend hf --target {model}:w8a8 "
            f"({_ratio_note(curve, fast, fast_curve)}): it pays where drafts are long"
        )
    return (
        f"full-precision answers: --backend hf --dtype bfloat16 --draft self:Q4_0 --draft-backend llama "
        f"({_ratio_note(curve, fast, fast_curve)} in bf16)"
    )


def _advise_openvino(path, curve, fast, fast_curve, model) -> str:
    return (
        f"cheap verification at 4-bit bytes: --backend openvino ({_ratio_note(curve, fast, fast_curve)}): it "
        "pays where drafts are long (code edits)"
    )


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend(
            "hf",
            "transformers, dense float32/bfloat16 weights: every method",
            _load_hf,
            True,
            offers=frozenset(OFFERS),
            truncates=True,
            paths=("hf", "hf:w8a8"),
            advice=_advise_hf,
            devices=frozenset({"cpu", "cuda"}),
            place=_place_hf,
            cuda_first=True,
            converts=_hf_converts,
        ),
        Backend(
            "llama",
            "llama.cpp on a GGUF file (4-bit kernels): the fastest CPU decoder",
            _load_llama,
            False,
            offers=frozenset({"trees", "layers"}),
            paths=("llama",),
            check=_check_llama,
            devices=frozenset({"cpu", "cuda"}),
            place=_place_llama,
        ),
        Backend(
            "openvino",
            "OpenVINO on a GGUF file (4-bit weights, batched int8/bf16 kernels): cheap multi-token "
            "verification, chains and trees",
            _load_openvino,
            False,
            offers=frozenset({"trees", "layers"}),
            paths=("openvino",),
            check=_check_openvino,
            advice=_advise_openvino,
            optional=True,
            devices=frozenset({"cpu", "gpu"}),
            place=_place_openvino,
            converts=_openvino_converts,
        ),
    ]
}


@dataclass(frozen=True)
class OptionNeed:
    """An option the user gave that only some backends honour (``option_needs``)."""

    option: str  # as typed: "--dtype float32", "--draft-layers 4", "--draft self:int4"
    backends: tuple[str, ...]  # those that honour it
    whose: str  # the model it applies to: "target", "draft", or "either" (--dtype: the dense one of the two)
    note: str  # why the others do not


def having(ok: Callable[[Backend], bool]) -> tuple[str, ...]:
    return tuple(n for n, b in BACKENDS.items() if ok(b))


def option_needs(dtype: str | None, draft: str | None, draft_layers: int | None) -> list[OptionNeed]:
    """What the options given (None: not given) ask of the backends: --dtype, weights in that dtype; a draft's
    --draft-layers, a layer-truncated copy; --draft self:QUANT, the target's weights as that quantization (int8,
    int4, w8a8: transformers' low-bit copies; Q4_0, Q8_0, ...: GGUF variants)."""
    from .lowbit import is_quant_suffix
    from .quantize import TYPES

    needs = []
    if dtype is not None:
        needs.append(
            OptionNeed(
                f"--dtype {dtype}", having(lambda b: b.uses_dtype), "either", "a GGUF file carries its own weight types"
            )
        )
    if draft is not None and draft_layers is not None:
        needs.append(
            OptionNeed(
                f"--draft-layers {draft_layers}",
                having(lambda b: b.truncates),
                "draft",
                "only transformers loads a layer-truncated copy",
            )
        )
    quant = draft[5:] if draft is not None and draft.startswith("self:") else None
    if quant is not None and (quant.startswith("int") or is_quant_suffix(quant)):
        needs.append(
            OptionNeed(
                f"--draft {draft}",
                having(lambda b: b.uses_dtype),
                "draft",
                f"{quant} is a low-bit copy of dense weights; a GGUF self-draft is self:Q4_0",
            )
        )
    elif quant in TYPES:
        needs.append(
            OptionNeed(
                f"--draft {draft}",
                having(lambda b: not b.uses_dtype),
                "draft",
                f"{quant} is a GGUF variant; a transformers self-draft is self:int8 or self:int4",
            )
        )
    return needs


def check_named(backend: str, draft_backend: str | None, has_draft: bool, needs: list[OptionNeed]) -> None:
    """Each option given against the backend named for the model it applies to (the draft's: --draft-backend,
    else the target's); auto chooses among those that honour them (paths.allowed_for). A contradiction the user
    typed is one error naming both."""
    for n in needs:
        draft_on = draft_backend or backend
        if n.whose == "either" and has_draft and draft_on in n.backends:
            continue  # the draft's dense weights take the dtype
        on, flag = (draft_on, "--draft-backend") if n.whose == "draft" and draft_backend else (backend, "--backend")
        if on != "auto" and on not in n.backends:
            raise ConfigError(f"{n.option} needs {flag} {' or '.join(n.backends)}; on {on}, {n.note}")


def offering(need: str | None) -> tuple[str, ...]:
    """The backends that offer ``need`` (one of OFFERS; None: every backend), read now (an entry added later counts)."""
    return tuple(n for n, b in BACKENDS.items() if need is None or need in b.offers)


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def placement(backend: str, device: str = AUTO, flag: str = "--device"):
    """Where ``backend``'s loader puts the weights for the device setting ``device`` (``Backend.place``; None for
    a CPU-only backend); a ConfigError naming ``flag`` when the backend does not run on that kind of device or
    this machine cannot give it. Checked before anything loads."""
    b = _named(backend)
    kind = device_kind(device, flag)
    if kind != AUTO and kind not in b.devices:
        raise ConfigError(
            f"{flag} {device}: the {b.name} backend runs on {' or '.join(sorted(b.devices))} "
            f"({kind}: --backend {' or '.join(having(lambda x: kind in x.devices))})"
        )
    return None if b.place is None else b.place(device, flag)


def check_draft_flags(draft: str | None, **given) -> None:
    """Settings of the draft model (``draft_device=``, ``draft_backend=``, ``draft_layers=``: None where not
    given) without a draft would be ignored: one error naming the first, before anything loads."""
    if draft is None:
        for key, value in given.items():
            if value is not None:
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"{flag} {value}: no draft model is given (--draft NAME), so nothing would read it")


def check_devices(backend: str, draft_backend: str | None, device: str, draft_device: str | None) -> None:
    """The device settings against the backends named (``placement``), before anything loads; with --backend
    auto, that some backend gives this machine the device asked (auto chooses among those: paths.allowed_for).
    ``draft_device`` None: no draft."""
    for setting, flag, on in (
        (device, "--device", backend),
        (draft_device, "--draft-device", draft_backend or backend),
    ):
        if setting is not None:
            placement(on, setting, flag) if on != "auto" else _placed_somewhere(setting, flag)


def _placed_somewhere(device: str, flag: str) -> None:
    """A ConfigError (the first backend's) unless some backend runs on ``device`` here."""
    kind = device_kind(device, flag)
    if kind == AUTO:
        return
    refused = []
    for name in having(lambda b: kind in b.devices):
        try:
            placement(name, device, flag)
            return
        except ConfigError as e:
            refused.append(e)
    raise refused[0] if refused else ConfigError(f"{flag} {device}: no backend runs on {kind}")


def device_kw(device: str) -> dict:
    """The ``device`` keyword of ``load_model`` (and of ``paths.load_fastest``) for a setting: none for auto,
    their default, so that a stand-in for them written without devices (a test's) still fits."""
    return {} if device == AUTO else {"device": device}


def load_model(
    name_or_path: str,
    dtype: str | None = DEFAULT_DTYPE,
    num_layers: int | None = None,
    backend: str = "hf",
    device: str = AUTO,
):
    """Load a model and its tokenizer behind the backend named ``backend``, on ``device`` (a setting:
    core/device.py; ``placement``): a ``TargetModel`` whose ``source`` holds these arguments (a process of
    its own loads it again from them: remote_draft). ``dtype`` None: not given (DEFAULT_DTYPE where the
    backend reads one)."""
    dtype = dtype or DEFAULT_DTYPE
    b, where = _named(backend), placement(backend, device)
    m = b.load(name_or_path, dtype, num_layers) if b.place is None else b.load(name_or_path, dtype, num_layers, where)
    m.source = {
        "name_or_path": name_or_path,
        "dtype": dtype,
        "num_layers": num_layers,
        "backend": backend,
        "device": device,
    }
    return m


_named = backend  # load_model's parameter ``backend`` hides the function
