"""Find and load model files: a known model's name (models/catalog.py), a transformers model directory, or a
.gguf file; tokenizers; the transformers backend's loader (``load_hf``). ``load_model``, which picks the
backend, is in models/backends.py (above this module: the backends load through it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..core.errors import ConfigError, ModelFileError, TokenizerMismatchError
from . import catalog
from .hf import HFModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def set_threads(n: int | None = None) -> int:
    """Fix torch's intra-op thread count (default: all cores, or SPECDRAFT_THREADS)."""
    n = n or int(os.environ.get("SPECDRAFT_THREADS", "0")) or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def resolve(name_or_path: str) -> tuple[Path, str | None]:
    """-> (directory, gguf file name or None)."""
    if name_or_path in catalog.MODELS:
        return catalog.pull(name_or_path), None
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelFileError(f"{p} is a directory but has no config.json; not a transformers model directory")
        return p, None
    raise ModelFileError(
        f"model {name_or_path!r} not found: not a known name ({', '.join(catalog.MODELS)}), "
        "not a transformers model directory, not a .gguf file"
    )


def load_hf(
    name_or_path: str, dtype: str | torch.dtype = "bfloat16", num_layers: int | None = None, device: str = "cpu"
) -> HFModel:
    """Load a causal LM and its tokenizer behind the transformers backend (``models.hf.HFModel``).

    ``num_layers`` keeps only the first N decoder layers (a layer-truncated copy, used as a cheap
    draft model in tests and as the early-exit drafter's backbone).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    td = parse_dtype(dtype)
    path, gguf = resolve(name_or_path)
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        tok = AutoTokenizer.from_pretrained(str(path), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=td, **kw)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ModelFileError(f"could not load model from {path}{'/' + gguf if gguf else ''}: {e}") from e
    model.to(device)
    if num_layers is not None:
        truncate_layers(model, num_layers)
    label = name_or_path if num_layers is None else f"{name_or_path}[:{num_layers} layers]"
    return HFModel(model, tok, name=label)


def load_tokenizer(name_or_path: str):
    """Only the tokenizer of a model (a name, a transformers directory or a .gguf file)."""
    from transformers import AutoTokenizer

    path, gguf = resolve(name_or_path)
    kw = {"gguf_file": gguf} if gguf else {}
    try:
        return AutoTokenizer.from_pretrained(str(path), **kw)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ModelFileError(f"could not load the tokenizer from {path}{'/' + gguf if gguf else ''}: {e}") from e


def truncate_layers(model, n: int) -> None:
    layers = model.model.layers
    if not 1 <= n <= len(layers):
        raise ConfigError(f"num_layers must be in 1..{len(layers)}, got {n}")
    model.model.layers = layers[:n]
    model.config.num_hidden_layers = n
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n]


def check_same_tokenizer(target: HFModel, draft: HFModel) -> None:
    """Refuse a draft whose tokenizer differs from the target's (compares the vocabularies, not
    the embedding shapes: Qwen pads its embedding rows, so equal shapes prove nothing)."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        if target.vocab_size != draft.vocab_size:
            raise TokenizerMismatchError(
                f"draft vocabulary size {draft.vocab_size} != target {target.vocab_size}, and no tokenizers to compare"
            )
        return
    if tt is dt:
        return
    tv, dv = tt.get_vocab(), dt.get_vocab()
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))[:5]
        only_d = sorted(set(dv) - set(tv))[:5]
        moved = [k for k in tv if k in dv and tv[k] != dv[k]][:5]
        raise TokenizerMismatchError(
            f"draft {draft.name!r} and target {target.name!r} have different tokenizers "
            f"(target {len(tv)} tokens, draft {len(dv)} tokens; only in target: {only_t}; only in draft: {only_d}; "
            f"same token, other id: {moved}). A draft must share the target's tokenizer; "
            "use a draft from the same model family or a model-free method (prompt_lookup)."
        )
    if draft.vocab_size < len(dv) or target.vocab_size < len(tv):
        raise TokenizerMismatchError("a model's LM head has fewer rows than its tokenizer has tokens")
