"""Prompt lookup decoding (LLMA / PLD): copy what followed an earlier occurrence of the current
suffix n-gram in prompt + output. Deterministic, so its draft distribution is one-hot."""

from __future__ import annotations

import numpy as np
import torch

from ..core.config import SpecConfig
from ..core.tree import DraftTree, trie
from .base import Drafter


def find_candidates(tokens: np.ndarray, min_n: int, max_n: int, k: int, branches: int) -> list[np.ndarray]:
    """Up to ``branches`` distinct continuations of the longest suffix n-gram, most recent match
    first."""
    L = tokens.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)
        hits = np.nonzero((windows == tokens[L - n :]).all(axis=1))[0]
        if hits.size:
            out, seen = [], set()
            for h in hits[::-1]:
                c = tokens[int(h) + n : int(h) + n + k]
                key = c.tobytes()
                if key not in seen:
                    seen.add(key)
                    out.append(c)
                    if len(out) == branches:
                        break
            return out
    return []


def find_candidate(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The tokens following the most recent earlier match of the longest suffix n-gram (n from
    max_n down to min_n); empty if none."""
    c = find_candidates(tokens, min_n, max_n, k, 1)
    return c[0] if c else tokens[:0]


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"

    def __init__(self, spec: SpecConfig):
        self.spec = spec

    def max_draft_depth(self) -> int:
        return self.spec.k

    def begin(self, prompt_ids, sp, generator, processor=None):
        pass

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        k = min(self.spec.k, max_tokens)
        if k <= 0:
            return DraftTree.empty()
        arr = np.asarray(tokens, dtype=np.int64)
        p = self.spec.params
        if p.branches > 1:
            return trie(find_candidates(arr, p.min_ngram, p.max_ngram, k, p.branches))
        cand = find_candidate(arr, p.min_ngram, p.max_ngram, k)
        return DraftTree.chain(torch.from_numpy(cand.copy()))
