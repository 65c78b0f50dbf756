"""Training an EAGLE-3 head from DIR/data: the sequences with their features (memory-mapped), read as
models/eagle3.py's ``ttt_batch`` takes them (the training-time test's batches and loss live beside the head)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...core.errors import SpecDraftError
from ...core.jsonl import AppendedJsonl
from .eagle3_data import ANSWER_FIELDS, FEATURE_FIELDS, current_features


class Eagle3Data:
    """The answered sequences with current features (DIR/data; eagle3_data.py), features memory-mapped
    (rows at the absolute offsets the index names); prompt i with i % ``holdout`` == 0 left out."""

    def __init__(self, data: Path, width: int, holdout: int = 0):
        import numpy as np

        answers = {r["i"]: r for r in AppendedJsonl(data / "answers.jsonl", ANSWER_FIELDS).rows}
        index = current_features(AppendedJsonl(data / "features.jsonl", FEATURE_FIELDS).rows, answers)
        self.index = [index[i] for i in sorted(index) if not (holdout and i % holdout == 0)]
        if not self.index:
            raise SpecDraftError(f"{data} holds no answered sequences with features yet")
        self.tokens = [torch.tensor(answers[r["i"]]["tokens"], dtype=torch.long) for r in self.index]
        self.n_prompt = [int(answers[r["i"]]["n_prompt"]) for r in self.index]
        binf = data / "features.bin"
        n = binf.stat().st_size // (2 * width) if binf.exists() else 0
        if any(r["row"] + r["n"] > n for r in self.index):
            raise SpecDraftError(
                f"{binf} is shorter than {data / 'features.jsonl'} says; delete both to make the features again"
            )
        # copy-on-write: torch wants a writable array; nothing writes to it
        mm = np.memmap(binf, dtype=np.int16, mode="c", shape=(n, width))
        self.feats = torch.from_numpy(mm).view(torch.bfloat16)
        self.width = width

    def __len__(self) -> int:
        return len(self.index)

    @property
    def answer_tokens(self) -> int:
        return sum(len(t) - n for t, n in zip(self.tokens, self.n_prompt))

    def features(self, k: int, n: int) -> torch.Tensor:
        r = self.index[k]["row"]
        return self.feats[r : r + n].float()
