"""EAGLE-3 (Li et al. 2025): the EAGLE drafter on three of the target's layers, with a draft LM head.

The head (``models/eagle3.Eagle3Head``, the reference layout) reads, at every verified position, the
outputs of three target layers (low, middle, high: ``eagle3.eagle3_layers``), which the target hands
over in the same forward that verifies (``TargetModel.add_feature_layers``: forward hooks on
transformers, extra outputs of the IR on OpenVINO, the graph callback on llama.cpp). Everything else is the EAGLE
drafter's (drafters/eagle.py): the head's own KV cache cropped back to the true positions every step, chains, and
EAGLE-2's dynamic tree through ``GrowingTree``. Step 1 of a draft reads the fused target features of the verified pairs;
later steps (a chain's next tokens, a tree's deeper levels) feed the head's own predicted feature back, as the
head was trained (the training-time test, train.py).

Draft vocabulary: the head's LM head scores its ``draft_ids`` only (draft index + d2t -> target id);
``EagleDrafter.logits`` scatters those logits into a full-vocabulary row of -inf, so
q = probs_from_logits(...) is normalized over the draft vocabulary and 0 elsewhere, which is what
verification needs to stay exact (tests/test_eagle3.py fails a q left unnormalized).
"""

from __future__ import annotations

import torch

from ..core.config import SpecConfig
from ..core.errors import ConfigError
from ..models.base import TargetModel
from ..models.eagle3 import Eagle3Head
from .eagle import EagleDrafter


class Eagle3Drafter(EagleDrafter):
    name = "eagle3"

    def __init__(self, target: TargetModel, head: Eagle3Head, spec: SpecConfig):
        super().__init__(target, head, spec)
        H = target.facts.hidden_size
        blocks = target.add_feature_layers(head.layers)
        self._cols = torch.cat([torch.arange(b * H, (b + 1) * H, device=self.device) for b in blocks])
        self.width = len(blocks) * H

    def _check_features(self, target: TargetModel) -> None:
        if not target.capabilities.layers:
            raise ConfigError(
                f"method 'eagle3' reads the target's layer outputs, which {target.name} on the "
                f"{target.backend} backend does not hand over"
            )

    def _draft_vocab(self, target: TargetModel, head: Eagle3Head) -> None:
        self.ids = head.draft_ids

    def _sub_logits(self, f: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(f)

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.index_select(-1, self._cols.to(hidden.device))
