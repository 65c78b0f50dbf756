"""Prompt lookup decoding (LLMA / PLD): copy what followed an earlier occurrence of the current
suffix n-gram in prompt + output. Deterministic, so its draft distribution is one-hot."""

from __future__ import annotations

import numpy as np
import torch

from ..config import SpecConfig
from ..tree import DraftTree


def find_candidate(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Tokens following the most recent earlier match of the longest suffix n-gram (n from max_n
    down to min_n); empty if none. Vectorized over positions."""
    L = tokens.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = tokens[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)  # starts 0..L-1-n
        hits = np.nonzero((windows == pattern).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n  # most recent match; it has >= 1 following token
            return tokens[start : start + k]
    return tokens[:0]


class PromptLookupDrafter:
    name = "prompt_lookup"

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg

    def begin(self, prompt_ids, sp, generator):
        pass

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        k = min(self.cfg.k, max_tokens)
        if k <= 0:
            return DraftTree.empty()
        cand = find_candidate(np.asarray(tokens, dtype=np.int64), self.cfg.min_ngram, self.cfg.max_ngram, k)
        return DraftTree.chain(torch.from_numpy(cand.copy()))

    def feedback(self, num_accepted, emitted):
        pass
