"""A backend with no transformers model inside, offering what head drafters read (tests/test_extending.py).

The language model is a fixed random table: the logits after a token depend on that token and the one
before it, and so do the "decoder layers' outputs" it hands over (one random [H] vector per layer and
token pair). It implements the model interface of models/base.py from scratch (``TargetModel`` and
``SequenceRows``: token trees, commits of a prefix or of listed slots, row removal and rollback) plus the
capabilities a head builds on: ``layers`` (``add_feature_layers``) and ``head_io`` (``facts``,
``embed``, ``output_rows``)."""

from __future__ import annotations

import torch

from specdraft.models.base import Capabilities, ModelFacts

V, H, N_LAYERS = 12, 16, 8  # 8 layers: EAGLE-3's default aux layers (2, 4, 5) are three distinct ones
START = 0  # the token "before" a row's first one


class StubTok:
    """A tokenizer that only decodes (ids as numbers): these models are fed token ids."""

    eos_token_id = None

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


class TableModel:
    backend = "table"
    source = None  # made in memory
    prefill_twin = None
    dtype = torch.float32
    max_context = 512

    def __init__(self, name: str, layers: bool = True, seed: int = 0):
        """``layers``: whether it declares the layer outputs it hands over (Capabilities.layers)."""
        g = torch.Generator().manual_seed(seed)
        self.name, self.tokenizer, self.device = name, StubTok(), torch.device("cpu")
        self.declares_layers = layers
        self.logit_table = 3 * torch.randn(V, V, V, generator=g)  # [previous token, token] -> next logits
        self.layer_table = torch.randn(N_LAYERS, V, V, H, generator=g)  # [layer - 1, previous, token] -> output
        self.embeddings = torch.randn(V, H, generator=g)
        self.lm_head = torch.randn(V, H, generator=g)
        self.feature_layers: tuple[int, ...] = ()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(hidden=False, trees=True, layers=self.declares_layers, head_io=True)

    @property
    def facts(self) -> ModelFacts:
        return ModelFacts(
            model_type="table",
            hidden_size=H,
            num_layers=N_LAYERS,
            vocab_size=V,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=H // 2,
            intermediate_size=2 * H,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=self.max_context,
        )

    @property
    def vocab_size(self) -> int:
        return V

    def eos_token_ids(self) -> set[int]:
        return set()

    def new_rows(self, compact_slack: int = 32) -> TableRows:
        return TableRows(self)

    def add_feature_layers(self, layers) -> list[int]:
        """As llama.cpp's: no final-norm block, the first layer handed over is block 0."""
        self.feature_layers += tuple(int(i) for i in dict.fromkeys(layers) if int(i) not in self.feature_layers)
        return [self.feature_layers.index(int(i)) for i in layers]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings[ids.to(self.device)]

    def output_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head if ids is None else self.lm_head[ids.to(self.device)]

    def features(self, prev: int, tok: int) -> torch.Tensor:
        """The handed-over layers' outputs at a position holding ``tok`` after ``prev``: [H * layers]."""
        return torch.cat([self.layer_table[i - 1, prev, tok] for i in self.feature_layers] or [torch.zeros(0)])


class TableRows:
    """B rows; a row's cache is its committed tokens (a position's logits need only its token pair)."""

    def __init__(self, model: TableModel):
        self.model = model
        self.tokens: list[list[int]] = []
        self.fed: list[list[int]] = []  # per row: the last forward's tokens, provisional until commit
        self.last_hidden: torch.Tensor | None = None
        self.prefill_hidden: list = []

    @property
    def lens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def B(self) -> int:
        return len(self.tokens)

    @property
    def L(self) -> int:
        return max(self.lens, default=0)

    def add_rows(self, prefixes: list[list[int]], hidden: bool = False) -> list[int]:
        first = self.B
        self.prefill_hidden = [self._prefix_features(p) if hidden and p else None for p in prefixes]
        self.tokens += [list(p) for p in prefixes]
        self.fed += [[] for _ in prefixes]
        return list(range(first, self.B))

    def _prefix_features(self, prefix: list[int]) -> torch.Tensor:
        return torch.stack([self.model.features(p, t) for p, t in zip([START] + prefix, prefix)])

    def remove_rows(self, idx: list[int]) -> None:
        self.tokens = [t for r, t in enumerate(self.tokens) if r not in idx]
        self.fed = [f for r, f in enumerate(self.fed) if r not in idx]

    def _previous(self, r: int, seq: list[int], tree) -> list[int]:
        """The token before each fed one: its parent in the tree (the ancestor one level up), else the
        row's last cached token."""
        last = self.tokens[r][-1] if self.tokens[r] else START
        if tree is None:
            return [last] + seq[:-1]
        allow, offsets = tree
        out = []
        for i in range(len(seq)):
            up = [j for j in range(len(seq)) if allow[i, j] and offsets[j] == offsets[i] - 1]
            out.append(seq[up[0]] if up else last)
        return out

    def forward(
        self, seqs: list[list[int]], keep: int | None = None, trees: list | None = None, hidden: bool = False
    ) -> torch.Tensor:
        m = self.model
        N = max((len(s) for s in seqs), default=0)
        logits = torch.zeros(self.B, N, V)
        feats = torch.zeros(self.B, N, H * len(m.feature_layers))
        for r, seq in enumerate(seqs):
            for i, (prev, tok) in enumerate(zip(self._previous(r, seq, trees[r] if trees else None), seq)):
                logits[r, i] = m.logit_table[prev, tok]
                feats[r, i] = m.features(prev, tok)
            self.fed[r] = list(seq)
        self.last_hidden = feats if hidden else None
        return logits[:, -keep:] if keep else logits

    def commit(self, keep: list) -> None:
        for r, k in enumerate(keep):
            self.tokens[r] += self.fed[r][:k] if isinstance(k, int) else [self.fed[r][int(i)] for i in k]
            self.fed[r] = []

    def truncate(self, r: int, n: int) -> None:
        self.tokens[r] = self.tokens[r][:n]

    def trim(self) -> None:
        pass  # nothing is held beyond the rows' tokens

    def draft_room(self) -> tuple[int, int] | None:
        return None

    def holes(self) -> int:
        return 0
