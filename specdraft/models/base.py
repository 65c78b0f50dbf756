"""The model interface: what the decode loop needs from a target (or a batched draft) model.

A backend is one file implementing two protocols:

- ``TargetModel``: facts about the model (vocabulary, context, EOS ids, tokenizer), what it can do
  beyond the core calls (``capabilities``: callers read it, they never probe attributes) and
  ``new_rows()``, a fresh ``SequenceRows``;
- ``SequenceRows``: the KV state of B independent sequences ("rows") over the model's weights. The
  loop feeds each row its pending token + draft (a chain, or a token tree given as an ancestor mask
  and depth offsets) in ONE forward, reads logits of the fed positions, then ``commit``s what each
  row keeps (a prefix, or the slots of the accepted tree path). Rows join (``add_rows``, a prefill)
  and leave (``remove_rows``) between steps.

The target's rows and a draft model's rows are the same protocol: a draft model's chains and token
trees are drafted through ``new_rows()`` too (drafters/draft_model.py), so any backend drafts both.
transformers models implement it in ``models/hf.py``; a second backend (llama.cpp) implements the
same two protocols and registers itself in ``models/backends.py``: the loop, the verifiers and the
drafters that only need these calls do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class Capabilities:
    """What a backend's model offers beyond the calls every backend has."""

    hidden: bool = False  # forward(hidden=True) / add_rows(hidden=True) leave the final-norm features (block 0)
    trees: bool = True  # forward(trees=...) scores token trees (the target's verification, model-drafted trees)
    layers: bool = False  # add_feature_layers: decoder layers' outputs handed over in those forwards (EAGLE-3)
    head_io: bool = False  # facts, embed() and output_rows(): what a trained head is built on (models/heads.py)
    prefixes: bool = False  # save_prefix / add_rows(start=...): rows start from a saved prefix (engine/prefix_cache.py)


@dataclass(frozen=True)
class SavedPrefix:
    """A copy of one row's cached keys and values, its first ``n`` tokens (``SequenceRows.save_prefix``):
    ``data`` is the backend's own (tensors, a llama.cpp sequence state, OpenVINO state arrays), never
    shared with a live row, so dropping it from a cache can never touch a row that started from it."""

    backend: str
    n: int
    nbytes: int
    data: Any


@dataclass(frozen=True)
class ModelFacts:
    """The architecture facts a trained head is built from and checked against (a transformers config,
    or a GGUF file's metadata: every backend reads the same numbers)."""

    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int  # rows of the LM head
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


def padded_features(rows: list, N: int, width: int | None = None) -> torch.Tensor:
    """Per-row features [n_r, W] (numpy; None: the row fed nothing) -> ``last_hidden`` [B, N, W], zeros
    past each row's n_r (W: ``width``, else the rows'; numpy: a torch fill of this size wakes torch's OpenMP workers,
    whose spinning then takes cores from the backend's next forward)."""
    W = width if width is not None else max((x.shape[1] for x in rows if x is not None), default=0)
    out = np.zeros((len(rows), N, W), np.float32)
    for r, x in enumerate(rows):
        if x is not None and x.shape[1] == W:
            out[r, : x.shape[0]] = x
    return torch.from_numpy(out)


class SequenceRows(Protocol):
    model: "TargetModel"  # the model whose cache these rows are
    lens: list[int]  # tokens each row holds in the cache
    last_hidden: torch.Tensor | None  # [B, N, H * blocks] features of the last forward(hidden=True): the
    # final norm's output (block 0, where capabilities.hidden), then each layer the model hands over
    # (TargetModel.add_feature_layers; a backend without ``hidden`` starts its layer blocks at 0)
    prefill_hidden: list  # per row of the last add_rows(hidden=True): [len(prefix), H * blocks] or None
    # (hidden=True needs capabilities.hidden, or capabilities.layers and layers added; else ConfigError)

    @property
    def B(self) -> int: ...

    @property
    def L(self) -> int:
        """Cache slots held per row (holes included): what the engine reports as ``cache_len``."""
        ...

    def add_rows(
        self, prefixes: list[list[int]], hidden: bool = False, start: list[tuple[SavedPrefix, int] | None] | None = None
    ) -> list[int]:
        """Prefill ``prefixes`` (ragged, may be empty) as new last rows; returns their indices. Where
        capabilities.prefixes: ``start[i]`` = (saved, m) makes row i hold saved's first m tokens (those of
        prefixes[i][:m]; m <= saved.n) without computing them, and prefill only prefixes[i][m:] (a row
        started so with ``hidden`` gets prefill features of the tokens it computed only)."""
        ...

    # only where capabilities.prefixes:
    # def save_prefix(self, r: int) -> SavedPrefix: a copy of row r's lens[r] committed tokens' keys and values

    def remove_rows(self, idx: list[int]) -> None: ...

    def forward(
        self, seqs: list[list[int]], keep: int | None = None, trees: list | None = None, hidden: bool = False
    ) -> torch.Tensor:
        """Feed row r ``seqs[r]`` at positions lens[r]..; float32 logits [B, N, V] (N = the longest
        feed; ``keep``: only the last ``keep`` positions). ``trees[r]`` = (allow [n, n] bool,
        offsets [n] long) makes row r's n fed tokens a token tree: token i attends to the row's cache
        and to the fed tokens j with allow[i, j], at position lens[r] + offsets[i]. The fed slots stay
        provisional until ``commit``."""
        ...

    def commit(self, keep: list) -> None:
        """Row r keeps the first keep[r] fed tokens (an int) or the fed tokens listed in keep[r]
        (ascending indices); the rest are dropped."""
        ...

    def truncate(self, r: int, n: int) -> None:
        """Keep only row r's first n cached tokens (rollback; call ``trim`` after a round of them)."""
        ...

    def trim(self) -> None:
        """Release cache space no row uses any more."""
        ...

    def draft_room(self) -> tuple[int, int] | None:
        """What one forward may feed beyond the rows' pending tokens, when the cache is shared and bounded:
        (spare sequence ids for a token tree's extra leaves, free cells for every row's fed tokens
        together), or None when it bounds neither (the engine fits drafts to it: engine.Engine._fit)."""
        ...


class TargetModel(Protocol):
    name: str
    tokenizer: object
    backend: str  # its key in models/backends.py ("hf", "llama", "openvino")
    source: dict | None  # load_model's arguments that load it again (another process); None: made in memory
    # a model whose prefill computes exactly this one's cache (a self-draft's target, api._self_draft): rows of
    # this model may start from its rows (SequenceRows.adopt_rows); None for any other model
    prefill_twin: "TargetModel | None"
    device: torch.device  # where its logits and features come back (the host for llama.cpp and OpenVINO, whatever
    # runs their weights): verification, logits processing and the requests' random streams run there

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head (may exceed the tokenizer's size)."""
        ...

    @property
    def max_context(self) -> int: ...

    def eos_token_ids(self) -> set[int]: ...

    def new_rows(self, compact_slack: int = 32) -> SequenceRows: ...

    # only where capabilities.layers:
    # def add_feature_layers(self, layers) -> list[int]: hand over these decoder layers' outputs
    #     (hidden-states indices, 1 = the first layer's output) in every forward(hidden=True) too; -> the
    #     H-wide block of last_hidden each fills (block 0 is the final norm's where capabilities.hidden,
    #     else the first layer added). Blocks never move once given.
    # only where capabilities.head_io (heads, their drafters and their training read nothing else):
    # facts: ModelFacts
    # def embed(self, ids: torch.Tensor) -> torch.Tensor: the input embeddings of ``ids`` [..., H]
    # def output_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor: the LM head's rows [n, H]
    #     (all of them for None: no copy where the backend holds them dense)
    # (both in ``dtype``: the model's own, float32 where a backend dequantizes a GGUF file's rows)
