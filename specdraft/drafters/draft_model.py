"""An independent draft model with the target's tokenizer, drafting a chain autoregressively."""

from __future__ import annotations

import torch

from ..config import SamplingParams, SpecConfig
from ..models.adapter import HFModel
from ..sampling import probs_from_logits, sample
from ..tree import DraftTree


def fit_vocab(logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Put draft logits on the target's vocabulary rows (rows beyond either side are impossible)."""
    v = logits.shape[-1]
    if v == target_vocab:
        return logits
    if v > target_vocab:
        return logits[..., :target_vocab]
    pad = logits.new_full((*logits.shape[:-1], target_vocab - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class DraftModelDrafter:
    name = "draft_model"

    def __init__(self, model: HFModel, cfg: SpecConfig, target_vocab: int):
        self.model = model
        self.cfg = cfg
        self.target_vocab = target_vocab
        self.k = cfg.k

    def begin(self, prompt_ids, sp: SamplingParams, generator):
        self.model.reset()
        self.sp = sp
        self.gen = generator
        self.k = self.cfg.k
        self._base = 0
        self._drafted = 0

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.target_vocab)

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        k = min(self.k, max_tokens)
        self._base = len(tokens)
        self._drafted = 0
        if k <= 0:
            return DraftTree.empty()
        feed = torch.tensor(tokens[self.model.cached_len :], dtype=torch.long)
        out, probs = [], []
        thr = self.cfg.confidence_threshold
        for i in range(k):
            logits = self._fit(self.model.forward(feed, keep=1)[-1])
            if self.sp.greedy:
                t = logits.argmax(-1)
                if thr > 0 and i > 0 and float(torch.softmax(logits, -1).max()) < thr:
                    break
            else:
                q = probs_from_logits(logits, self.sp)
                if thr > 0 and i > 0 and float(q.max()) < thr:
                    break
                t = sample(q, self.gen)
                probs.append(q)
            out.append(t)
            feed = t.reshape(1)
        self._drafted = len(out)
        return DraftTree.chain(torch.stack(out), torch.stack(probs) if probs else None)

    def feedback(self, num_accepted: int, emitted: list[int]) -> None:
        # The cache holds the context plus the drafts that were fed back in (all but the last).
        self.model.crop(self._base + min(num_accepted, max(self._drafted - 1, 0)))
        if self.cfg.schedule == "heuristic" and self._drafted:
            if num_accepted == self._drafted:
                self.k = min(self.k + 2, self.cfg.max_k)
            else:
                self.k = max(self.k - 1, 1)
