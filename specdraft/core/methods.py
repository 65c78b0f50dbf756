"""The drafting methods' table: one ``Method`` entry per method says what it needs, what it takes and how its
drafter is made. ``REGISTRY`` (name -> entry) is filled here, by this module alone; config validation, the
CLI's choices and help, the server's checks, the bench and ``auto`` read it. Adding a drafter is one drafter
module plus one entry (docs/design.md, "Adding a drafter"); a program may also add an entry at run time.

An entry is schema, not code of the layers above: its factories (``make``, ``load_resource``) are named by
"module:function" strings, resolved on first use (``Method.build``, ``Method.resource``), so the table sits in
core, below the drafters it makes, and importing it imports no drafter. (An entry added at run time may
give the callables themselves.)

``needs``: None (model-free), "draft_model" (a second model with the target's tokenizer), "layer_view" (the
target's own layers), "head" (a head trained by ``specdraft train``). ``trees``: the ``SpecConfig.tree`` values
it accepts (model-free drafters that make trees on their own, such as suffix or token_recycling, list only
"chain": ``tree`` selects a model's tree shape). ``runs_on``: what a backend must offer for it to run there
(models/backends.py ``OFFERS``; None: every backend; ``drafters.runs_on.backends`` reads the backend
table). ``uses_draft``: needs nothing, but uses a draft model when one is given (auto's model arms).
``check``: the method's own rules beyond those, (spec) -> an error message or None. ``load_resource``: (decoder,
spec) -> the shared resource its drafter reads (a layer view, a head), loaded and cached by the decoder
(``SpecDecoder.shared``); the server loads it before admitting a request. ``served``: False for a method a
server request may not name (remote_draft starts a process).

``params``: the method's own settings, a dataclass whose fields (each with a default) are declared with
``checks.param(default, *checks)``; a spec's JSON holds them as flat keys beside SpecConfig's fields (what
every method shares), ``spec.params`` is the validated instance, and another method's spec refuses them.
Settings several methods read are groups (``ModelDraft``, ``StaticTree``, ``DynamicTree``, ``NgramMatch``,
``Retrieval``, ``RetrievalSwitch``, ``HeadDir``) that a method's parameters inherit, so a key means one thing
whichever method reads it. A group's ``RULES`` are cross-field rules over its keys. A key whose value is a
path (``checks.PathArg``: ``skip_config``, ``datastore``, ``head``, ``autotune``) is what a server takes from
its operator only, by name (``PATH_FIELDS``).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from .checks import (
    MAX_DRAFT,
    MAX_NGRAM,
    MAX_RECYCLE_TOPK,
    MAX_TREE_NODES,
    Bool,
    Choices,
    Int,
    IntList,
    Number,
    OptStr,
    PathArg,
    StrList,
    TreeSize,
    check_rules,
    default_of,
    param,
)
from .errors import ConfigError

if TYPE_CHECKING:  # (the drafters layer declares what a factory may ask of the decoder)
    from ..drafters.base import DraftContext

ALL_TREES = ("chain", "static", "dynamic")
SCHEDULES = ("constant", "heuristic", "cost_aware")  # every schedule (SpecConfig.schedule, the CLI's choices)
MODEL_SCHEDULES = SCHEDULES
FREE_SCHEDULES = ("constant", "cost_aware")
Factory = Callable[["DraftContext", Any], Any]  # (the decoder, its SpecConfig) -> a drafter, or a shared resource


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    make: str | Factory  # -> its Drafter; "module:function", or the function (an entry added at run time)
    needs: str | None = None
    trees: tuple[str, ...] = ("chain",)
    schedules: tuple[str, ...] = FREE_SCHEDULES
    runs_on: str | None = None  # what its backends must offer (models/backends.py OFFERS: trees, hidden, views)
    uses_draft: bool = False  # uses a draft model when one is given, works without (auto)
    check: Callable | None = None  # (spec: SpecConfig) -> error message | None, run by SpecConfig.validate
    load_resource: str | Factory | None = None  # -> a layer view, a head: loaded before the drafter is made
    params: type | None = None  # a dataclass of the method's own settings (spec.params)
    served: bool = True  # a server request may name it (not one that starts processes on a client's word)

    def build(self, decoder: "DraftContext", spec) -> Any:
        """The drafter of ``spec`` on ``decoder`` (the entry's ``make``)."""
        return resolve(self.make)(decoder, spec)

    def resource(self, decoder: "DraftContext", spec) -> Any:
        """The shared resource ``spec``'s drafter reads, loaded into the decoder's cache (None: none)."""
        return None if self.load_resource is None else resolve(self.load_resource)(decoder, spec)

    def param_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.params)) if self.params is not None else ()

    def param_default(self, name: str) -> Any:
        """The default of its own setting ``name``."""
        fields = dataclasses.fields(self.params) if self.params is not None else ()
        return default_of(next(f for f in fields if f.name == name))


_RESOLVED: dict[str, Factory] = {}


def resolve(ref: str | Factory) -> Factory:
    """A factory named "module:function" (imported once, on first use), or the callable itself."""
    if callable(ref):
        return ref
    if ref not in _RESOLVED:
        module, _, name = ref.partition(":")
        _RESOLVED[ref] = getattr(importlib.import_module(module), name)
    return _RESOLVED[ref]


def collect_rules(params) -> tuple:
    """The cross-field RULES of a parameters object's class and every group it inherits."""
    return tuple(r for cls in type(params).__mro__ for r in cls.__dict__.get("RULES", ()))


def check_params(params) -> None:
    check_rules(params, collect_rules(params))


# --- groups of settings several methods read (their parameters inherit them) ------------------------------
@dataclass
class ModelDraft:
    """A model drafts (a draft model, the target's own layers): from the second draft token on, drafting stops
    once the draft's top probability falls below ``confidence_threshold`` (0: never)."""

    confidence_threshold: float = param(0.0, Number(min=0, max=1, max_open=True))


# tree defaults: the best-measured shapes on this project's CPU (docs/benchmark-log.md, token trees), where a
# forward costs about linear in the tokens it scores; chain stays the default there
@dataclass
class StaticTree:
    """A static tree's shape (``tree="static"``): ``tree_branching[d]`` children per node at depth d, or an
    explicit list of paths of child ranks (Medusa's "choices": ``tree_choices``, prefix-closed)."""

    tree_branching: list[int] = param(
        [2, 1, 1], IntList(min=1), TreeSize(max_depth=MAX_DRAFT, max_nodes=MAX_TREE_NODES)
    )
    tree_choices: list[list[int]] | None = param(None, Choices())


@dataclass
class DynamicTree:
    """A dynamic tree (``tree="dynamic"``, EAGLE-2's): ``tree_topk`` children for the ``tree_topk`` most probable
    frontier nodes per level, reranked to ``tree_budget`` nodes."""

    tree_budget: int = param(6, Int(min=1, max=MAX_TREE_NODES))
    tree_topk: int = param(2, Int(min=1, max=16))


@dataclass
class NgramMatch:
    """Prompt lookup's match: the longest suffix n-gram of the context, n from ``max_ngram`` down to ``min_ngram``."""

    min_ngram: int = param(1, Int(max=MAX_NGRAM))
    max_ngram: int = param(3, Int(max=MAX_NGRAM))

    RULES: ClassVar[tuple] = (
        (
            lambda p: 1 <= p.min_ngram <= p.max_ngram,
            lambda p: f"need 1 <= min_ngram <= max_ngram, got min_ngram={p.min_ngram}, max_ngram={p.max_ngram}",
        ),
    )


def _tree_nodes():
    return param(24, Int(min=1, max=MAX_TREE_NODES, what="draft tree node budget"))


@dataclass
class Retrieval:
    """The suffix automaton's draft tree: the ``tree_nodes`` most frequent continuations of the ``max_occurrences``
    latest occurrences of the context's suffix, each at least ``min_token_prob`` likely, at most
    ``max_spec_factor`` x the match length deep."""

    max_spec_factor: float = param(1.0, Number(min=0, max=1000, min_open=True))
    min_token_prob: float = param(0.1, Number(min=0, max=1))
    tree_nodes: int = _tree_nodes()
    max_occurrences: int = param(256, Int(min=1, max=65536))


@dataclass
class RetrievalSwitch:
    """Retrieval drafts ``retrieval_k`` deep when its match is at least ``hybrid_min_match`` tokens (hybrid, and
    auto's retrieval arms)."""

    retrieval_k: int = param(16, Int(min=1, max=MAX_DRAFT, what="depth of retrieval drafts"))
    hybrid_min_match: int = param(4, Int(min=1, max=4096, what="suffix match length from which retrieval drafts"))


@dataclass
class HeadDir:
    """A trained head's directory (``specdraft train``); its type and target are checked when it is loaded
    (models/heads.load_head), not here."""

    head: str | None = param(None, PathArg("a directory path"))


# --- each method's parameters -------------------------------------------------------------------------
@dataclass
class DraftModelParams(ModelDraft, StaticTree, DynamicTree):
    """draft_model's: a model's chain or tree."""


@dataclass
class PromptLookupParams(NgramMatch):
    """prompt_lookup's: with ``branches`` > 1 the continuations of up to that many matches form a token tree."""

    branches: int = param(1, Int(min=1, max=32, note="1 = a chain"))


@dataclass
class LayerSkipParams(DraftModelParams):
    """layer_skip's: the layers skipped (``skip_layers``), or the set saved by ``specdraft tune-skip``."""

    skip_layers: list[int] = param([], IntList(min=None, nonempty=False, what="layer indices", max_len=4096))
    skip_config: str | None = param(None, PathArg())


@dataclass
class EarlyExitParams(DraftModelParams):
    """early_exit's: how many of the target's first layers draft."""

    exit_layer: int = param(0, Int(min=0, max=4096, note="layers the early-exit draft runs; 0 = unset"))


@dataclass
class SuffixParams(Retrieval):
    """suffix's: the tree above, over prompt + output and an optional ``datastore`` (``specdraft datastore build``)."""

    datastore: str | None = param(None, PathArg())


@dataclass
class TokenRecyclingParams:
    """token_recycling's: ``recycle_branching[d]`` children per node at depth d (its table keeps
    max(recycle_branching) successors per token)."""

    recycle_branching: list[int] = param(
        [4, 2, 2, 1],
        IntList(min=1, max=MAX_RECYCLE_TOPK, what="children per node at each depth"),
        TreeSize(max_depth=MAX_DRAFT, max_nodes=MAX_TREE_NODES),
    )


@dataclass
class LookaheadParams:
    """lookahead's: the Jacobi window's columns (W), the n-gram length (N, window levels + 1) and the pooled
    n-grams verified per step (G)."""

    lookahead_window: int = param(4, Int(min=1, max=MAX_DRAFT, what="W"))
    lookahead_ngram: int = param(3, Int(min=2, max=MAX_NGRAM, what="N"))
    lookahead_max_ngrams: int = param(4, Int(min=1, max=MAX_DRAFT, what="G"))


@dataclass
class HybridParams(DraftModelParams, Retrieval, RetrievalSwitch):
    """hybrid's: the draft model's chain or tree, the suffix automaton's tree, and when retrieval drafts;
    ``hybrid_merge`` (greedy): both draft into one tree whenever retrieval matches."""

    hybrid_merge: bool = param(False, Bool())


@dataclass
class CascadeParams(ModelDraft, NgramMatch):
    """cascade's: prompt lookup proposes up to ``cascade_k`` tokens per draft-model forward."""

    cascade_k: int = param(4, Int(min=1, max=MAX_DRAFT))


@dataclass
class RemoteDraftParams:
    """remote_draft's: the draft's process (its threads, the Ray cluster) and whether it drafts ahead."""

    prefetch: bool = param(True, Bool())  # draft the next block while the target verifies (False: in turns)
    remote_threads: int = param(1, Int(min=1, max=256, what="threads of the draft's process"))
    ray_address: str | None = param(None, OptStr("a Ray address (HOST:PORT, auto) or local"))
    remote_node: str | None = param(None, OptStr("the address of the cluster node that runs the draft"))


@dataclass
class MedusaParams(HeadDir, StaticTree):
    """medusa's: its heads' directory and the static tree they draft (a chain: ``tree="chain"``)."""


@dataclass
class EagleParams(HeadDir, StaticTree, DynamicTree):
    """eagle's and eagle3's: the head's directory and the chain or tree it drafts."""


@dataclass
class AutoParams(HeadDir, RetrievalSwitch):
    """auto's: its arms (``auto_arms``; empty: every one that runs), whether it corrects the start-up cost curve
    from observed steps (``learn_costs``), the autotune file with its arms' priors (``autotune``; None: the
    file `specdraft autotune` wrote for this target, draft, backend and CPU, if any; "off": none), its hybrid
    arm's settings and the EAGLE-3 head its head arms draft with."""

    learn_costs: bool = param(True, Bool())
    auto_arms: list[str] = param([], StrList(max_len=64))
    tree_nodes: int = _tree_nodes()
    autotune: str | None = param(None, PathArg())


# --- the methods' own rules ---------------------------------------------------------------------------
def _needs_exit_layer(spec) -> str | None:
    if spec.params.exit_layer < 1:
        return "method 'early_exit' needs exit_layer >= 1 (how many of the target's first layers draft)"
    return None


def _needs_skip_set(spec) -> str | None:
    if not spec.params.skip_layers and not spec.params.skip_config:
        return (
            "method 'layer_skip' needs skip_layers=[...] or skip_config=FILE "
            "(from `specdraft tune-skip --target NAME -o FILE`)"
        )
    return None


def _branches_fit(spec) -> str | None:
    if spec.params.branches * spec.k <= MAX_TREE_NODES:
        return None
    return f"branches ({spec.params.branches}) x k ({spec.k}) makes a tree of more than {MAX_TREE_NODES} nodes"


def _lookahead_fits(spec) -> str | None:
    """A Jacobi window of W columns and G pooled n-grams, N - 1 levels each, must fit one token tree."""
    p = spec.params
    if (p.lookahead_window + p.lookahead_max_ngrams) * (p.lookahead_ngram - 1) <= MAX_TREE_NODES:
        return None
    return (
        f"lookahead_window ({p.lookahead_window}) + lookahead_max_ngrams ({p.lookahead_max_ngrams}), times "
        f"lookahead_ngram - 1 ({p.lookahead_ngram - 1}), makes a tree of more than {MAX_TREE_NODES} nodes"
    )


_F = "specdraft.drafters.factories:"  # where the built-in methods' factories are (imported on first use)
REGISTRY: dict[str, Method] = {
    m.name: m
    for m in [
        # plain drafts nothing, so any schedule is a no-op: accepted, so that {"method": "plain"} can override
        # any default spec (the server's, loadtest's plain mode, the bench's reference)
        Method("plain", "no drafting: the autoregressive baseline", _F + "plain", schedules=SCHEDULES),
        Method(
            "draft_model",
            "a smaller model drafts k tokens (or a tree); another tokenizer's drafts go through text",
            _F + "draft_model",
            needs="draft_model",
            trees=ALL_TREES,
            schedules=MODEL_SCHEDULES,
            params=DraftModelParams,
        ),
        Method(
            "prompt_lookup",
            "copy what followed the last occurrence of the context's suffix n-gram",
            _F + "prompt_lookup",
            params=PromptLookupParams,
            check=_branches_fit,
        ),
        Method(
            "layer_skip",
            "the target with some layers skipped drafts (Draft & Verify, SWIFT)",
            _F + "layer_skip",
            needs="layer_view",
            trees=ALL_TREES,
            schedules=MODEL_SCHEDULES,
            check=_needs_skip_set,
            params=LayerSkipParams,
            load_resource=_F + "kept_layers",
            runs_on="views",
        ),
        Method(
            "early_exit",
            "the target's first exit_layer layers draft (LayerSkip, Kangaroo)",
            _F + "early_exit",
            needs="layer_view",
            trees=ALL_TREES,
            schedules=MODEL_SCHEDULES,
            check=_needs_exit_layer,
            params=EarlyExitParams,
            load_resource=_F + "first_layers",
            runs_on="views",
        ),
        Method(
            "suffix",
            "suffix automaton over prompt + output (+ a datastore) drafts a token tree",
            _F + "suffix",
            runs_on="trees",
            params=SuffixParams,
        ),
        Method(
            "token_recycling",
            "a table of each token's top successors, refreshed from the target",
            _F + "token_recycling",
            runs_on="trees",
            params=TokenRecyclingParams,
        ),
        Method(
            "lookahead",
            "Jacobi window + n-gram pool, verified as one token tree",
            _F + "lookahead",
            runs_on="trees",
            params=LookaheadParams,
            check=_lookahead_fits,
        ),
        Method(
            "hybrid",
            "suffix-automaton retrieval when its match is long, the draft model otherwise (SAM-Decoding)",
            _F + "hybrid",
            needs="draft_model",
            trees=ALL_TREES,
            runs_on="trees",
            params=HybridParams,
        ),
        Method(
            "cascade",
            "the draft model drafts, prompt lookup proposing for it (CS-Drafting's vertical cascade)",
            _F + "draft_model",
            needs="draft_model",
            schedules=MODEL_SCHEDULES,
            params=CascadeParams,
        ),
        Method(
            "remote_draft",
            "the draft model in a process of its own (Ray), drafting the next block while the target "
            "verifies (PEARL, SwiftSpec)",
            _F + "remote_draft",
            needs="draft_model",
            params=RemoteDraftParams,
            served=False,
        ),
        Method(
            "medusa",
            "trained heads on the target's features (specdraft train medusa)",
            _F + "medusa",
            needs="head",
            trees=("chain", "static"),
            load_resource=_F + "head",
            runs_on="hidden",
            params=MedusaParams,
        ),
        Method(
            "eagle",
            "a trained one-layer head on the target's features (specdraft train eagle)",
            _F + "eagle",
            needs="head",
            trees=ALL_TREES,
            load_resource=_F + "head",
            runs_on="hidden",
            params=EagleParams,
        ),
        Method(
            "eagle3",
            "a trained one-layer head on three of the target's layers (specdraft train eagle3, or an "
            "EAGLE-3 checkpoint of SpecForge, vLLM or speculators)",
            _F + "eagle3",
            needs="head",
            trees=ALL_TREES,
            load_resource=_F + "head",
            runs_on="layers",
            params=EagleParams,
        ),
        # last: it chooses among the others
        Method(
            "auto",
            "chooses the drafting method per request and step from measured rates on this machine",
            _F + "auto",
            uses_draft=True,
            params=AutoParams,
        ),
    ]
}
METHODS = tuple(REGISTRY)  # the built-in methods; code that must see entries added later reads REGISTRY


def method(name: str) -> Method:
    if name not in REGISTRY:
        raise ConfigError(f"unknown method {name!r}; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def methods_needing(*needs: str) -> tuple[str, ...]:
    return tuple(m.name for m in REGISTRY.values() if m.needs in needs)


def path_fields() -> tuple[str, ...]:
    """The spec keys whose values are paths (``checks.PathArg``), in the table's order."""
    out: list[str] = []
    for m in REGISTRY.values():
        for f in dataclasses.fields(m.params) if m.params is not None else ():
            if any(isinstance(c, PathArg) for c in f.metadata.get("checks", ())) and f.name not in out:
                out.append(f.name)
    return tuple(out)
