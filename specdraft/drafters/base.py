"""The drafter protocol, in the spirit of transformers' CandidateGenerator, used at every batch size.

A drafter serves one request. It is told the request begins (``begin``), asked for a draft given
the tokens so far (``propose``), shown the target's logits of every fed position
(``observe_target``), told what the verifier kept (``feedback``) and what the step cost
(``observe_step``). It returns a DraftTree; a chain is a tree. When sampling, a drafter that samples
must sample from ``probs_from_logits`` of its own logits with the request's SamplingParams and return
those distributions as ``draft_probs``; a deterministic drafter returns ``draft_probs=None`` (one-hot).

Drafters whose work batches across requests (a draft model: one batched draft forward per drafting
iteration) set ``group_key``: the loop keeps one group per key (``new_group()`` makes it) and the
group drafts for all its rows at once (``DraftGroup``); ``propose`` is then not called.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..tree import DraftTree


class Drafter:
    """Base class with the protocol's declared defaults; every drafter derives from it."""

    name = "drafter"
    wants_hidden = False  # observe_target also gets the target's final-norm features (Medusa, EAGLE)
    lossy = None  # the opt-in lossy verification rule (SpecConfig.lossy); set by SpecDecoder.make_drafter
    group_key = None  # drafters with the same key draft together through one DraftGroup
    reproducible = True  # a seeded request gives the same tokens whatever else runs (docs/server.md)
    arm = None  # a composite's name for what drafted this step (drafters/composite.py), reported per step
    processor = None  # the request's RequestProcessor (processors.py) or None; set by the engine before begin
    reads_fed_positions = False  # observe_target indexes the fed draft as proposed: the engine must not prune it
    forced_tokens = 16  # under a grammar, append up to this many tokens it forces to a chain (0: never)

    def begin(self, prompt_ids: list[int], sp, generator: torch.Generator) -> None:
        """A request starts: ``generator`` is the request's own (seeded) random stream."""

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        """Draft continuing ``tokens`` (prompt + output so far), at most ``max_tokens`` deep."""
        return DraftTree.empty()

    def observe_target(self, row_tokens: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """After the target's forward: ``logits`` [n + 1, V] of the fed pending token and draft nodes,
        ``row_tokens`` [n + 1] the token each row predicts the successor of; ``hidden`` (only when
        ``wants_hidden``) the final-norm features [n_fed, H] of every position fed (a request's first
        step: its prompt's too)."""

    def feedback(self, num_accepted: int, emitted: list[int]) -> None:
        """The verifier kept ``num_accepted`` draft tokens; ``emitted`` is what was appended."""

    def seen_draft(self, draft: DraftTree) -> None:
        """Inside a composite (auto): another part drafted the ``draft`` the target verifies this step
        (a head's drafter then keeps the target's features of its accepted path)."""

    def observe_step(self, scored: int, seconds: float, batch: int) -> None:
        """After the verification of every step: the target forward scored ``scored`` tokens for this row
        and the step's target side took ``seconds`` with ``batch`` rows (``auto`` corrects its cost curve
        from the steps of a batch of one)."""

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
    """SpecConfig.confidence_threshold: from the second draft token on, drafting stops once the draft's
    top probability falls below the threshold (0: never). ``top_prob`` is computed only when needed."""
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
