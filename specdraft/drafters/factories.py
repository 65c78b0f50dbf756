"""How each built-in method's drafter is made.

The method table (core/methods.py ``REGISTRY``) names these functions (``Method.make``, ``Method.load_resource``:
"specdraft.drafters.factories:NAME"); each is ``(decoder: DraftContext, spec) -> a drafter`` (or the shared resource its
drafter reads) and imports its drafter lazily, so importing this module stays cheap. Where a method can
run is drafters/runs_on.py's.
"""

from __future__ import annotations

import dataclasses
import json

from ..core.config import SpecConfig
from ..core.errors import ConfigError
from ..core.methods import Retrieval
from .base import DraftContext


# --- the factories --------------------------------------------------------------------------------------
def plain(dec: DraftContext, spec: SpecConfig):
    from .base import NoDrafter

    return NoDrafter()


def _model_drafter(draft, dec: DraftContext, spec: SpecConfig):
    """A chain or token tree drafted by a model (a draft model or a view of the target's layers)."""
    if spec.tree == "chain":
        from .draft_model import DraftModelDrafter

        return DraftModelDrafter(draft, spec, dec.target.vocab_size, dec.prefix_cache)
    for m in (draft, dec.target):
        if not m.capabilities.trees:
            raise ConfigError(
                f"{m.name} on the {m.backend} backend does not score token trees (tree={spec.tree!r}); use tree='chain'"
            )
    from .draft_tree import DraftTreeDrafter

    return DraftTreeDrafter(draft, spec, dec.target.vocab_size, dec.prefix_cache)  # (the draft model's group)


def draft_model(dec: DraftContext, spec: SpecConfig):
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


def first_layers(dec: DraftContext, spec: SpecConfig):
    n = dec.target.num_layers
    exit_layer = spec.params.exit_layer
    if exit_layer >= n:
        raise ConfigError(f"exit_layer must be < the target's {n} layers, got {exit_layer}")
    return dec.layer_view(range(exit_layer))


def kept_layers(dec: DraftContext, spec: SpecConfig):
    from ..models.views import skip_to_keep

    skip = list(spec.params.skip_layers or dec.skip_config(spec.params.skip_config))
    return dec.layer_view(skip_to_keep(dec.target.num_layers, skip))


def early_exit(dec: DraftContext, spec: SpecConfig):
    return _model_drafter(first_layers(dec, spec), dec, spec)


def layer_skip(dec: DraftContext, spec: SpecConfig):
    return _model_drafter(kept_layers(dec, spec), dec, spec)


def head(dec: DraftContext, spec: SpecConfig):
    return dec.head(spec)


def prompt_lookup(dec: DraftContext, spec: SpecConfig):
    from .prompt_lookup import PromptLookupDrafter

    return PromptLookupDrafter(spec)


def suffix(dec: DraftContext, spec: SpecConfig):
    from .suffix import SuffixDrafter

    served = dec.served_outputs()  # on a decoder that learns online: the outputs it served lately
    store = spec.params.datastore
    return SuffixDrafter(spec, dec.datastore(store) if store else None, None if served is None else served.snapshot())


def token_recycling(dec: DraftContext, spec: SpecConfig):
    from .token_recycling import TokenRecyclingDrafter

    return TokenRecyclingDrafter(spec, dec.target.vocab_size, dec.recycle_table(max(spec.params.recycle_branching)))


def lookahead(dec: DraftContext, spec: SpecConfig):
    from .lookahead import LookaheadDrafter

    return LookaheadDrafter(spec)


def hybrid(dec: DraftContext, spec: SpecConfig):
    from .hybrid import HybridDrafter

    p = spec.params
    return HybridDrafter(suffix(dec, retrieval_spec(spec)), draft_model(dec, spec), p.hybrid_min_match, p.hybrid_merge)


def retrieval_spec(spec: SpecConfig) -> SpecConfig:
    """The suffix drafter's spec inside a hybrid spec (``retrieval_k`` deep, its retrieval settings)."""
    p = spec.params
    kept = {f.name: getattr(p, f.name) for f in dataclasses.fields(Retrieval)}
    return SpecConfig(method="suffix", k=p.retrieval_k, max_k=max(p.retrieval_k, 16), **kept).validate()


def remote_draft(dec: DraftContext, spec: SpecConfig):
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


def auto(dec: DraftContext, spec: SpecConfig):
    from .arms import build_auto

    return build_auto(dec, spec)


def medusa(dec: DraftContext, spec: SpecConfig):
    from .medusa import MedusaDrafter

    return MedusaDrafter(dec.target, dec.head(spec), spec)


def eagle(dec: DraftContext, spec: SpecConfig):
    from .eagle import EagleDrafter

    return EagleDrafter(dec.target, dec.head(spec), spec)


def eagle3(dec: DraftContext, spec: SpecConfig):
    from .eagle3 import Eagle3Drafter

    return Eagle3Drafter(dec.target, dec.head(spec), spec)
