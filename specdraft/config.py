"""The two configuration objects: what to sample (SamplingParams) and how to speculate (SpecConfig).

Both round-trip through plain dicts / JSON with validation, so the CLI (``--config FILE.json``), the
benchmark and the server all take the same object.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

# Defaults measured for the Qwen2.5-Coder 1.5B + 0.5B pair in float32 on this project's 2-core CPU
# (`specdraft batchbench`, docs/server.md#measured-crossover-qwen-pair): relative to plain decoding at the
# same batch size, speculation does best at 2 rows and loses more from 4 rows on, most at 8.
SPEC_SHRINK_AT = 4
SPEC_OFF_AT = 8

METHODS = ("plain", "draft_model", "prompt_lookup", "layer_skip", "early_exit", "suffix", "token_recycling",
           "lookahead", "medusa", "eagle")
HEAD_METHODS = ("medusa", "eagle")
SCHEDULES = ("constant", "heuristic", "cost_aware")
TREES = ("chain", "static", "dynamic")
LOSSY_RULES = ("typical",)


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
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        def num(name, v, kind):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise ConfigError(f"{name} must be a number, got {v!r}")

        num("temperature", self.temperature, (int, float))
        num("top_p", self.top_p, (int, float))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ConfigError(f"top_k must be an integer, got {self.top_k!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ConfigError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if not self.temperature >= 0 or self.temperature != self.temperature or self.temperature == float("inf"):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        return self

    @classmethod
    def from_dict(cls, d):
        return _from_dict(cls, d)

    def to_dict(self):
        return dataclasses.asdict(self)


def check_choices(choices) -> None:
    """Medusa-style choices: a list of paths of child ranks, prefix-closed, ranks contiguous."""
    if not isinstance(choices, list) or not choices:
        raise ConfigError(f"tree_choices must be a non-empty list of paths like [[0], [1], [0, 0]], got {choices!r}")
    paths = set()
    for c in choices:
        if (not isinstance(c, list) or not c
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in c)):
            raise ConfigError(f"each tree_choices entry must be a non-empty list of ranks >= 0, got {c!r}")
        paths.add(tuple(c))
    for c in paths:
        if len(c) > 1 and c[:-1] not in paths:
            raise ConfigError(f"tree_choices is not prefix-closed: {list(c)} needs {list(c[:-1])}")
        if c[-1] > 0 and c[:-1] + (c[-1] - 1,) not in paths:
            raise ConfigError(f"tree_choices skips a rank: {list(c)} needs {list(c[:-1] + (c[-1] - 1,))}")


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
      (top_k = max(recycle_branching)); ``k`` is not used. The table lives as long as the
      SpecDecoder (it is recycled across requests).
    - lookahead (specdraft.drafters.lookahead): Jacobi window ``lookahead_window`` (W)
      of ``lookahead_ngram`` - 1 levels (N), an n-gram pool, and a verification branch of up to
      ``lookahead_max_ngrams`` (G) pooled n-grams starting with the last token; both branches are
      one token tree scored in one forward (depth W + N - 2; ``k`` is not used).

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

    ``lossy`` (default None: every method is lossless) opts into a verification rule that does not
    preserve the target's distribution. The only one is ``"typical"``, Medusa's typical acceptance
    (``verify.TypicalAcceptance``): when sampling, a draft token is kept if the target's probability
    of it exceeds min(``typical_epsilon``, ``typical_delta`` x exp(-entropy)). At temperature 0 it has no
    effect (greedy verification). Results made with it carry ``"lossy": "typical"`` in their stats.

    ``schedule`` sets the draft length per step: ``constant`` (k), ``heuristic`` (transformers'
    rule: k + 2 after a fully accepted step, k - 1 otherwise, within 1..max_k; draft_model only) or
    ``cost_aware`` (specdraft.policy: measured step costs and acceptance pick k in 0..k each step,
    0 meaning a plain step, so speculation never runs where it does not pay). A schedule changes only
    what is drafted, never what is emitted.
    """

    method: str = "draft_model"
    k: int = 4
    schedule: str = "constant"
    max_k: int = 16
    confidence_threshold: float = 0.0
    min_ngram: int = 1
    max_ngram: int = 3
    branches: int = 1
    tree: str = "chain"
    # tree defaults: the best-measured shapes on this project's CPU (docs/benchmarks.md, token trees),
    # where a forward costs about linear in the tokens it scores; chain stays the default there
    tree_branching: list[int] = field(default_factory=lambda: [2, 1, 1])
    tree_choices: list[list[int]] | None = None
    tree_budget: int = 6
    tree_topk: int = 2
    exit_layer: int = 0
    skip_layers: list[int] = field(default_factory=list)
    skip_config: str | None = None
    # suffix
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    tree_nodes: int = 24
    max_occurrences: int = 256
    datastore: str | None = None
    # token_recycling
    recycle_branching: list[int] = field(default_factory=lambda: [4, 2, 2, 1])
    # lookahead
    lookahead_window: int = 4
    lookahead_ngram: int = 3
    lookahead_max_ngrams: int = 4
    # medusa / eagle: the trained head's directory (specdraft train)
    head: str | None = None
    # opt-in LOSSY verification (any method, sampling only): "typical" = Medusa's typical acceptance
    lossy: str | None = None
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def validate(self) -> "SpecConfig":
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose one of: {', '.join(METHODS)}")
        if self.head is not None:
            if not isinstance(self.head, str) or not self.head:
                raise ConfigError(f"head must be a directory path (string) or null, got {self.head!r}")
            if self.method not in HEAD_METHODS:
                raise ConfigError(f"head is used by methods medusa and eagle only, not {self.method!r}")
            from .heads import read_head_config

            meta = read_head_config(self.head)
            if meta["type"] != self.method:
                raise ConfigError(f"head {self.head} is a {meta['type']} head; method {self.method!r} needs a "
                                  f"{self.method} head")
        elif self.method in HEAD_METHODS:
            raise ConfigError(f"method {self.method!r} needs head=DIR (--head DIR), a head trained with "
                              f"`specdraft train {self.method} --target NAME --data PROMPTS.jsonl -o DIR`")
        for name in ("k", "max_k", "min_ngram", "max_ngram", "branches", "tree_nodes", "max_occurrences",
                     "lookahead_window", "lookahead_ngram", "lookahead_max_ngrams"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if self.k < 1:
            raise ConfigError(f"k (draft tokens per step) must be >= 1, got {self.k}")
        if self.max_k < self.k:
            raise ConfigError(f"max_k must be >= k, got max_k={self.max_k} < k={self.k}")
        if not 0 <= self.confidence_threshold < 1:
            raise ConfigError(f"confidence_threshold must be in [0, 1), got {self.confidence_threshold}")
        if self.branches < 1:
            raise ConfigError(f"branches must be >= 1 (1 = a chain), got {self.branches}")
        if self.tree not in TREES:
            raise ConfigError(f"unknown tree {self.tree!r}; choose one of: {', '.join(TREES)}")
        if self.tree != "chain":
            if self.method not in ("draft_model", "layer_skip", "early_exit", "medusa", "eagle"):
                raise ConfigError(f"tree={self.tree!r} is for methods draft_model, layer_skip, early_exit, medusa and "
                                  "eagle (prompt_lookup makes trees with branches > 1)")
            if self.schedule != "constant":
                raise ConfigError(f"tree={self.tree!r} needs schedule 'constant', got {self.schedule!r}")
        for name in ("tree_budget", "tree_topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if (not isinstance(self.tree_branching, list) or not self.tree_branching
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.tree_branching)):
            raise ConfigError(f"tree_branching must be a non-empty list of integers >= 1, got {self.tree_branching!r}")
        if self.tree_choices is not None:
            check_choices(self.tree_choices)
        if isinstance(self.exit_layer, bool) or not isinstance(self.exit_layer, int) or self.exit_layer < 0:
            raise ConfigError(f"exit_layer must be an integer >= 1 (layers the early-exit draft runs), got {self.exit_layer!r}")
        if self.method == "early_exit" and self.exit_layer < 1:
            raise ConfigError("method 'early_exit' needs exit_layer >= 1 (how many of the target's first layers draft)")
        if not isinstance(self.skip_layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in self.skip_layers):
            raise ConfigError(f"skip_layers must be a list of layer indices, got {self.skip_layers!r}")
        if self.method == "layer_skip" and not self.skip_layers and not self.skip_config:
            raise ConfigError("method 'layer_skip' needs skip_layers=[...] or skip_config=FILE "
                              "(from `specdraft tune-skip --target NAME -o FILE`)")
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise ConfigError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, max_ngram={self.max_ngram}"
            )
        for name in ("max_spec_factor", "min_token_prob"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ConfigError(f"{name} must be a number, got {v!r}")
        if not self.max_spec_factor > 0:
            raise ConfigError(f"max_spec_factor must be > 0, got {self.max_spec_factor}")
        if not 0 <= self.min_token_prob <= 1:
            raise ConfigError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.tree_nodes < 1:
            raise ConfigError(f"tree_nodes (draft tree node budget) must be >= 1, got {self.tree_nodes}")
        if self.max_occurrences < 1:
            raise ConfigError(f"max_occurrences must be >= 1, got {self.max_occurrences}")
        if self.datastore is not None and (not isinstance(self.datastore, str) or not self.datastore):
            raise ConfigError(f"datastore must be a path (string) or null, got {self.datastore!r}")
        if self.datastore is not None and self.method != "suffix":
            raise ConfigError(f"datastore is used by method 'suffix' only, not {self.method!r}")
        rb = self.recycle_branching
        if isinstance(rb, tuple):
            rb = self.recycle_branching = list(rb)
        if (not isinstance(rb, list) or not rb
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in rb)):
            raise ConfigError(f"recycle_branching must be a non-empty list of integers >= 1 (children per node "
                              f"at each depth), got {rb!r}")
        if len(rb) > 64:
            raise ConfigError(f"recycle_branching has {len(rb)} depths; at most 64")
        n, width = 0, 1
        for b in rb:
            width *= b
            n += width
        if n > 4096:
            raise ConfigError(f"recycle_branching {rb} makes a tree of {n} nodes; at most 4096")
        if self.lookahead_window < 1:
            raise ConfigError(f"lookahead_window (W) must be >= 1, got {self.lookahead_window}")
        if self.lookahead_ngram < 2:
            raise ConfigError(f"lookahead_ngram (N) must be >= 2, got {self.lookahead_ngram}")
        if self.lookahead_max_ngrams < 1:
            raise ConfigError(f"lookahead_max_ngrams (G) must be >= 1, got {self.lookahead_max_ngrams}")
        if self.lossy is not None and self.lossy not in LOSSY_RULES:
            raise ConfigError(f"unknown lossy rule {self.lossy!r}; choose one of: {', '.join(LOSSY_RULES)} "
                              "(or null, the default: lossless verification)")
        for name in ("typical_epsilon", "typical_delta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ConfigError(f"{name} must be a number, got {v!r}")
        if not 0 < self.typical_epsilon <= 1:
            raise ConfigError(f"typical_epsilon must be in (0, 1], got {self.typical_epsilon}")
        if not 0 <= self.typical_delta < float("inf"):
            raise ConfigError(f"typical_delta must be a finite number >= 0, got {self.typical_delta}")
        self.max_spec_factor = float(self.max_spec_factor)
        self.min_token_prob = float(self.min_token_prob)
        return self

    def lossy_rule(self):
        """The opt-in lossy verification rule, or None (lossless, the default)."""
        if self.lossy == "typical":
            from .verify import TypicalAcceptance

            return TypicalAcceptance(float(self.typical_epsilon), float(self.typical_delta))
        return None

    @property
    def needs_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, d):
        return _from_dict(cls, d)

    @classmethod
    def from_json(cls, s: str):
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ConfigError(f"spec config is not valid JSON: {e}") from e
        return _from_dict(cls, d)

    def to_dict(self):
        return dataclasses.asdict(self)
