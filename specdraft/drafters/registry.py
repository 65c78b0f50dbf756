"""The method registry: one entry per drafting method says what it needs, what it supports and how
its drafter is made. Config validation, the CLI's choices and help, the server's checks and the
benchmark read it; adding a drafter is one drafter file plus one entry here (docs/design.md).

``needs``: None (model-free), "draft_model" (a second model with the target's tokenizer),
"layer_view" (the target's own layers), "head" (a head trained by ``specdraft train``).
``trees``: the ``SpecConfig.tree`` values it accepts (model-free drafters that make trees on their
own, such as suffix or token_recycling, list only "chain": ``tree`` selects a model's tree shape).
``runs_on``: what a backend must offer for it to run there (models/backends.py ``OFFERS``: "trees" for
the methods that always draft token trees, "hidden" for heads on the target's features, "views" for
views of the target's layers; None: every backend); ``backends`` reads the backend table.
``uses_draft``: needs nothing, but uses a draft model when one is given (auto's model arms).
``check``: the method's own config rules beyond those, (spec) -> an error message or None.
``load_resource``: (decoder, spec) -> the shared resource its drafter reads (a layer view, a head), loaded
and cached by the decoder (``SpecDecoder.shared``); the server loads it before admitting a request.
``served``: False for a method a server request may not name (remote_draft starts a process).
``params``: the method's own parameters, a dataclass whose fields (each with a default) are declared like
SpecConfig's (``config.param(default, *checks)``); a spec's JSON holds them as flat keys, ``spec.params`` is
the validated instance, and another method's spec refuses them. The built-in methods' parameters are
SpecConfig fields, each declaring the methods that read it (``used_by``).
Factories import their drafter lazily, so importing the registry stays cheap. The table itself,
``REGISTRY``, lives in config.py (below the drafters) so that SpecConfig validation reads it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable

from ..core.config import ALL_TREES, REGISTRY, SCHEDULES, Int, SpecConfig, param
from ..core.errors import ConfigError
from .auto import AutoParams
from .draft_model import CascadeParams
from .hybrid import HybridParams
from .lookahead import LookaheadParams, tree_too_large
from .remote_draft import RemoteDraftParams
from .token_recycling import TokenRecyclingParams

MODEL_SCHEDULES = SCHEDULES
FREE_SCHEDULES = ("constant", "cost_aware")


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    make: Callable  # (decoder: SpecDecoder, spec: SpecConfig) -> Drafter
    needs: str | None = None
    trees: tuple[str, ...] = ("chain",)
    schedules: tuple[str, ...] = FREE_SCHEDULES
    batches: bool = True
    runs_on: str | None = None  # what its backends must offer (models/backends.py OFFERS: trees, hidden, views)
    uses_draft: bool = False  # uses a draft model when one is given, works without (auto)
    check: Callable | None = None  # (spec: SpecConfig) -> error message | None, run by SpecConfig.validate
    load_resource: Callable | None = None  # (decoder, spec) -> a layer view, a head: loaded before the drafter
    params: type | None = None  # a dataclass of the method's own parameters (spec.params)
    served: bool = True  # a server request may name it (not one that starts processes on a client's word)

    def __post_init__(self):
        names = {f.name for f in dataclasses.fields(self.params)} if self.params is not None else set()
        clash = sorted(names & set(SpecConfig.__dataclass_fields__))
        if clash:  # a flat key means one thing: a SpecConfig field is never a method's parameter
            raise ValueError(f"method {self.name!r}: parameters {clash} are SpecConfig fields; name them otherwise")

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends it runs on, read off the backend table now (a backend's entry says what it offers)."""
        from ..models.backends import offering

        return offering(self.runs_on)

    def unavailable(
        self, backend: str, has_draft: bool, subject: str = "method", where: str = "", no_draft: str | None = None
    ) -> str | None:
        """Why this method cannot run on a decoder of ``backend`` with (or without) a draft model, or None.
        The caller words it: ``subject`` and ``where`` frame the backend message, ``no_draft`` replaces
        the draft one."""
        if backend not in self.backends:
            return (
                f"{subject} {self.name!r} is not available on the {backend} backend{where}; methods there: "
                f"{', '.join(methods_on(backend))}"
            )
        if self.needs == "draft_model" and not has_draft:
            return no_draft or f"{subject} {self.name!r} needs a draft model (pass draft=NAME / --draft NAME)"
        return None


@dataclass
class EarlyExitParams:
    """early_exit's own parameters (flat keys of its spec)."""

    exit_layer: int = param(0, Int(min=0, max=4096, note="layers the early-exit draft runs; 0 = unset"))


def _needs_exit_layer(spec):
    if spec.params.exit_layer < 1:
        return "method 'early_exit' needs exit_layer >= 1 (how many of the target's first layers draft)"
    return None


def _needs_skip_set(spec):
    if not spec.skip_layers and not spec.skip_config:
        return (
            "method 'layer_skip' needs skip_layers=[...] or skip_config=FILE "
            "(from `specdraft tune-skip --target NAME -o FILE`)"
        )
    return None


def _plain(dec, spec):
    from .base import NoDrafter

    return NoDrafter()


def _model_drafter(draft, dec, spec):
    """A chain or token tree drafted by a model (a draft model or a view of the target's layers)."""
    if spec.tree == "chain":
        from .draft_model import DraftModelDrafter

        return DraftModelDrafter(draft, spec, dec.target.vocab_size)
    for m in (draft, dec.target):
        if not m.capabilities.trees:
            raise ConfigError(
                f"{m.name} on the {m.backend} backend does not score token trees (tree={spec.tree!r}); use tree='chain'"
            )
    from .draft_tree import DraftTreeDrafter

    return DraftTreeDrafter(draft, spec, dec.target.vocab_size)  # drafts through the draft model's rows group


def _draft_model(dec, spec):
    bridge = dec.vocab_bridge()
    if bridge is None:
        return _model_drafter(dec.draft_model(), dec, spec)
    from .cross_vocab import CrossVocabDrafter

    if spec.tree != "chain" or spec.method == "cascade":
        raise ConfigError(
            f"a draft with another tokenizer ({dec.draft.name}) drafts chains through text: "
            f"method 'draft_model' or 'hybrid' with tree 'chain' (got method {spec.method!r}, "
            f"tree {spec.tree!r})"
        )
    return CrossVocabDrafter(dec.draft, bridge, spec, dec.target.vocab_size)


def _first_layers(dec, spec):
    n = dec.target.num_layers
    exit_layer = spec.params.exit_layer
    if exit_layer >= n:
        raise ConfigError(f"exit_layer must be < the target's {n} layers, got {exit_layer}")
    return dec.layer_view(range(exit_layer))


def _kept_layers(dec, spec):
    from ..models.views import skip_to_keep

    skip = spec.skip_layers or dec.skip_config(spec.skip_config)
    return dec.layer_view(skip_to_keep(dec.target.num_layers, skip))


def _early_exit(dec, spec):
    return _model_drafter(_first_layers(dec, spec), dec, spec)


def _layer_skip(dec, spec):
    return _model_drafter(_kept_layers(dec, spec), dec, spec)


def _head(dec, spec):
    return dec.head(spec)


def _prompt_lookup(dec, spec):
    from .prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(spec)


def _suffix(dec, spec):
    from .suffix import SuffixDrafter

    served = dec.served_outputs()  # on a decoder that learns online: the outputs it served lately
    return SuffixDrafter(
        spec, dec.datastore(spec.datastore) if spec.datastore else None, None if served is None else served.snapshot()
    )


def _token_recycling(dec, spec):
    from .token_recycling import TokenRecyclingDrafter

    return TokenRecyclingDrafter(spec, dec.target.vocab_size, dec.recycle_table(max(spec.params.recycle_branching)))


def _lookahead(dec, spec):
    from .lookahead import LookaheadDrafter

    return LookaheadDrafter(spec)


def _hybrid(dec, spec):
    from .hybrid import HybridDrafter

    return HybridDrafter(
        _suffix(dec, retrieval_spec(spec)), _draft_model(dec, spec), spec.hybrid_min_match, spec.params.hybrid_merge
    )


def retrieval_spec(spec):
    """The suffix drafter's config inside a hybrid or auto spec (``retrieval_k`` deep)."""
    import dataclasses

    keep = ("min_ngram", "max_ngram", "max_spec_factor", "min_token_prob", "tree_nodes", "max_occurrences", "datastore")
    d = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name in keep}
    return SpecConfig(method="suffix", k=spec.retrieval_k, max_k=max(spec.retrieval_k, 16), **d)


def _remote_draft(dec, spec):
    from .remote_draft import RemoteDraft, RemoteDraftDrafter

    draft = dec.draft_model()
    source = draft.source
    if source is None or dec.vocab_bridge() is not None:
        raise ConfigError(
            f"method 'remote_draft' loads the draft by its name in a process of its own, with the "
            f"target's tokenizer; {draft.name} is not such a draft (a self:int4 copy, another "
            f"tokenizer's model)"
        )
    p = spec.params
    key = ("remote_draft", json.dumps(source, sort_keys=True), p.remote_threads, p.ray_address)
    return RemoteDraftDrafter(dec.shared(key, lambda: RemoteDraft(source, p, dec.target.vocab_size)), spec)


def _auto(dec, spec):
    from .arms import build_auto

    return build_auto(dec, spec)


def _medusa(dec, spec):
    from .medusa import MedusaDrafter

    return MedusaDrafter(dec.target, dec.head(spec), spec)


def _eagle(dec, spec):
    from .eagle import EagleDrafter

    return EagleDrafter(dec.target, dec.head(spec), spec)


def _eagle3(dec, spec):
    from .eagle3 import Eagle3Drafter

    return Eagle3Drafter(dec.target, dec.head(spec), spec)


REGISTRY.update(
    {
        m.name: m
        for m in [
            # plain drafts nothing, so any schedule is a no-op: accepted, so that {"method": "plain"} can override
            # any default spec (the server's, loadtest's plain mode, the bench's reference)
            Method("plain", "no drafting: the autoregressive baseline", _plain, schedules=SCHEDULES),
            Method(
                "draft_model",
                "a smaller model drafts k tokens (or a tree); another tokenizer's drafts go through text",
                _draft_model,
                needs="draft_model",
                trees=ALL_TREES,
                schedules=MODEL_SCHEDULES,
            ),
            Method(
                "prompt_lookup", "copy what followed the last occurrence of the context's suffix n-gram", _prompt_lookup
            ),
            Method(
                "layer_skip",
                "the target with some layers skipped drafts (Draft & Verify, SWIFT)",
                _layer_skip,
                needs="layer_view",
                trees=ALL_TREES,
                schedules=MODEL_SCHEDULES,
                check=_needs_skip_set,
                load_resource=_kept_layers,
                runs_on="views",
            ),
            Method(
                "early_exit",
                "the target's first exit_layer layers draft (LayerSkip, Kangaroo)",
                _early_exit,
                needs="layer_view",
                trees=ALL_TREES,
                schedules=MODEL_SCHEDULES,
                check=_needs_exit_layer,
                params=EarlyExitParams,
                load_resource=_first_layers,
                runs_on="views",
            ),
            Method(
                "suffix",
                "suffix automaton over prompt + output (+ a datastore) drafts a token tree",
                _suffix,
                runs_on="trees",
            ),
            Method(
                "token_recycling",
                "a table of each token's top successors, refreshed from the target",
                _token_recycling,
                runs_on="trees",
                params=TokenRecyclingParams,
            ),
            Method(
                "lookahead",
                "Jacobi window + n-gram pool, verified as one token tree",
                _lookahead,
                runs_on="trees",
                params=LookaheadParams,
                check=tree_too_large,
            ),
            Method(
                "hybrid",
                "suffix-automaton retrieval when its match is long, the draft model otherwise (SAM-Decoding)",
                _hybrid,
                needs="draft_model",
                trees=ALL_TREES,
                runs_on="trees",
                params=HybridParams,
            ),
            Method(
                "cascade",
                "the draft model drafts, prompt lookup proposing for it (CS-Drafting's vertical cascade)",
                _draft_model,
                needs="draft_model",
                schedules=MODEL_SCHEDULES,
                params=CascadeParams,
            ),
            Method(
                "remote_draft",
                "the draft model in a process of its own (Ray), drafting the next block while the target "
                "verifies (PEARL, SwiftSpec)",
                _remote_draft,
                needs="draft_model",
                params=RemoteDraftParams,
                served=False,
            ),
            Method(
                "auto",
                "chooses the drafting method per request and step from measured rates on this machine",
                _auto,
                uses_draft=True,
                params=AutoParams,
            ),
            Method(
                "medusa",
                "trained heads on the target's features (specdraft train medusa)",
                _medusa,
                needs="head",
                trees=("chain", "static"),
                load_resource=_head,
                runs_on="hidden",
            ),
            Method(
                "eagle",
                "a trained one-layer head on the target's features (specdraft train eagle)",
                _eagle,
                needs="head",
                trees=ALL_TREES,
                load_resource=_head,
                runs_on="hidden",
            ),
            Method(
                "eagle3",
                "a trained one-layer head on three of the target's layers (specdraft train eagle3, or an "
                "EAGLE-3 checkpoint of SpecForge, vLLM or speculators)",
                _eagle3,
                needs="head",
                trees=ALL_TREES,
                load_resource=_head,
                runs_on="layers",
            ),
        ]
    }
)

METHODS = tuple(REGISTRY)  # the built-in methods; code that must see entries added later reads REGISTRY


def method(name: str) -> Method:
    if name not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def methods_on(backend: str) -> tuple[str, ...]:
    return tuple(m.name for m in REGISTRY.values() if backend in m.backends)


def help_text() -> str:
    """One line per method for the CLI's --method help."""
    return "; ".join(
        f"{m.name}: {m.summary}" + (f" [needs a {m.needs.replace('_', ' ')}]" if m.needs else "")
        for m in REGISTRY.values()
    )
