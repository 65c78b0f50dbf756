"""The drafter protocol, in the spirit of transformers' CandidateGenerator, used at every batch size.

A drafter serves one request. It is told the request begins (``begin``), asked for a draft given
the tokens so far (``propose``, which returns a DraftTree; a chain is a tree) and, once per step, shown
the step's outcome (``observe``: the target's logits and features of every fed position, the draft the
target verified, what the verifier kept, what the step cost). The engine owns everything else: the
verification rule (exact or a request's opt-in lossy rule), the request's processing (penalties, a
grammar; ``begin`` hands a drafter that samples the request's processor, to process its own logits the
same way), the cache and the stop conditions. When sampling, a drafter that samples
must sample from ``probs_from_logits`` of its own logits with the request's SamplingParams and return
those distributions as ``draft_probs``; a deterministic drafter returns ``draft_probs=None`` (one-hot).

Drafters whose work batches across requests (a draft model: one batched draft forward per drafting
iteration) set ``group_key``: the loop keeps one group per key (``new_group()`` makes it) and the
group drafts for all its rows at once (``DraftGroup``); ``propose`` is then not called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

from ..core.tree import DraftTree

if TYPE_CHECKING:
    from ..core.config import SamplingParams, SpecConfig
    from ..core.processors import RequestProcessor


class DraftContext(Protocol):
    """What a method's factory (core/methods.py ``Method.make``) and its drafters may ask of the decoder they
    draft for: its models and the resources it shares between requests. ``api.SpecDecoder`` implements it;
    nothing else of the decoder is reachable from the drafters layer."""

    target: Any  # the target (models/base.py TargetModel)
    draft: Any  # the draft model, or None
    prefix_cache: Any  # core/prefix_cache.PrefixCache, or None: draft models' rows share it with the target's

    @property
    def backend(self) -> str: ...

    def draft_model(self) -> Any:
        """The draft model; a ConfigError naming the flag when there is none."""
        ...

    def make_drafter(self, spec: "SpecConfig") -> Any: ...  # a composite's parts (auto's arms, hybrid's)
    def shared(self, key: tuple, make: Callable[[], Any], limit: int | None = ...) -> Any: ...
    def head(self, spec: "SpecConfig") -> Any: ...  # a trained head (models/heads.py), loaded once
    def layer_view(self, keep) -> Any: ...  # the target's layers ``keep`` as a draft (models/views.py)
    def skip_config(self, path: str) -> tuple[int, ...]: ...
    def datastore(self, path: str) -> Any: ...  # a suffix datastore (drafters/datastore.py)
    def served_outputs(self) -> Any: ...  # the store of recent outputs (online learning), or None
    def recycle_table(self, top_k: int) -> Any: ...  # Token Recycling's adjacency table
    def vocab_bridge(self) -> Any: ...  # the draft's and the target's tokenizers side by side, or None
    def autotune_file(self, path) -> dict: ...
    def arm_memory(self, spec: "SpecConfig") -> Any: ...  # auto's per-arm measurements for ``spec``
    def observed_costs(self) -> Any: ...
    def cost_curve(self, n_max: int) -> dict[int, float]: ...  # seconds to score n tokens (target)
    def draft_cost_curve(self, n_max: int) -> dict[int, float]: ...


@dataclass
class StepOutcome:
    """What a step showed one row's drafter (``Drafter.observe``)."""

    fed: torch.Tensor  # [n + 1] the tokens fed (the pending token, then the draft's nodes)
    logits: torch.Tensor  # [n + 1, V] the target's raw logits at those positions
    hidden: torch.Tensor | None = None  # [n_fed, H] their final-norm features, only when wants_hidden
    # (a request's first step: its prompt's positions first)
    draft: DraftTree | None = None  # the draft the target verified (as fed: cut to the cache's room, pruned)
    accepted: int = 0  # draft tokens the verifier kept
    emitted: Sequence[int] = ()  # the tokens appended: the accepted drafts and the target's next token
    seconds: float = 0.0  # the step's target side (forward + verification), for the whole batch
    batch: int = 1  # rows in the step

    @property
    def scored(self) -> int:
        return int(self.fed.shape[0])


class Drafter:
    """Base class with the protocol's declared defaults; every drafter derives from it."""

    name = "drafter"
    wants_hidden = False  # observe also gets the target's final-norm features (Medusa, EAGLE)
    group_key: tuple | None = None  # drafters with the same key draft together through one DraftGroup
    reproducible = True  # a seeded request gives the same tokens whatever else runs (docs/server.md)
    arm: str | None = None  # a composite's name for what drafted this step (drafters/composite.py), reported per step
    reads_fed_positions = False  # observe indexes the fed draft as proposed: the engine must not prune it
    forced_tokens = 16  # under a grammar, append up to this many tokens it forces to a chain (0: never)

    def begin(
        self,
        prompt_ids: list[int],
        sp: SamplingParams,
        generator: torch.Generator | None,
        processor: RequestProcessor | None = None,
    ) -> None:
        """A request starts: ``generator`` is the request's own (seeded) random stream, ``processor`` its
        processing (penalties, bias, a grammar; None: none asked), which a drafter that samples applies to
        its own logits."""

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        """Draft continuing ``tokens`` (prompt + output so far), at most ``max_tokens`` deep."""
        return DraftTree.empty()

    def observe(self, step: StepOutcome) -> None:
        """After every step's verification, before its tokens are appended to the request's: what the
        target scored and kept (inside a composite, whichever part drafted ``step.draft``)."""

    def max_draft_depth(self) -> int | None:
        """The deepest draft this drafter makes per step (what the batch rule shrinks); None = as
        deep as allowed."""
        return None

    def new_group(self) -> "DraftGroup":
        raise NotImplementedError(f"{type(self).__name__} sets group_key but makes no group")


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (how much of a draft cache still holds)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def confident(threshold: float, step: int, top_prob: Callable[[], torch.Tensor]) -> bool:
    """A model's ``confidence_threshold`` (core/methods.py ModelDraft): from the second draft token on,
    drafting stops once the draft's top probability falls below the threshold (0: never).
    ``top_prob`` is computed only when needed."""
    return threshold <= 0 or step == 0 or float(top_prob()) >= threshold


class DraftGroup(Protocol):
    """Drafts for every row of one engine whose drafter has the same ``group_key``. A row is the
    engine's ``Request`` (``tokens``, ``sp``, ``gen``, ``drafter``)."""

    def join(self, rows: list, prefix_from: tuple | None = None) -> None:
        """``prefix_from``: (the target's rows, the rows' indices there), just prefilled, for a group
        whose model can reuse that cache."""

    def leave(self, rows: list) -> None: ...

    def propose(self, rows: list, caps: list[int]) -> list[DraftTree]: ...

    def feedback(self, rows: list, num_accepted: list[int]) -> None: ...


class NoDrafter(Drafter):
    """The plain autoregressive baseline: drafts nothing, so each step is one target forward."""

    name = "plain"
    forced_tokens = 0  # the baseline stays one token per forward, grammar or not
