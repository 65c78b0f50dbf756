"""The drafter protocol, in the spirit of transformers' CandidateGenerator.

A drafter is told a request begins (``begin``), is asked for a draft given the tokens so far
(``propose``), and is told what the verifier kept (``feedback``). It returns a DraftTree; a chain
is a tree. When sampling, a drafter that samples must sample from ``probs_from_logits`` of its own
logits with the request's SamplingParams and return those distributions as ``draft_probs``; a
deterministic drafter returns ``draft_probs=None`` (one-hot).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..config import SamplingParams
from ..tree import DraftTree


class Drafter(Protocol):
    name: str

    def begin(self, prompt_ids: list[int], sp: SamplingParams, generator: torch.Generator) -> None: ...

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        """Draft at most ``max_tokens`` tokens continuing ``tokens`` (prompt + output so far)."""
        ...

    def feedback(self, num_accepted: int, emitted: list[int]) -> None:
        """The verifier kept ``num_accepted`` draft tokens; ``emitted`` is what was appended."""
        ...


class NoDrafter:
    """The plain autoregressive baseline: drafts nothing, so each step is one target forward."""

    name = "plain"

    def begin(self, prompt_ids, sp, generator):
        pass

    def propose(self, tokens, max_tokens):
        return DraftTree.empty()

    def feedback(self, num_accepted, emitted):
        pass
