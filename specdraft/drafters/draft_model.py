"""An independent draft model with the target's tokenizer, drafting chains autoregressively.

Every request's drafter is a member of a ``DraftModelGroup`` (one per draft model per engine):
each drafting iteration is one batched forward of the draft model over the rows still drafting
(ragged catch-up feeds first, then one token per row), whatever the batch size; a single request is
the one-row case. A row's draft cache holds a prefix of its tokens; the last draft is never fed,
and after verification the cache is cut back to the context + accepted drafts.
"""

from __future__ import annotations

import torch

from ..config import SpecConfig
from ..sampling import probs_from_logits, sample
from ..tree import DraftTree
from .base import Drafter


def fit_vocab(logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Put draft logits on the target's vocabulary rows (rows beyond either side are impossible)."""
    v = logits.shape[-1]
    if v == target_vocab:
        return logits
    if v > target_vocab:
        return logits[..., :target_vocab]
    pad = logits.new_full((*logits.shape[:-1], target_vocab - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class DraftModelDrafter(Drafter):
    """A request's member of its engine's DraftModelGroup (the group drafts; see the module doc)."""

    name = "draft_model"

    def __init__(self, model, cfg: SpecConfig, target_vocab: int):
        self.model = model  # a TargetModel (models/base.py) of the draft
        self.cfg = cfg
        self.target_vocab = target_vocab
        self.group_key = ("draft_model", id(getattr(model, "model", model)))

    def new_group(self) -> "DraftModelGroup":
        return DraftModelGroup(self.model, self.target_vocab)

    def max_draft_depth(self) -> int:
        return self.cfg.k


class DraftModelGroup:
    def __init__(self, draft, target_vocab: int):
        self.target_vocab = target_vocab
        self.kv = draft.new_rows()
        self.members: list = []  # engine Requests, in kv row order
        self._base: dict[int, int] = {}  # id(row) -> context length at the last propose
        self._drafted: dict[int, int] = {}

    def join(self, rows) -> None:
        self.kv.add_rows([[] for _ in rows])
        self.members.extend(rows)

    def leave(self, rows) -> None:
        idx = [self.members.index(r) for r in rows if r in self.members]
        self.kv.remove_rows(idx)
        drop = set(idx)
        self.members = [m for i, m in enumerate(self.members) if i not in drop]
        for r in rows:
            self._base.pop(id(r), None)
            self._drafted.pop(id(r), None)

    def propose(self, rows, caps: list[int]) -> list[DraftTree]:
        kv, R = self.kv, len(self.members)
        cap_of = {id(r): c for r, c in zip(rows, caps)}
        c = [cap_of.get(id(m), 0) for m in self.members]
        out: list[list] = [[] for _ in range(R)]
        probs: list[list] = [[] for _ in range(R)]
        active = [c[i] > 0 for i in range(R)]
        for m in self.members:
            self._base[id(m)] = len(m.tokens)
        step = 0
        while any(active):
            if step == 0:  # catch up on what the row's cache lacks; its last position predicts the first draft
                seqs = [m.tokens[kv.lens[i]:] if active[i] else [] for i, m in enumerate(self.members)]
                last = [max(len(q) - 1, 0) for q in seqs]
            else:
                seqs = [[int(out[i][-1])] if active[i] else [] for i in range(R)]
                last = [0] * R
            # LM-head logits only from the first position a drafting row reads (Qwen's head is 151,936 rows)
            N = max(len(q) for q in seqs)
            keep = N - min(last[i] for i in range(R) if active[i])
            logits = kv.forward(seqs, keep=keep)
            kv.commit([len(q) for q in seqs])
            for i, m in enumerate(self.members):
                if active[i]:
                    lg = fit_vocab(logits[i, last[i] - (N - keep)], self.target_vocab)
                    active[i] = self._draw(m, lg, step, out[i], probs[i], c[i])
            step += 1
        for i, m in enumerate(self.members):
            self._drafted[id(m)] = len(out[i])
        by_row = {id(m): i for i, m in enumerate(self.members)}
        trees = []
        for r in rows:
            i = by_row[id(r)]
            trees.append(DraftTree.chain(torch.stack(out[i]), torch.stack(probs[i]) if probs[i] else None)
                         if out[i] else DraftTree.empty())
        return trees

    @staticmethod
    def _draw(m, logits: torch.Tensor, step: int, out: list, probs: list, cap: int) -> bool:
        """Append row m's next draft token from its draft logits; False when the row stops drafting
        (cap reached, or its top probability fell below the confidence threshold)."""
        thr = m.drafter.cfg.confidence_threshold
        if m.sp.greedy:
            if thr > 0 and step > 0 and float(torch.softmax(logits, -1).max()) < thr:
                return False
            t = logits.argmax(-1)
        else:
            q = probs_from_logits(logits, m.sp)
            if thr > 0 and step > 0 and float(q.max()) < thr:
                return False
            t = sample(q, m.gen)
            probs.append(q)
        out.append(t)
        return len(out) < cap

    def feedback(self, rows, n_acc: list[int]) -> None:
        for r, n in zip(rows, n_acc):
            i = self.members.index(r)
            self.kv.truncate(i, self._base[id(r)] + min(n, max(self._drafted[id(r)] - 1, 0)))
        self.kv.trim()
