"""Self-speculation: the target drafts for itself with some decoder layers skipped.

``layer_view(target, keep)`` returns an HFModel over the *same* weights (no copy) that runs only
the decoder layers in ``keep`` (ascending), then the target's final norm and LM head. Early exit
(LayerSkip, Kangaroo) is ``keep = 0..L-1``; layer skipping (Draft & Verify, SWIFT) is any subset.

How, without forking a model file: a shallow copy of the top-level module and of its inner model
whose ``layers`` ModuleList holds the kept layer objects. Each kept attention module keeps its
original ``layer_idx``, and the view's own DynamicCache is built from the full config, so kept
layers fill their usual slots and skipped ones stay empty (crop / gather skip empty layers).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..core.errors import ConfigError
from .hf import HFModel


def _decoder(model):
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        raise ConfigError(
            f"{type(model).__name__} has no model.layers ModuleList; layer skipping needs a decoder-only LM"
        )
    return inner


def layer_view(target: HFModel, keep: list[int], name: str | None = None) -> HFModel:
    model = target.model
    inner = _decoder(model)
    n = len(inner.layers)
    keep = sorted(set(int(i) for i in keep))
    if not keep or keep[0] < 0 or keep[-1] >= n:
        raise ConfigError(f"layers to keep must be a non-empty subset of 0..{n - 1}, got {keep}")
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner.layers = torch.nn.ModuleList([inner.layers[i] for i in keep])
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.model = view_inner
    label = name or f"{target.name}[{len(keep)}/{n} layers]"
    return HFModel(view, target.tokenizer, name=label)


def skip_to_keep(num_layers: int, skip: list[int]) -> list[int]:
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"skip_layers {bad} out of range 0..{num_layers - 1}")
    keep = [i for i in range(num_layers) if i not in set(skip)]
    if not keep:
        raise ConfigError("skip_layers skips every layer; keep at least one")
    return keep


def load_skip_config(path: str | None, target) -> list[int]:
    """The skip_layers of a file written by `specdraft tune-skip` (tune_skip.py), checked against ``target``."""
    if not path:
        raise ConfigError("layer_skip needs skip_layers or skip_config")
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read skip_config {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"skip_config {path} is not valid JSON: {e}") from e
    if not isinstance(d, dict) or not isinstance(d.get("skip_layers"), list):
        raise ConfigError(f"skip_config {path} has no 'skip_layers' list (make one with `specdraft tune-skip`)")
    n = d.get("num_layers")
    if n is not None and n != target.num_layers:
        raise ConfigError(
            f"skip_config {path} was tuned for a {n}-layer model; this target has {target.num_layers} layers"
        )
    if not d["skip_layers"]:
        raise ConfigError(
            f"skip_config {path} skips no layer: tune-skip found no set that pays on the machine it "
            "ran on; use another method, or set skip_layers yourself"
        )
    return [int(i) for i in d["skip_layers"]]
