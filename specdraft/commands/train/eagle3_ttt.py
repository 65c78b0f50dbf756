"""Training an EAGLE-3 head from DIR/data: the sequences with their features (memory-mapped) and the
batches of the training-time test (its loss: models/eagle3.py's ``ttt_loss``)."""

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
            raise SpecDraftError(f"{binf} is shorter than {data / 'features.jsonl'} says; delete both to make the "
                                 "features again")
        # copy-on-write: torch wants a writable array; nothing writes to it
        mm = np.memmap(binf, dtype=np.int16, mode="c", shape=(n, width))
        self.feats = torch.from_numpy(mm).view(torch.bfloat16)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def answer_tokens(self) -> int:
        return sum(len(t) - n for t, n in zip(self.tokens, self.n_prompt))

    def features(self, k: int, n: int) -> torch.Tensor:
        r = self.index[k]["row"]
        return self.feats[r: r + n].float()


def ttt_batch(data: Eagle3Data, idx: list[int], t2d_index: torch.Tensor, K: int, max_len: int):
    """Right-padded batch of P = L - 1 anchors: features F_t [B, P, 3H]; tokens [B, P + K] (x_{t+1}
    onwards: step j feeds column t + j); labels [B, P, K] (step j at anchor t: x_{t+j+2} as a draft
    vocabulary index, -100 off the answer, past the end or outside the draft vocabulary)."""
    seqs = [(data.tokens[i][:max_len], data.n_prompt[i], i) for i in idx]
    P = max(len(t) for t, _, _ in seqs) - 1
    F = torch.zeros(len(seqs), P, data.feats.shape[1])
    toks = torch.zeros(len(seqs), P + K, dtype=torch.long)
    labels = torch.full((len(seqs), P, K), -100, dtype=torch.long)
    for b, (x, n0, i) in enumerate(seqs):
        T = len(x)
        F[b, : T - 1] = data.features(i, T - 1)
        toks[b, : T - 1] = x[1:]
        t = torch.arange(T - 1)
        for j in range(K):
            at = t + j + 2
            ok = (at < T) & (at >= n0)
            labels[b, t[ok], j] = t2d_index[x[at[ok]]]
    return F, toks, labels
