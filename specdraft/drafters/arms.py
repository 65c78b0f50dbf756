"""The arms of ``method="auto"``: the autotune file's (written by ``specdraft autotune``, autotune.py), or
DEFAULT_ARMS that the decoder can run, and ``build_auto``, the auto entry's factory in the registry."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..core.config import SpecConfig
from ..core.errors import ConfigError
from ..core.methods import REGISTRY
from .runs_on import unavailable

# auto's arms when no autotune file is there: cheap retrieval, the draft model, and the hybrid of both
# (each only where the decoder can run it); plain is always an arm
DEFAULT_ARMS = {
    "prompt_lookup": {"method": "prompt_lookup", "k": 8, "min_ngram": 2, "max_ngram": 4},
    "suffix": {"method": "suffix", "k": 16, "tree_nodes": 16},
    "draft_model": {"method": "draft_model"},
    "hybrid": {"method": "hybrid"},
}
ARM_FIELDS = ("k", "max_k", "retrieval_k", "hybrid_min_match", "tree_nodes")  # auto's spec passes these on
HEAD_TYPE = "eagle3"  # the type of auto's ``head``: its head arms (below) draft with it
# with an EAGLE-3 head (auto's ``head``): its chain and its dynamic tree
HEAD_ARMS = {
    "eagle3": {"method": HEAD_TYPE, "k": 5},
    "eagle3_tree": {"method": HEAD_TYPE, "tree": "dynamic", "k": 5, "tree_topk": 3, "tree_budget": 10},
}


def head_type(method: str) -> str:
    """The head type a ``spec.head`` of ``method`` must be: the method's own (medusa, eagle, eagle3), and for
    auto its head arms' (HEAD_TYPE)."""
    return HEAD_TYPE if method == "auto" else method


def slug(s: str | None) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", s or "none")


def default_path(dec) -> Path:
    from ..models.catalog import home
    from ..models.cost_curve import cpu_key

    t = dec.target
    d = dec.draft
    name = lambda m: None if m is None else getattr(m, "name", None) or getattr(m, "path", None)  # noqa: E731
    dtype = str(getattr(getattr(t, "model", None), "dtype", "")).replace("torch.", "")  # hf: costs depend on it
    return home() / "autotune" / f"{slug(name(t))}__{slug(name(d))}__{dec.backend}{dtype}__{cpu_key()}.json"


def load_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"autotune file {p} not found (write one with `specdraft autotune ... -o {p}`)")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"autotune file {p} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("arms"), list) or not doc["arms"]:
        raise ConfigError(f"autotune file {p} has no 'arms' list (was it written by `specdraft autotune`?)")
    return doc


def _arm_specs(dec, spec: SpecConfig) -> list[tuple[str, SpecConfig, dict | None]]:
    """(name, spec, prior or None) of each arm: the autotune file's, or DEFAULT_ARMS that this decoder
    can run; ``auto_arms`` (auto's own parameter) keeps the named ones."""
    found = default_path(dec)
    path = spec.params.autotune or (found if found.is_file() else None)
    if path == "off":  # online calibration only, whatever file exists
        path = None
    if path is not None:
        arms = file_arms(dec, path)
    else:
        passed = {f: spec.get(f) for f in ARM_FIELDS}
        arms = []
        for name, d in DEFAULT_ARMS.items():
            m = REGISTRY[d["method"]]
            if unavailable(m, dec.backend, dec.draft is not None):
                continue
            fields = {**{f: v for f, v in passed.items() if f in ("k", "max_k") or m.name == "hybrid"}, **d}
            arms.append((name, SpecConfig.from_dict(fields), None))
    arms += [a for a in _head_arms(dec, spec) if a[0] not in {n for n, _, _ in arms}]
    keep = spec.params.auto_arms
    if keep:
        unknown = sorted(set(keep) - {n for n, _, _ in arms} - {"plain"})
        if unknown:
            raise ConfigError(
                f"auto_arms {unknown} are not arms here; arms: {', '.join(['plain'] + [n for n, _, _ in arms])}"
            )
        arms = [a for a in arms if a[0] in keep]
    arms = [a for a in arms if a[1].method != "plain"]
    return [("plain", SpecConfig(method="plain"), None)] + arms


def file_arms(dec, path: str | Path) -> list[tuple[str, SpecConfig, dict]]:
    """(name, spec, prior) of each arm of the autotune file at ``path`` (read once per decoder:
    ``SpecDecoder.autotune_file``)."""
    arms = [(a["name"], SpecConfig.from_dict(a["spec"]), a) for a in dec.autotune_file(path)["arms"]]
    if any(s.method == "auto" for _, s, _ in arms):
        raise ConfigError("an auto arm cannot itself be 'auto'")
    return arms


def _head_arms(dec, spec: SpecConfig) -> list[tuple[str, SpecConfig, None]]:
    """HEAD_ARMS when auto has a ``head``: an EAGLE-3 head for this target, on a backend that hands over its
    features (else an error: a head given is used or refused, never dropped)."""
    if spec.params.head is None:
        return []
    try:
        problem = unavailable(REGISTRY[HEAD_TYPE], dec.backend, dec.draft is not None)
        if problem:  # a head given is never left out unsaid
            raise ConfigError(problem)
        dec.head(spec)  # loaded once per decoder (as its arms' head): its type and its target checked
    except ConfigError as e:
        raise ConfigError(f"auto's head: {e} (auto drafts with it through its {HEAD_TYPE} arms)") from None
    return [(name, SpecConfig.from_dict({**d, "head": spec.params.head}), None) for name, d in HEAD_ARMS.items()]


def build_auto(dec, spec: SpecConfig):
    """The AutoDrafter for ``spec`` on decoder ``dec`` (arms, this machine's step costs, shared memory)."""
    from .auto import Arm, AutoDrafter, Evidence, StepCosts

    arms_specs = _arm_specs(dec, spec)
    uses_draft = any(uses_model(s) for _, s, _ in arms_specs)
    observed = dec.observed_costs() if spec.params.learn_costs else None
    costs = StepCosts(dec.cost_curve(32), dec.draft_cost_curve(32) if uses_draft else None, observed)
    arms = []
    for name, s, prior in arms_specs:
        ev = None
        if prior is not None and prior.get("mat"):
            steps = 8.0
            ev = Evidence(
                steps,
                steps * prior["mat"],
                steps * costs.step(prior.get("scored", 1.0), prior.get("model_tokens", 0.0)),
            )
        arms.append(Arm(name, dec.make_drafter(s), ev, uses_model(s)))
    adopts = dec.draft is not None and dec.draft.prefill_twin is dec.target
    return AutoDrafter(
        arms, costs, dec.arm_memory(spec), min_match=spec.params.hybrid_min_match, draft_adopts_prompt=adopts
    )


def uses_model(s: SpecConfig) -> bool:
    return REGISTRY[s.method].needs == "draft_model"
