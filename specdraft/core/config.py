"""The two configuration objects: what to sample (SamplingParams) and how to speculate (SpecConfig).

Both round-trip through plain dicts / JSON with validation, so the CLI (``--config FILE.json``), the
benchmark and the server all take the same object.

Validation is declarative: each field carries its constraint (``field(metadata={"check": ...})``,
small objects below: ``Int``, ``Number``, ``Choice``, ``IntList``, ``OptStr``, ...), one generic loop
(``_check_fields``) applies them, then a short list of cross-field rules, then the method's own rules,
read from the method registry: the table ``REGISTRY`` below, which ``specdraft.drafters.registry`` fills (its
entries make drafters, a layer above this one, so config does not import it). Validation reads no files: a head's type
and target, a datastore's vocabulary or a skip config are checked when they are loaded.

Each field that only some methods read names them (``used_by``); set for another method it is an error
naming them. A method registered with parameters of its own (``Method.params``, a dataclass declared with
``param``) takes them as flat keys of the same JSON, held in ``SpecConfig.params``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError

ALL_TREES = ("chain", "static", "dynamic")
SCHEDULES = ("constant", "heuristic", "cost_aware")  # every schedule (SpecConfig.schedule, the CLI's choices)
# name -> methods.Method: filled by specdraft.drafters.registry, which specdraft/__init__ imports before any use
REGISTRY: dict[str, Any] = {}


def methods_needing(*needs: str) -> tuple[str, ...]:
    return tuple(m.name for m in REGISTRY.values() if m.needs in needs)


def model_methods() -> tuple[str, ...]:
    """The methods whose drafts a model makes (a draft model or the target's own layers)."""
    return methods_needing("draft_model", "layer_view")


def methods_taking(tree: str) -> tuple[str, ...]:
    return tuple(m.name for m in REGISTRY.values() if tree in m.trees)


# Defaults measured for the Qwen2.5-Coder 1.5B + 0.5B pair in float32 on this project's 2-core CPU
# (`specdraft batchbench`, docs/server.md#measured-crossover-qwen-pair): relative to plain decoding at the
# same batch size, speculation does best at 2 rows and loses more from 4 rows on, most at 8.
SPEC_SHRINK_AT = 4
SPEC_OFF_AT = 8

# Temperatures below this sample greedily (argmax): dividing logits by a tiny temperature overflows
# to inf / NaN probabilities, and the distribution is one-hot at such temperatures anyway.
GREEDY_BELOW = 1e-5

LOSSY_RULES = ("typical",)
# the methods that read a group of SpecConfig fields (``used_by``)
NGRAM_LOOKUP = ("prompt_lookup", "cascade")  # prompt lookup's n-gram match (cascade's proposals)
RETRIEVAL = ("suffix", "hybrid")  # the suffix automaton's draft tree
# SpecConfig fields that name a file or directory: a server takes them from its operator only (by name)
PATH_FIELDS = ("skip_config", "datastore", "head", "autotune")

# Upper bounds on what one request may ask a drafter to hold (a server takes specs from clients): a
# draft at most MAX_DRAFT deep (the cost-aware schedule times a forward of k + 1 tokens), a token tree
# of at most MAX_TREE_NODES nodes (its attention mask is nodes^2; llama.cpp gives each leaf one of its
# 256 sequence ids), Token Recycling's table at most MAX_RECYCLE_TOPK successors per token ([V, top_k]).
MAX_DRAFT = 64
MAX_TREE_NODES = 256
MAX_RECYCLE_TOPK = 16
MAX_NGRAM = 32


# --- constraints: each is called as check(name, value) and returns the (normalized) value or raises --
def _and(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Int:
    """An integer >= ``min`` (no bound when None); ``what`` explains the field in messages, ``note``
    follows the bound (e.g. "0 = disabled")."""

    min: int | None = None
    what: str = ""
    note: str = ""
    optional: bool = False
    max: int | None = None

    def __call__(self, name, v):
        if v is None and self.optional:
            return v
        label = f"{name} ({self.what})" if self.what else name
        if not _is_int(v):
            raise ConfigError(f"{label} must be an integer, got {v!r}")
        if self.min is not None and v < self.min:
            raise ConfigError(f"{label} must be >= {self.min}{f' ({self.note})' if self.note else ''}, got {v}")
        if self.max is not None and v > self.max:
            raise ConfigError(f"{label} must be <= {self.max}, got {v}")
        return v


@dataclass(frozen=True)
class Number:
    """A real number (returned as float) in the interval from ``min`` to ``max``, each end closed
    unless ``*_open``; ``finite`` also rules out infinity (NaN never passes)."""

    min: float | None = None
    max: float | None = None
    min_open: bool = False
    max_open: bool = False
    finite: bool = False
    note: str = ""

    def __call__(self, name, v):
        if not _is_num(v):
            raise ConfigError(f"{name} must be a number, got {v!r}")
        ok = not math.isnan(v) and not (self.finite and math.isinf(v))
        if self.min is not None:
            ok = ok and (v > self.min if self.min_open else v >= self.min)
        if self.max is not None:
            ok = ok and (v < self.max if self.max_open else v <= self.max)
        if not ok:
            if self.min is not None and self.max is not None:
                rng = f"in {'(' if self.min_open else '['}{self.min:g}, {self.max:g}{')' if self.max_open else ']'}"
            else:
                bound = self.min if self.max is None else self.max
                op = (">" if self.min_open else ">=") if self.max is None else ("<" if self.max_open else "<=")
                rng = f"{'a finite number ' if self.finite else ''}{op} {bound:g}"
            raise ConfigError(f"{name} must be {rng}{f' ({self.note})' if self.note else ''}, got {v}")
        return float(v)


@dataclass(frozen=True)
class Choice:
    """One of ``choices`` (a tuple, or a dict whose keys are read when checking, e.g. the live
    method registry); ``optional``: None allowed, ``note`` ends the message."""

    choices: Any
    what: str = ""
    optional: bool = False
    note: str = ""

    def __call__(self, name, v):
        if v is None and self.optional:
            return v
        if not (isinstance(v, str) and v in self.choices):
            raise ConfigError(
                f"unknown {self.what or name} {v!r}; choose one of: {', '.join(self.choices)}"
                + (f" {self.note}" if self.note else "")
            )
        return v


@dataclass(frozen=True)
class IntList:
    """A list (a tuple is accepted and made a list) of integers >= ``min`` (any integer when None),
    non-empty unless ``nonempty`` is False."""

    min: int | None = 1
    nonempty: bool = True
    what: str = ""
    max: int | None = None  # each integer's bound
    max_len: int | None = None

    def __call__(self, name, v):
        if isinstance(v, tuple):
            v = list(v)
        if (
            not isinstance(v, list)
            or (self.nonempty and not v)
            or not all(
                _is_int(b) and (self.min is None or b >= self.min) and (self.max is None or b <= self.max) for b in v
            )
        ):
            kind = (
                "integers" + (f" >= {self.min}" if self.min is not None else "")
                if self.max is None
                else f"integers in [{self.min}, {self.max}]"
            )
            raise ConfigError(
                f"{name} must be a {'non-empty ' if self.nonempty else ''}list of {kind}"
                f"{f' ({self.what})' if self.what else ''}, got {v!r}"
            )
        if self.max_len is not None and len(v) > self.max_len:
            raise ConfigError(f"{name} has {len(v)} entries; at most {self.max_len}")
        return v


@dataclass(frozen=True)
class StrList:
    """A list of non-empty strings (a single string becomes a list of one), at most ``max_len``."""

    max_len: int | None = None

    def __call__(self, name, v):
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ConfigError(f"{name} must be a list of non-empty strings, got {v!r}")
        if self.max_len is not None and len(v) > self.max_len:
            raise ConfigError(f"{name} has {len(v)} entries; at most {self.max_len}")
        return v


@dataclass(frozen=True)
class Bool:
    def __call__(self, name, v):
        if not isinstance(v, bool):
            raise ConfigError(f"{name} must be true or false, got {v!r}")
        return v


@dataclass(frozen=True)
class OptStr:
    """None, or a non-empty string (``what``: what the string is, e.g. a path)."""

    what: str = "a string"

    def __call__(self, name, v):
        if v is not None and (not isinstance(v, str) or not v):
            raise ConfigError(f"{name} must be {self.what} (string) or null, got {v!r}")
        return v


@dataclass(frozen=True)
class TokenBias:
    """{token id: bias}, OpenAI's ``logit_bias``: ids may arrive as JSON strings ("50256"); biases are
    numbers in [-100, 100]. Normalized to {int: float}."""

    def __call__(self, name, v):
        if not isinstance(v, dict):
            raise ConfigError(f"{name} must be an object mapping token ids to biases, got {v!r}")
        out = {}
        for k, b in v.items():
            # ASCII digits only: "²".isdigit() is True, yet int("²") raises (found by tests/test_fuzz.py)
            tid = int(k) if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit() else k
            if not _is_int(tid) or tid < 0:
                raise ConfigError(f"{name} keys must be token ids (integers >= 0), got {k!r}")
            out[tid] = Number(min=-100, max=100)(f"{name}[{k}]", b)
        return out


@dataclass(frozen=True)
class JsonSchema:
    """None, or a JSON schema: an object, or a string holding one."""

    def __call__(self, name, v):
        if v is None:
            return v
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ConfigError(f"{name} is not valid JSON: {e}") from None
        if not isinstance(v, dict):
            raise ConfigError(f"{name} must be a JSON schema (a JSON object), got {type(v).__name__}")
        return v


@dataclass(frozen=True)
class TreeSize:
    """A branching list (children per node at each depth) making at most ``max_nodes`` nodes in at
    most ``max_depth`` depths."""

    max_depth: int
    max_nodes: int

    def __call__(self, name, v):
        if len(v) > self.max_depth:
            raise ConfigError(f"{name} has {len(v)} depths; at most {self.max_depth}")
        n, width = 0, 1
        for b in v:
            width *= b
            n += width
        if n > self.max_nodes:
            raise ConfigError(f"{name} {v} makes a tree of {n} nodes; at most {self.max_nodes}")
        return v


@dataclass(frozen=True)
class Choices:
    """Medusa-style tree choices: None, or a list of paths of child ranks, prefix-closed, ranks contiguous."""

    def __call__(self, name, v):
        if v is not None:
            check_choices(v)
            if len(v) > MAX_TREE_NODES or max(len(c) for c in v) > MAX_DRAFT:
                raise ConfigError(
                    f"{name} makes a tree of {len(v)} nodes, {max(len(c) for c in v)} deep; at most "
                    f"{MAX_TREE_NODES} nodes, {MAX_DRAFT} deep"
                )
        return v


def check_choices(choices) -> None:
    """Medusa-style choices: a list of paths of child ranks, prefix-closed, ranks contiguous."""
    if not isinstance(choices, list) or not choices:
        raise ConfigError(f"tree_choices must be a non-empty list of paths like [[0], [1], [0, 0]], got {choices!r}")
    paths = set()
    for c in choices:
        if not isinstance(c, list) or not c or not all(_is_int(r) and r >= 0 for r in c):
            raise ConfigError(f"each tree_choices entry must be a non-empty list of ranks >= 0, got {c!r}")
        paths.add(tuple(c))
    for c in paths:
        if len(c) > 1 and c[:-1] not in paths:
            raise ConfigError(f"tree_choices is not prefix-closed: {list(c)} needs {list(c[:-1])}")
        if c[-1] > 0 and c[:-1] + (c[-1] - 1,) not in paths:
            raise ConfigError(f"tree_choices skips a rank: {list(c)} needs {list(c[:-1] + (c[-1] - 1,))}")


def _f(default, *checks, used_by: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None):
    """A dataclass field with its constraints (``checks``, applied in order) and, for a field that only
    some methods read, ``used_by``: those methods' names (or a function of the registry giving them);
    setting it to a non-default value for another method is an error. A list default is copied per instance."""
    md = {"checks": checks, "used_by": used_by}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=md)
    return field(default=default, metadata=md)


param = _f  # a method's own parameter, declared in its ``params`` dataclass (methods.Method) like a field here


def _check_fields(obj) -> None:
    """The one generic loop: every field's constraints, in declaration order (values may be normalized,
    e.g. ints to floats, a tuple to a list)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        for check in f.metadata.get("checks", ()):
            v = check(f.name, v)
        setattr(obj, f.name, v)


def _check_rules(obj, rules) -> None:
    """Cross-field rules: (ok(obj) -> bool, message(obj) -> str) pairs."""
    for ok, message in rules:
        if not ok(obj):
            raise ConfigError(message(obj))


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
    obj = cls(**d)
    obj.validate()
    return obj


@dataclass
class SamplingParams:
    """temperature 0 means greedy, and so does any temperature below ``GREEDY_BELOW`` (1e-5): such a
    distribution is one-hot in practice, and dividing logits by it would overflow. top_k 0 and
    top_p 1.0 mean no truncation."""

    temperature: float = _f(0.0, Number(min=0, finite=True, note="0 = greedy"))
    top_k: int = _f(0, Int(min=0, note="0 = disabled"))
    top_p: float = _f(1.0, Number(min=0, max=1, min_open=True))
    min_p: float = _f(0.0, Number(min=0, max=1, note="0 = off"))
    seed: int | None = _f(None, Int(min=-(2**63), max=2**64 - 1, optional=True))  # torch's generator range
    max_new_tokens: int = _f(128, Int(min=1))
    stop: list[str] = _f([], StrList())
    ignore_eos: bool = False
    # history-dependent processing (specdraft/core/processors.py), before temperature / top-k / top-p
    # bounded: a penalty near 0 divides logits into inf (NaN probabilities), found by tests/test_fuzz.py
    repetition_penalty: float = _f(1.0, Number(min=0.01, max=100, note="1 = off"))
    presence_penalty: float = _f(0.0, Number(min=-2, max=2))
    frequency_penalty: float = _f(0.0, Number(min=-2, max=2))
    logit_bias: dict = _f({}, TokenBias())
    min_tokens: int = _f(0, Int(min=0, note="EOS is masked until this many tokens were generated"))
    # structured output (at most one): every emitted token keeps the text a prefix of a match
    json_schema: dict | None = _f(None, JsonSchema())
    regex: str | None = _f(None, OptStr("a regular expression"))
    grammar: str | None = _f(None, OptStr("a Lark grammar"))
    # the target's log-probabilities of the emitted tokens, with this many alternatives (0-20)
    logprobs: int | None = _f(None, Int(min=0, max=20, optional=True, what="top alternatives per token"))

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
        _check_fields(self)
        _check_rules(self, self.RULES)
        return self

    @classmethod
    def from_dict(cls, d):
        return _from_dict(cls, d)

    def to_dict(self):
        return dataclasses.asdict(self)


DEFAULT_METHOD = "auto"  # what runs when no method is named: SpecConfig(), the library, `generate`, `serve`


@dataclass
class SpecConfig:
    """How to speculate. ``method`` picks the drafter; the other fields configure it.

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

    Which methods take which ``tree`` and ``schedule`` values, and what each needs, is the method
    registry's (``specdraft.drafters.registry.REGISTRY``); ``validate`` reads it.

    ``schedule`` sets the draft length per step: ``constant`` (k), ``heuristic`` (transformers'
    rule: k + 2 after a fully accepted step, k - 1 otherwise, within 1..max_k; the model drafters only) or
    ``cost_aware`` (specdraft.core.policy: measured step costs and acceptance pick k in 0..k each step,
    0 meaning a plain step, so speculation never runs where it does not pay). A schedule changes only
    what is drafted, never what is emitted.
    """

    method: str = _f(DEFAULT_METHOD, Choice(REGISTRY, what="method"))
    k: int = _f(4, Int(min=1, max=MAX_DRAFT, what="draft tokens per step"))
    schedule: str = _f("constant", Choice(SCHEDULES, what="schedule"))
    max_k: int = _f(16, Int(max=MAX_DRAFT))
    confidence_threshold: float = _f(0.0, Number(min=0, max=1, max_open=True), used_by=model_methods)
    min_ngram: int = _f(1, Int(max=MAX_NGRAM), used_by=NGRAM_LOOKUP)
    max_ngram: int = _f(3, Int(max=MAX_NGRAM), used_by=NGRAM_LOOKUP)
    branches: int = _f(1, Int(min=1, max=32, note="1 = a chain"), used_by=("prompt_lookup",))
    tree: str = _f("chain", Choice(ALL_TREES, what="tree"))
    # tree defaults: the best-measured shapes on this project's CPU (docs/benchmarks.md, token trees),
    # where a forward costs about linear in the tokens it scores; chain stays the default there
    # a static shape's fields, a dynamic tree's fields: read by the methods that take such a tree
    tree_branching: list[int] = _f(
        [2, 1, 1],
        IntList(min=1),
        TreeSize(max_depth=MAX_DRAFT, max_nodes=MAX_TREE_NODES),
        used_by=lambda: methods_taking("static"),
    )
    tree_choices: list[list[int]] | None = _f(None, Choices(), used_by=lambda: methods_taking("static"))
    tree_budget: int = _f(6, Int(min=1, max=MAX_TREE_NODES), used_by=lambda: methods_taking("dynamic"))
    tree_topk: int = _f(2, Int(min=1, max=16), used_by=lambda: methods_taking("dynamic"))
    skip_layers: list[int] = _f(
        [], IntList(min=None, nonempty=False, what="layer indices", max_len=4096), used_by=("layer_skip",)
    )
    skip_config: str | None = _f(None, OptStr("a path"), used_by=("layer_skip",))
    # suffix, and hybrid's retrieval (methods.retrieval_spec); auto passes tree_nodes to its hybrid arm
    max_spec_factor: float = _f(1.0, Number(min=0, max=1000, min_open=True), used_by=RETRIEVAL)
    min_token_prob: float = _f(0.1, Number(min=0, max=1), used_by=RETRIEVAL)
    tree_nodes: int = _f(
        24, Int(min=1, max=MAX_TREE_NODES, what="draft tree node budget"), used_by=RETRIEVAL + ("auto",)
    )
    max_occurrences: int = _f(256, Int(min=1, max=65536), used_by=RETRIEVAL)
    datastore: str | None = _f(None, OptStr("a path"), used_by=("suffix",))
    # hybrid (retrieval when its match is long, the draft model otherwise) and auto's retrieval arms
    retrieval_k: int = _f(16, Int(min=1, max=MAX_DRAFT, what="depth of retrieval drafts"), used_by=("hybrid", "auto"))
    hybrid_min_match: int = _f(
        4, Int(min=1, max=4096, what="suffix match length from which retrieval drafts"), used_by=("hybrid", "auto")
    )
    # auto: the autotune file with its arms' priors (None = the file `specdraft autotune` wrote for this
    # target, draft, backend and CPU, if any; "off" = none, online calibration only)
    autotune: str | None = _f(None, OptStr("a path"), used_by=("auto",))
    # medusa / eagle / eagle3 (and auto, whose eagle3 arms read it): the trained head's directory (specdraft
    # train); its type and target are checked when it is loaded (heads.load_head), not here
    head: str | None = _f(None, OptStr("a directory path"), used_by=lambda: methods_needing("head") + ("auto",))
    # opt-in LOSSY verification (any method, sampling only): "typical" = Medusa's typical acceptance
    lossy: str | None = _f(
        None,
        Choice(LOSSY_RULES, what="lossy rule", optional=True, note="(or null, the default: lossless verification)"),
    )
    typical_epsilon: float = _f(0.09, Number(min=0, max=1, min_open=True))
    typical_delta: float = _f(0.3, Number(min=0, finite=True))
    # the parameters of a method registered with its own (its registry entry's ``params`` dataclass): flat
    # keys in JSON, gathered here by from_dict; validate makes them that dataclass, checked
    params: Any = None

    # rules across fields, after each field's own constraints: (ok, message)
    RULES = (
        (lambda s: s.max_k >= s.k, lambda s: f"max_k must be >= k, got max_k={s.max_k} < k={s.k}"),
        (
            lambda s: 1 <= s.min_ngram <= s.max_ngram,
            lambda s: f"need 1 <= min_ngram <= max_ngram, got min_ngram={s.min_ngram}, max_ngram={s.max_ngram}",
        ),
        (
            lambda s: s.branches * s.k <= MAX_TREE_NODES,
            lambda s: f"branches ({s.branches}) x k ({s.k}) makes a tree of more than {MAX_TREE_NODES} nodes",
        ),
        (
            lambda s: s.tree == "chain" or s.schedule == "constant",
            lambda s: f"tree={s.tree!r} needs schedule 'constant', got {s.schedule!r}",
        ),
    )

    def validate(self) -> "SpecConfig":
        """Each field's constraints, the cross-field RULES, then the method's rules from the registry.
        Reads no files (heads, datastores and skip configs are checked when loaded)."""
        _check_fields(self)
        _check_rules(self, self.RULES)
        self._check_method()
        return self

    def _check_method(self) -> None:
        m = REGISTRY[self.method]
        for f in dataclasses.fields(self):  # fields only some methods read, set for another method
            users, default = _users(f), _default(f)
            if users is not None and getattr(self, f.name) != default and self.method not in users:
                raise ConfigError(_foreign(f.name, users, self.method))
        self.params = _method_params(m, self.params)
        if m.needs == "head" and self.head is None:
            raise ConfigError(
                f"method {self.method!r} needs head=DIR (--head DIR), a head trained with "
                f"`specdraft train {self.method} --target NAME --data PROMPTS.jsonl -o DIR`"
            )
        if self.tree not in m.trees:
            takes = [n for n, x in REGISTRY.items() if self.tree in x.trees]
            raise ConfigError(
                f"tree={self.tree!r} is for methods {_and(takes)} (prompt_lookup makes trees with branches > 1)"
            )
        if self.schedule not in m.schedules:
            raise ConfigError(
                f"schedule {self.schedule!r} is not available for method {self.method!r}; it takes: "
                f"{', '.join(m.schedules)}"
            )
        problem = m.check(self) if m.check is not None else None
        if problem:
            raise ConfigError(problem)

    def lossy_rule(self):
        """The opt-in lossy verification rule, or None (lossless, the default)."""
        if self.lossy == "typical":
            from .verify import TypicalAcceptance

            return TypicalAcceptance(float(self.typical_epsilon), float(self.typical_delta))
        return None

    @classmethod
    def from_dict(cls, d):
        """Flat keys that are no field but a method's parameter go to ``params`` (validate sorts out whose)."""
        if isinstance(d, dict):
            gathered = {k: v for k, v in d.items() if k not in _FIELDS and _param_owners(k)}
            if gathered:
                d = {**{k: v for k, v in d.items() if k not in gathered}, "params": gathered}
        return _from_dict(cls, d)

    @classmethod
    def from_json(cls, s: str):
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ConfigError(f"spec config is not valid JSON: {e}") from e
        return cls.from_dict(d)

    def to_dict(self):
        """Flat: the method's own parameters sit beside the fields (from_dict takes them back)."""
        d = dataclasses.asdict(self)
        params = d.pop("params")
        return {**d, **(params if isinstance(params, dict) else {})}


_FIELDS = frozenset(f.name for f in dataclasses.fields(SpecConfig)) - {"params"}


def _who(users: tuple[str, ...]) -> str:
    return f"method {users[0]!r}" if len(users) == 1 else f"methods {_and(users)}"


def _foreign(name: str, users: tuple[str, ...], method) -> str:
    return f"{name} is used by {_who(users)} only, not {method!r}"


def _param_owners(name: str) -> tuple[str, ...]:
    """The methods whose own parameters (their entry's ``params`` dataclass) include ``name``."""
    return tuple(
        m.name
        for m in REGISTRY.values()
        if m.params is not None and name in {f.name for f in dataclasses.fields(m.params)}
    )


def _param_default(name: str, users: tuple[str, ...]) -> list:
    return [_default(REGISTRY[u].params.__dataclass_fields__[name]) for u in users]


def _method_params(m, given):
    """``given`` (None, a dict of flat keys, or an instance) as method ``m``'s validated parameters (None when it
    has none). Another method's parameter is an error naming that method, unless at its default (then dropped)."""
    if isinstance(given, dict):
        own = {f.name for f in dataclasses.fields(m.params)} if m.params is not None else set()
        for name in set(given) - own:
            users = _param_owners(name)
            if not users:
                raise ConfigError(f"unknown SpecConfig field(s) [{name!r}]; valid fields: {sorted(spec_keys())}")
            if not is_default(name, given[name]):
                raise ConfigError(_foreign(name, users, m.name))
        given = m.params(**{k: v for k, v in given.items() if k in own}) if m.params is not None else None
    if given is None:
        given = m.params() if m.params is not None else None
    elif m.params is None or not isinstance(given, m.params):
        raise ConfigError(
            f"params must be the parameters of method {m.name!r}"
            f"{'' if m.params else ' (it has none)'}, got {type(given).__name__}"
        )
    if given is not None:
        _check_fields(given)
    return given


def spec_keys() -> set[str]:
    """Every key a spec dict may hold: SpecConfig's fields and each registered method's own parameters."""
    return set(_FIELDS) | {
        f.name for m in REGISTRY.values() if m.params is not None for f in dataclasses.fields(m.params)
    }


def _users(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The methods that read a SpecConfig field (None: every method)."""
    users = f.metadata.get("used_by")
    return users() if callable(users) else users


def _default(f: dataclasses.Field):
    return f.default_factory() if callable(f.default_factory) else f.default


def readers(key: str) -> tuple[str, ...] | None:
    """The methods that read spec key ``key`` (a field or a method's own parameter); None: every method (a
    general field, or an unknown key, which validation refuses)."""
    if key in _FIELDS:
        return _users(SpecConfig.__dataclass_fields__[key])
    return _param_owners(key) or None


def is_default(key: str, value) -> bool:
    """Whether ``value`` is spec key ``key``'s default (for a method's own parameter, one of its owners')."""
    if key in _FIELDS:
        return value == _default(SpecConfig.__dataclass_fields__[key])
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
            return f"{k} is used by {_who(users)} only, none of {_and(methods)}"
    return None


def with_method(spec: SpecConfig, method: str) -> SpecConfig:
    """``spec`` with another method; the fields only other methods read go back to their defaults."""
    return SpecConfig.from_dict(for_method(spec.to_dict(), method))


def fallback_method(has_draft: bool) -> str:
    """The method that runs when ``auto`` cannot (the default before auto was): the draft model when
    there is one, else prompt lookup (model-free, runs everywhere)."""
    return "draft_model" if has_draft else "prompt_lookup"


def spec_with_default(d: dict | None, has_draft: bool) -> SpecConfig:
    """A SpecConfig dict that names no method -> ``auto``; when its other fields rule auto out (a token
    tree, a schedule auto does not take), ``fallback_method``, for which such fields were written."""
    d = dict(d or {})
    if "method" in d:
        return SpecConfig.from_dict(d)
    try:
        return SpecConfig.from_dict({**d, "method": DEFAULT_METHOD})
    except ConfigError:
        return SpecConfig.from_dict({**d, "method": fallback_method(has_draft)})
