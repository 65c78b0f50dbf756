"""The two configuration objects: what to sample (SamplingParams) and how to speculate (SpecConfig).

Both round-trip through plain dicts / JSON with validation, so the CLI (``--config FILE.json``), the
benchmark and the server all take the same object.

Validation is declarative: each field carries its constraints (core/checks.py: ``Int``, ``Number``,
``Choice``, ``IntList``, ``PathArg``, ...), one generic loop applies them, then a short list of cross-field
rules, then the method's own rules, read from the method table (core/methods.py ``REGISTRY``). ``validate``
returns a checked copy and never changes the object it checks. Validation reads no files: a head's type and
target, a datastore's vocabulary or a skip config are checked when they are loaded.

SpecConfig's fields are what every method shares; a method's own settings (``Method.params``, a dataclass
declared with ``param``, several methods sharing groups of them) are flat keys of the same JSON, held in
``SpecConfig.params``. A key set (to a non-default value) for a method that does not read it is an error
naming the methods that do.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .checks import (
    MAX_DRAFT,
    Choice,
    Int,
    JsonSchema,
    Mutable,
    Number,
    OptStr,
    StrList,
    TokenBias,
    and_list,
    check_rules,
    checked,
    default_of,
    field_with,
    is_checked,
    mark_checked,
)
from .errors import ConfigError
from .methods import ALL_TREES, REGISTRY, SCHEDULES, Method, check_params, path_fields

# Defaults measured for the Qwen2.5-Coder 1.5B + 0.5B pair in float32 on this project's 2-core CPU
# (`specdraft batchbench`, docs/server.md#measured-crossover-qwen-pair): relative to plain decoding at the
# same batch size, speculation does best at 2 rows and loses more from 4 rows on, most at 8.
SPEC_SHRINK_AT = 4
SPEC_OFF_AT = 8

# Temperatures below this sample greedily (argmax): dividing logits by a tiny temperature overflows
# to inf / NaN probabilities, and the distribution is one-hot at such temperatures anyway.
GREEDY_BELOW = 1e-5

LOSSY_RULES = ("typical",)
# spec keys that name a file or directory: a server takes them from its operator only (by name)
PATH_FIELDS = path_fields()


def _from_dict(cls, d: dict[str, Any] | None):
    if d is None:
        return cls()
    if isinstance(d, cls):
        return d.validate()
    if not isinstance(d, dict):
        raise ConfigError(f"{cls.__name__} must be a JSON object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s) {unknown}; valid fields: {sorted(names)}")
    return cls(**d).validate()


@dataclass
class SamplingParams(Mutable):
    """temperature 0 means greedy, and so does any temperature below ``GREEDY_BELOW`` (1e-5): such a
    distribution is one-hot in practice, and dividing logits by it would overflow. top_k 0 and
    top_p 1.0 mean no truncation."""

    temperature: float = field_with(0.0, Number(min=0, finite=True, note="0 = greedy"))
    top_k: int = field_with(0, Int(min=0, note="0 = disabled"))
    top_p: float = field_with(1.0, Number(min=0, max=1, min_open=True))
    min_p: float = field_with(0.0, Number(min=0, max=1, note="0 = off"))
    seed: int | None = field_with(None, Int(min=-(2**63), max=2**64 - 1, optional=True))  # torch's generator range
    max_new_tokens: int = field_with(128, Int(min=1))
    stop: list[str] = field_with([], StrList())
    ignore_eos: bool = False
    # history-dependent processing (specdraft/core/processors.py), before temperature / top-k / top-p
    # bounded: a penalty near 0 divides logits into inf (NaN probabilities), found by tests/test_fuzz.py
    repetition_penalty: float = field_with(1.0, Number(min=0.01, max=100, note="1 = off"))
    presence_penalty: float = field_with(0.0, Number(min=-2, max=2))
    frequency_penalty: float = field_with(0.0, Number(min=-2, max=2))
    logit_bias: dict = field_with({}, TokenBias())
    min_tokens: int = field_with(0, Int(min=0, note="EOS is masked until this many tokens were generated"))
    # structured output (at most one): every emitted token keeps the text a prefix of a match
    json_schema: dict | None = field_with(None, JsonSchema())
    regex: str | None = field_with(None, OptStr("a regular expression"))
    grammar: str | None = field_with(None, OptStr("a Lark grammar"))
    # the target's log-probabilities of the emitted tokens, with this many alternatives (0-20)
    logprobs: int | None = field_with(None, Int(min=0, max=20, optional=True, what="top alternatives per token"))

    RULES = (
        (
            lambda s: sum(x is not None for x in (s.json_schema, s.regex, s.grammar)) <= 1,
            lambda s: "set at most one of json_schema, regex and grammar",
        ),
        (
            lambda s: s.min_tokens <= s.max_new_tokens,
            lambda s: f"min_tokens ({s.min_tokens}) exceeds max_new_tokens ({s.max_new_tokens})",
        ),
    )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.grammar is not None

    @property
    def processed(self) -> bool:
        """Whether logits need history-dependent processing (penalties, bias, min_tokens, a grammar)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.constrained
        )

    def validate(self) -> "SamplingParams":
        """A checked copy (this object is left as it was); a checked one as it is."""
        if is_checked(self):
            return self
        out = checked(self)
        check_rules(out, self.RULES)
        return mark_checked(out)

    @classmethod
    def from_dict(cls, d):
        return _from_dict(cls, d)

    def to_dict(self):
        return dataclasses.asdict(self)


DEFAULT_METHOD = "auto"  # what runs when no method is named: SpecConfig(), the library, `generate`, `serve`


@dataclass(frozen=True, init=False)
class SpecConfig:
    """How to speculate. ``method`` picks the drafter; the fields are what every method shares (``k``,
    ``schedule``, ``max_k``, ``tree``, the opt-in lossy rule), and ``params`` the method's own settings (its
    entry's ``params`` dataclass, core/methods.py), which JSON, ``to_dict`` and the constructor hold as flat
    keys beside the fields: ``SpecConfig(method="medusa", head=DIR, tree="static", tree_branching=[2, 2])``.
    The settings named below are the methods' own unless said otherwise.

    - plain: no drafting, the autoregressive baseline (same engine, same loop).
    - draft_model: an independent smaller model with the target's tokenizer drafts ``k`` tokens;
      ``confidence_threshold`` > 0 stops drafting early when the draft's top probability falls
      below it.
    - prompt_lookup: copy the ``k`` tokens that followed the most recent earlier occurrence of the
      longest suffix n-gram (``min_ngram`` .. ``max_ngram``) of prompt + output. With
      ``branches`` > 1 the continuations of up to that many matches form a token tree, scored in one
      forward with a tree attention mask (greedy and sampling: one-hot candidates).
    - suffix (SuffixDecoding / SAM-Decoding / REST family; specdraft.drafters.suffix): a suffix
      automaton over prompt + output, extended by the new tokens each step, finds the longest
      suffix of the context that occurred before; the continuations of its occurrences (the
      ``max_occurrences`` most recent) are merged into a count trie and the ``tree_nodes`` most
      frequent nodes whose empirical probability (count / occurrences) is at least
      ``min_token_prob`` form the draft tree. Depth <= min(k, ceil(max_spec_factor x match length)).
      ``datastore`` (a directory from ``specdraft datastore build``) adds a global suffix array over
      a tokenized corpus; of the two trees the one with the larger total probability is drafted.
      Deterministic (draft_probs None).
    - token_recycling (specdraft.drafters.token_recycling): an int32 adjacency table [V, top_k] of
      each token's top-k successors, refreshed from every target forward's logits; the draft is a
      static tree from the last token with ``recycle_branching[d]`` children per node at depth d
      (top_k = max(recycle_branching); its own parameter, ``TokenRecyclingParams``); ``k`` is not
      used. The table lives as long as the SpecDecoder (it is recycled across requests).
    - lookahead (specdraft.drafters.lookahead): Jacobi window ``lookahead_window`` (W)
      of ``lookahead_ngram`` - 1 levels (N), an n-gram pool, and a verification branch of up to
      ``lookahead_max_ngrams`` (G) pooled n-grams starting with the last token; both branches are
      one token tree scored in one forward (depth W + N - 2; ``k`` is not used). W, N, G are its own
      parameters (``LookaheadParams``).

    Token trees from the draft model (``tree``; also layer_skip / early_exit, and the eagle head below):

    - ``chain`` (default): one candidate per position, ``k`` deep.
    - ``static``: a fixed shape, ``tree_branching[d]`` children per node at depth d (e.g. [3, 2, 1]:
      3 + 6 + 6 nodes), or an explicit list of paths of child ranks, Medusa's "choices"
      (``tree_choices`` = [[0], [1], [0, 0], ...]; prefix-closed). Greedy takes the draft's top
      ranks; sampling draws the children of a node without replacement from the processed draft
      distribution. Default [2, 1, 1] (6 nodes).
    - ``dynamic`` (EAGLE-2's idea): ``k`` levels; at each level the ``tree_topk`` deepest nodes with
      the highest cumulative draft probability get ``tree_topk`` children each; greedy then reranks
      all candidates to the ``tree_budget`` best (sampling keeps every drawn node and stops
      drawing at the budget instead, since dropping drawn nodes by their own value would bias the
      proposal). Defaults k levels, tree_topk 2, tree_budget 6.

    The draft model scores each level of the tree in one forward with its own tree mask; trees
    need schedule=constant.

    Self-speculation (no second model; the target's own weights, shared, not copied):

    - early_exit (LayerSkip, Kangaroo): draft with the first ``exit_layer`` decoder layers, then the
      target's final norm and LM head; ``confidence_threshold`` stops drafting when the draft's
      top probability falls below it.
    - layer_skip (Draft & Verify, SWIFT): draft with the layers in ``skip_layers`` skipped, or with
      the set saved by ``specdraft tune-skip`` (``skip_config``: path of its JSON).

    Both draft like draft_model (chains with any schedule, or trees via ``tree``).

    Trained heads on the target's own features (``head``: a directory from ``specdraft train``;
    checked against the target on load):

    - medusa (specdraft.drafters.medusa): K residual heads + the target's LM head; head i predicts
      the token i + 2 ahead. ``tree="chain"`` drafts min(k, K) tokens (each head's top-1 / a draw);
      ``tree="static"`` drafts the Medusa tree given by ``tree_choices`` (or ``tree_branching``),
      at most K deep.
    - eagle (specdraft.drafters.eagle): one decoder layer autoregressive on the target's features;
      ``tree="chain"`` drafts a chain of ``k`` tokens; ``tree="dynamic"`` drafts EAGLE-2's dynamic
      tree and ``tree="static"`` a fixed shape (the same ``tree_*`` fields as the draft model's
      trees), the head scoring one tree level per forward with its own tree mask.
    - eagle3 (specdraft.drafters.eagle3): the same, on three of the target's layers fused, with the
      head's own LM head over a reduced draft vocabulary (EAGLE-3); the same ``tree`` values.

    The engine choosing how to draft (docs/design.md, "Choosing how to draft"):

    - hybrid (drafters/hybrid.py, SAM-Decoding's idea): the suffix automaton (``retrieval_k`` deep,
      the suffix fields above) drafts when its match is at least ``hybrid_min_match`` tokens, the
      draft model (``k``, ``tree``) otherwise; ``hybrid_merge`` (greedy; its own parameter,
      ``HybridParams``) drafts both into one tree.
    - cascade (CS-Drafting's vertical cascade): the draft model drafts ``k`` tokens, and prompt
      lookup (``min_ngram`` .. ``max_ngram``) proposes up to ``cascade_k`` (``CascadeParams``) tokens
      per draft forward, which the draft model checks in that forward (lossless for the draft's own q, so
      for the target).
    - auto (drafters/auto.py): per request, each step drafts with the arm (plain, prompt_lookup,
      suffix, draft_model, hybrid, cascade, ...; ``auto_arms`` restricts them) with the best
      measured tokens per second of this machine's cost curve; priors from ``autotune``.

    ``lossy`` (default None: every method is lossless) opts into a verification rule that does not
    preserve the target's distribution. The only one is ``"typical"``, Medusa's typical acceptance
    (``verify.TypicalAcceptance``): when sampling, a draft token is kept if the target's probability
    of it exceeds min(``typical_epsilon``, ``typical_delta`` x exp(-entropy)). At temperature 0 it has no
    effect (greedy verification). Results made with it carry ``"lossy": "typical"`` in their stats.

    Which methods take which ``tree`` and ``schedule`` values, what each needs and which settings it reads is
    the method table's (``specdraft.core.methods.REGISTRY``); ``validate`` reads it.

    ``schedule`` sets the draft length per step: ``constant`` (k), ``heuristic`` (transformers'
    rule: k + 2 after a fully accepted step, k - 1 otherwise, within 1..max_k; the model drafters only) or
    ``cost_aware`` (specdraft.core.policy: measured step costs and acceptance pick k in 0..k each step,
    0 meaning a plain step, so speculation never runs where it does not pay). A schedule changes only
    what is drafted, never what is emitted.
    """

    method: str = field_with(DEFAULT_METHOD, Choice(REGISTRY, what="method"))
    k: int = field_with(4, Int(min=1, max=MAX_DRAFT, what="draft tokens per step"))
    schedule: str = field_with("constant", Choice(SCHEDULES, what="schedule"))
    max_k: int = field_with(16, Int(max=MAX_DRAFT))
    tree: str = field_with("chain", Choice(ALL_TREES, what="tree"))
    # opt-in LOSSY verification (any method, sampling only): "typical" = Medusa's typical acceptance
    lossy: str | None = field_with(
        None,
        Choice(LOSSY_RULES, what="lossy rule", optional=True, note="(or null, the default: lossless verification)"),
    )
    typical_epsilon: float = field_with(0.09, Number(min=0, max=1, min_open=True))
    typical_delta: float = field_with(0.3, Number(min=0, finite=True))
    # the method's own settings: before validation their flat keys (``Unchecked``), after it the method's
    # ``params`` dataclass, checked (None for a method without any)
    params: Any = None

    # rules across fields, after each field's own constraints: (ok, message)
    RULES = (
        (lambda s: s.max_k >= s.k, lambda s: f"max_k must be >= k, got max_k={s.max_k} < k={s.k}"),
        (
            lambda s: s.tree == "chain" or s.schedule == "constant",
            lambda s: f"tree={s.tree!r} needs schedule 'constant', got {s.schedule!r}",
        ),
    )

    def __init__(self, params: Any = None, **keys: Any):
        """The fields by name (the others at their defaults), and the method's own settings as flat keys
        (``head=DIR``) and / or ``params`` (a dict of them, or the method's dataclass)."""
        for f in dataclasses.fields(self):
            if f.name != "params":
                object.__setattr__(self, f.name, keys.pop(f.name) if f.name in keys else default_of(f))
        if keys:  # flat settings, over those of ``params`` (an object of another kind is validate's to refuse)
            base = _settings(params)
            if base is None or isinstance(base, dict):
                params = {**(base or {}), **keys}
        if params is None or isinstance(params, dict):
            params = Unchecked(params or {})
        object.__setattr__(self, "params", params)

    def validate(self) -> "SpecConfig":
        """A checked copy: each field's constraints, the cross-field RULES, then the method's rules from the
        table (its own settings made its ``params`` dataclass, checked). Reads no files (heads, datastores
        and skip configs are checked when loaded); this object is left as it was. A checked spec is returned
        as it is: a request's spec is checked once, wherever it enters."""
        if is_checked(self):
            return self
        out = checked(self)
        check_rules(out, self.RULES)
        m = REGISTRY[out.method]
        out = dataclasses.replace(out, params=_method_params(m, out.params))
        _check_method(m, out)
        return mark_checked(out)

    def get(self, key: str, default: Any = None) -> Any:
        """Spec key ``key``: a field, or the method's own setting (``default`` when the method has none of
        that name)."""
        if key in _FIELDS:
            return getattr(self, key)
        p = self.params
        return p.get(key, default) if isinstance(p, dict) else getattr(p, key, default)

    def lossy_rule(self):
        """The opt-in lossy verification rule, or None (lossless, the default)."""
        if self.lossy == "typical":
            from .verify import TypicalAcceptance

            return TypicalAcceptance(float(self.typical_epsilon), float(self.typical_delta))
        return None

    @classmethod
    def from_dict(cls, d) -> "SpecConfig":
        """Flat keys: the fields, and the method's own settings (validate sorts out whose they are)."""
        if d is None or isinstance(d, cls):
            return (d or cls()).validate()
        if not isinstance(d, dict):
            raise ConfigError(f"SpecConfig must be a JSON object, got {type(d).__name__}")
        return cls(**d).validate()

    @classmethod
    def from_json(cls, s: str) -> "SpecConfig":
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ConfigError(f"spec config is not valid JSON: {e}") from e
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        """Flat: the method's own settings sit beside the fields (from_dict takes them back); a copy."""
        return {**{name: getattr(self, name) for name in _FIELD_ORDER}, **(_settings(self.params) or {})}


class Unchecked(dict):
    """A spec's settings before ``validate``: flat keys. Read as attributes (``spec.params.NAME``, what drafters
    do) they say the spec needs validating, instead of a bare AttributeError or a silent default."""

    def __getattr__(self, name: str):
        raise AttributeError(
            f"spec setting {name!r} is read before the spec was validated: use SpecConfig(...).validate() "
            "(SpecDecoder, the CLI, the server and the bench do)"
        )


def _settings(params: Any) -> Any:
    """A method's settings as a dict of flat keys (a copy) when they are its dataclass or a dict; else as given."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    return copy.deepcopy(params) if isinstance(params, dict) else params


_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(SpecConfig) if f.name != "params")
_FIELDS = frozenset(_FIELD_ORDER)


def _check_method(m: Method, spec: SpecConfig) -> None:
    """The method's own rules: a head it needs, the trees and schedules it takes, its entry's ``check``."""
    if m.needs == "head" and spec.params.head is None:
        raise ConfigError(
            f"method {spec.method!r} needs head=DIR (--head DIR), a head trained with "
            f"`specdraft train {spec.method} --target NAME --data PROMPTS.jsonl -o DIR`"
        )
    if spec.tree not in m.trees:
        takes = [n for n, x in REGISTRY.items() if spec.tree in x.trees]
        raise ConfigError(
            f"tree={spec.tree!r} is for methods {and_list(takes)} (prompt_lookup makes trees with branches > 1)"
        )
    if spec.schedule not in m.schedules:
        raise ConfigError(
            f"schedule {spec.schedule!r} is not available for method {spec.method!r}; it takes: "
            f"{', '.join(m.schedules)}"
        )
    problem = m.check(spec) if m.check is not None else None
    if problem:
        raise ConfigError(problem)


def _who(users: tuple[str, ...]) -> str:
    return f"method {users[0]!r}" if len(users) == 1 else f"methods {and_list(users)}"


def _foreign(name: str, users: tuple[str, ...], method) -> str:
    return f"{name} is used by {_who(users)} only, not {method!r}"


def _param_owners(name: str) -> tuple[str, ...]:
    """The methods whose own settings (their entry's ``params`` dataclass) include ``name``."""
    return tuple(m.name for m in REGISTRY.values() if name in m.param_names())


def _param_default(name: str, users: tuple[str, ...]) -> list:
    return [REGISTRY[u].param_default(name) for u in users]


def _method_params(m: Method, given):
    """``given`` (None, a dict of flat keys, or an instance) as method ``m``'s checked settings (None when it
    has none). An unknown key is an error; another method's setting is one naming that method, unless at its
    default (then dropped: a spec's to_dict under another method)."""
    clash = sorted(set(m.param_names()) & _FIELDS)
    if clash:  # a flat key means one thing: a SpecConfig field is never a method's own setting
        raise ValueError(f"method {m.name!r}: its settings {clash} are SpecConfig fields; name them otherwise")
    if isinstance(given, dict):
        own = set(m.param_names())
        unknown = [k for k in given if k not in own and not _param_owners(k)]
        if unknown:
            raise ConfigError(f"unknown SpecConfig field(s) {sorted(unknown)}; valid fields: {sorted(spec_keys())}")
        for name in [k for k in given if k not in own]:
            if not is_default(name, given[name]):
                raise ConfigError(_foreign(name, _param_owners(name), m.name))
        given = m.params(**{k: v for k, v in given.items() if k in own}) if m.params is not None else None
    if given is None:
        given = m.params() if m.params is not None else None
    elif m.params is None or not isinstance(given, m.params):
        raise ConfigError(
            f"params must be the parameters of method {m.name!r}"
            f"{'' if m.params else ' (it has none)'}, got {type(given).__name__}"
        )
    if given is not None:
        given = checked(given)
        check_params(given)
    return given


def spec_keys() -> set[str]:
    """Every key a spec dict may hold: SpecConfig's fields and each registered method's own settings."""
    return set(_FIELDS) | {name for m in REGISTRY.values() for name in m.param_names()}


def readers(key: str) -> tuple[str, ...] | None:
    """The methods that read spec key ``key`` (a method's own setting); None: every method (a field, or an
    unknown key, which validation refuses)."""
    if key in _FIELDS:
        return None
    return _param_owners(key) or None


def is_default(key: str, value) -> bool:
    """Whether ``value`` is spec key ``key``'s default (for a method's own setting, one of its owners')."""
    if key in _FIELDS:
        return value == default_of(SpecConfig.__dataclass_fields__[key])
    users = _param_owners(key)
    return bool(users) and value in _param_default(key, users)


def for_method(d: dict, method) -> dict:
    """Spec dict ``d`` (a server's default, a bench's shared settings) with ``method``: the keys only other
    methods read are left out, so they take their defaults (``method`` would refuse them)."""
    return {**{k: v for k, v in d.items() if (users := readers(k)) is None or method in users}, "method": method}


def unread(d: dict, methods) -> str | None:
    """Why spec dict ``d`` sets a key (to a non-default value) that none of ``methods`` reads, or None."""
    for k, v in d.items():
        users = readers(k)
        if users is not None and not is_default(k, v) and not set(users) & set(methods):
            return f"{k} is used by {_who(users)} only, none of {and_list(methods)}"
    return None


def with_method(spec: SpecConfig, method: str) -> SpecConfig:
    """``spec`` with another method; the settings only other methods read go back to their defaults."""
    return SpecConfig.from_dict(for_method(spec.to_dict(), method))


def fallback_method(has_draft: bool) -> str:
    """The method that runs when ``auto`` cannot (the default before auto was): the draft model when
    there is one, else prompt lookup (model-free, runs everywhere)."""
    return "draft_model" if has_draft else "prompt_lookup"


def spec_with_default(d: dict | None, has_draft: bool) -> SpecConfig:
    """A SpecConfig dict that names no method -> ``auto``; when its other keys rule auto out (a token
    tree, a schedule auto does not take), ``fallback_method``, for which such keys were written."""
    d = dict(d or {})
    if "method" in d:
        return SpecConfig.from_dict(d)
    try:
        return SpecConfig.from_dict({**d, "method": DEFAULT_METHOD})
    except ConfigError:
        return SpecConfig.from_dict({**d, "method": fallback_method(has_draft)})
