"""Token trees drafted by a draft model (method draft_model, layer_skip or early_exit with a ``tree``):
static shapes (branching per depth, or Medusa-style "choices") and dynamic trees (EAGLE-2's idea:
expand the most probable frontier, rerank to a budget).

A ``DraftTreeDrafter`` is a member of its draft model's ``DraftModelGroup`` (drafters/draft_model.py),
the same group as the chain drafters of that model: the group drafts a tree for every row whose spec
asks for one, one tree level of all those rows per forward of the draft model's ``SequenceRows``
(``forward(seqs, trees=...)``), so model-drafted trees batch across requests and run on any backend
that implements the model interface. The tree building is ``tree_grower.GrowingTree``, shared with
EAGLE, whose head scores the levels instead of a draft model.

Sampling: the children of a node are drawn without replacement from the processed draft
distribution q, and each node records the distribution it was actually drawn from (q with its
earlier siblings removed, renormalized), which is what ``verify.rejection_sample_tree`` needs to
stay exact. Greedy takes the top ranks.
"""

from __future__ import annotations

from ..core.config import SpecConfig
from .draft_model import DraftModelDrafter
from .tree_grower import spec_shape


class DraftTreeDrafter(DraftModelDrafter):
    """A request's member of its draft model's group, drafting token trees of ``spec``'s shape."""

    name = "draft_tree"

    def __init__(self, model, spec: SpecConfig, target_vocab: int, prefix_cache=None):
        super().__init__(model, spec, target_vocab, prefix_cache)
        self.shape = spec_shape(spec)  # what its group grows for this row each step

    def max_draft_depth(self) -> int:
        return self.shape.max_depth
