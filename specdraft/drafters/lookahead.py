"""Lookahead decoding (Fu et al. 2024): Jacobi iteration generates n-grams, a pool keeps
them, and pooled n-grams that start with the last token are verified, all in one target forward.

The 2D window has N - 1 levels of W tokens; ``level[l][c]`` sits at position (last + 1 + c + l).
Column c is a trajectory: level 0 (the oldest guesses) forms the trunk, a chain
``level[0][0] -> level[0][1] -> ...``, and ``level[l][c]`` is the child of ``level[l-1][c]``.
With the engine's tree attention each node sees the context, the trunk before its column and its
own column's lower levels: exactly lookahead decoding's attention pattern, so the lookahead branch
is a token tree. The verification branch (up to G pooled n-grams whose first token is the last
context token, merged into a trie) hangs off the root too, and the engine's greedy tree verifier
keeps the deepest path the target agrees with, from either branch: lossless by construction.

After the forward (``observe``) the target's argmax at each column's top level is the new
level; (column's N - 1 tokens + that argmax) is an n-gram for the pool (keyed by its first token,
most recent first, at most G per key); the oldest level is dropped. The window is not re-aligned
when several tokens are accepted (as in the reference implementation).

Sampling is exact too: the tree drafted at a step is a deterministic function of the history
(prompt, emitted tokens, and the target's logits of earlier forwards, themselves functions of the
history), never of the step's own random draws; the engine's tree rejection sampler
(verify.rejection_sample_tree, one-hot candidates) is exact for any such tree, as for Token
Recycling. The Jacobi update keeps using the argmax when sampling (it only shapes the guesses).
Checked statistically in tests/test_model_free.py.
"""

from __future__ import annotations

import numpy as np

from ..core.config import SpecConfig
from ..core.tree import DraftTree, trie
from .base import Drafter


class LookaheadDrafter(Drafter):
    name = "lookahead"
    reads_fed_positions = True  # observe reads the Jacobi window's rows of the fed tree

    def __init__(self, spec: SpecConfig):
        p = spec.params
        self.W, self.N, self.G = p.lookahead_window, p.lookahead_ngram, p.lookahead_max_ngrams
        self.levels: list[list[int]] = []
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self._top: list[int] = []  # node index of each column's top-level node in the last draft

    def begin(self, prompt_ids, sp, generator, processor=None):
        rng = np.random.default_rng(0)  # deterministic initial guesses: tokens of the prompt
        p = np.asarray(prompt_ids, dtype=np.int64)
        self.levels = [p[rng.integers(0, p.shape[0], self.W)].tolist() for _ in range(self.N - 1)]
        self.pool = {}
        self._top = []

    def add_ngram(self, gram: tuple[int, ...]) -> None:
        lst = self.pool.setdefault(gram[0], [])
        rest = gram[1:]
        if rest in lst:
            lst.remove(rest)
        lst.insert(0, rest)
        del lst[self.G :]

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        self._top = []
        if max_tokens <= 0 or not tokens:
            return DraftTree.empty()
        ver = [np.asarray(g[:max_tokens], dtype=np.int64) for g in self.pool.get(int(tokens[-1]), [])]
        vt = trie(ver) if ver else DraftTree.empty()
        toks, pars = vt.tokens.tolist(), vt.parents.tolist()
        # lookahead branch: the trunk (level 0) as a chain, then each column's higher levels
        W = min(self.W, max_tokens)
        idx = {}
        for c in range(W):
            idx[(0, c)] = len(toks)
            toks.append(self.levels[0][c])
            pars.append(idx[(0, c - 1)] if c else -1)
        for lv in range(1, self.N - 1):
            for c in range(W):
                if c + 1 + lv > max_tokens:  # depth cap: emitted tokens never exceed max_tokens + 1
                    continue
                idx[(lv, c)] = len(toks)
                toks.append(self.levels[lv][c])
                pars.append(idx[(lv - 1, c)])
        top = self.N - 2
        if W == self.W and all((top, c) in idx for c in range(W)):
            self._top = [idx[(top, c)] for c in range(W)]
        return DraftTree.of(toks, pars)

    def max_draft_depth(self) -> int:
        return self.W + self.N - 2  # Jacobi window + verification branch

    def observe(self, step) -> None:
        logits = step.logits
        if not self._top:
            return  # the window did not fit this step: keep it as it is
        new = logits[[1 + i for i in self._top]].argmax(dim=-1).tolist()  # W rows, not the vocabulary
        for c in range(self.W):
            self.add_ngram(tuple(self.levels[lv][c] for lv in range(self.N - 1)) + (int(new[c]),))
        self.levels = self.levels[1:] + [new]
        self._top = []
