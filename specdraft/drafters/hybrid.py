"""Hybrid drafting (SAM-Decoding's idea): retrieval drafts when it has a long match, the model
otherwise.

Each step the suffix automaton over prompt + output (+ an optional datastore; drafters/suffix.py)
finds the longest earlier occurrence of the context's suffix. A match of at least
``hybrid_min_match`` tokens means the text is repeating itself (a code edit, a quoted document),
and the retrieval tree drafts (nearly free); a shorter one means it is not, and the draft model
drafts its ``k`` tokens. With ``hybrid_merge`` (greedy only) both draft whenever retrieval has any
draft, and the model's chain and the retrieval tree are merged into one token tree verified in one
forward. Deterministic retrieval branches and sampled model branches cannot share a tree under
lossless sampling (their draft distributions differ per node), so sampling requests switch.
"""

from __future__ import annotations

from ..core.tree import merge_trees
from .composite import Composite, plan_of
from .suffix import SuffixDrafter


class HybridDrafter(Composite):
    name = "hybrid"

    def __init__(self, retrieval: SuffixDrafter, model, min_match: int, merge: bool = False):
        super().__init__([retrieval, model])
        self.retrieval, self.model_part = retrieval, model
        self.min_match, self.merge = min_match, merge
        self._greedy = True

    def begin(self, prompt_ids, sp, generator, processor=None):
        super().begin(prompt_ids, sp, generator, processor)
        self._greedy = sp.greedy

    def plan(self, tokens, cap):
        own = self.retrieval.propose(tokens, cap)
        if own.size and self.retrieval.last_match_len() >= self.min_match and not (self.merge and self._greedy):
            self.arm = "retrieval"
            return own, 0
        self.arm = "model" if not own.size or not self.merge or not self._greedy else "merged"
        model_own, model_cap = plan_of(self.model_part, tokens, cap)
        if self.arm == "merged":
            self._retrieved = own
        return model_own, model_cap

    def combine(self, own, model):
        tree = super().combine(own, model)
        if self.arm == "merged":
            tree = merge_trees(tree, self._retrieved) if tree.size else self._retrieved
        return tree

    def max_draft_depth(self):
        return max(self.retrieval.max_draft_depth(), self.model_part.max_draft_depth() or 0)
