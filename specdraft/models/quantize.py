"""Other quantizations of a known model, written by llama.cpp's own quantizer and registered next to
the original: ``specdraft models quantize NAME --type Q4_0`` -> ``NAME:Q4_0`` loads on the llama
backend.

The source is the checked GGUF of ``models pull`` (Q4_K_M / Q4_1 here: no float16 original ships), so
a new type re-quantizes already-quantized weights (``allow_requantize``): Q8_0 keeps them nearly as
they are, Q4_0 adds its own rounding. Each variant's SHA-256 and size are recorded in
``$SPECDRAFT_HOME/quantized.json``; loading checks the size and the file loading in llama.cpp.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from ..core import homefiles
from ..core.errors import ConfigError, ModelFileError
from . import catalog
from .llama_probe import is_gguf

TYPES = {
    "Q2_K": 10,
    "Q3_K_M": 12,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "Q8_0": 7,
    "F16": 1,
}  # llama_ftype values


def _index_path() -> Path:
    return catalog.home() / "quantized.json"


INDEX = homefiles.obj(
    {},
    keys=homefiles.TEXT,
    values=homefiles.obj(  # {"NAME:TYPE": the record quantize() writes}
        {"path": homefiles.TEXT, "size": homefiles.POSITIVE}, required=("path", "size"), keys=homefiles.TEXT
    ),
)


def _index() -> dict:
    return homefiles.read_json(_index_path(), INDEX, "the quantized-variant index") or {}


def variants() -> dict:
    """{"NAME:TYPE": record} of every registered variant."""
    return _index()


def check_type(qtype: str) -> int:
    if qtype not in TYPES:
        raise ConfigError(f"unknown quantization type {qtype!r}; choose one of: {', '.join(TYPES)}")
    return TYPES[qtype]


def variant_path(base: str, qtype: str) -> Path:
    """The registered file of ``base:qtype`` (size-checked); the pulled file itself when ``qtype`` is its
    own type (qwen2.5-coder-1.5b:Q4_K_M, smollm2-135m:Q4_1: the weights the dense copies came from)."""
    check_type(qtype)
    if catalog.get_spec(base).gguf_name.lower().endswith(f"{qtype.lower()}.gguf"):
        return catalog.gguf_path(base)
    rec = _index().get(f"{base}:{qtype}")
    if rec is None:
        raise ModelFileError(
            f"no {qtype} variant of {base}; make it with `specdraft models quantize {base} --type {qtype}`"
        )
    p = Path(rec["path"])
    if not p.exists() or p.stat().st_size != rec["size"]:
        raise ModelFileError(
            f"{p} is missing or not the registered file ({rec['size']} bytes); "
            f"run `specdraft models quantize {base} --type {qtype}` again"
        )
    if not is_gguf(p):
        raise ModelFileError(
            f"{p}, registered as {base}:{qtype}, is not a GGUF file; run `specdraft models "
            f"quantize {base} --type {qtype}` again"
        )
    return p


def quantize(base: str, qtype: str, threads: int | None = None) -> Path:
    """Write ``base`` as ``qtype`` with llama.cpp's quantizer, load it once, register it; -> its path. A second
    quantize of the same variant at once waits for the first and takes its file."""
    check_type(qtype)
    spec = catalog.get_spec(base)
    catalog.pull(base, convert=False)
    src = catalog.gguf_path(base)
    out = src.with_name(f"{Path(spec.gguf_name).stem}.{qtype}.gguf")
    with homefiles.locked(out.with_name(out.name + ".lock")):
        made = _index().get(f"{base}:{qtype}")
        if (
            made
            and made.get("source_sha256") == spec.sha256
            and out.is_file()
            and out.stat().st_size == made["size"]
            and is_gguf(out)
        ):
            return out  # made before from the same file (its IR and caches stay valid)
        _write_quantized(src, out, qtype, threads)
        from .llama import LlamaModel

        LlamaModel(out, None, name=f"{base}:{qtype}")  # the check: llama.cpp loads what it wrote
        _register(
            f"{base}:{qtype}",
            {
                "path": str(out),
                "size": out.stat().st_size,
                "sha256": catalog.sha256_file(out),
                "type": qtype,
                "source": spec.gguf_name,
                "source_sha256": spec.sha256,
            },
        )
    return out


def _write_quantized(src: Path, out: Path, qtype: str, threads: int | None) -> None:
    """llama.cpp's quantizer from ``src`` into a temporary file of this call's own, renamed over ``out`` whole."""
    from .llama import lib

    tmp = homefiles.private_temp(out, ".partial")
    ll = lib()
    params = ll.llama_model_quantize_default_params()
    params.ftype = TYPES[qtype]
    params.nthread = threads or 0
    params.allow_requantize = True
    try:
        rc = ll.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise ModelFileError(f"llama.cpp could not quantize {src.name} to {qtype} (code {rc})")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _register(name: str, record: dict) -> None:
    """Add a variant's record to the index (other variants may be registered at the same time)."""
    with homefiles.locked(_index_path().with_name(_index_path().name + ".lock")):
        homefiles.write_json(_index_path(), {**_index(), name: record})
