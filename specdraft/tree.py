"""The draft: a token tree. A chain is a tree whose node i has parent i - 1.

``parents[i]`` is the index of node i's parent, or -1 for a child of the root (the last token
of the context, which the target already has as its pending token). Nodes are topologically
ordered (parent index < own index). ``draft_probs[i]`` is the draft distribution that node i
was sampled from (the distribution at its parent), or None for a deterministic drafter, which
the verifier treats as one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # LongTensor [n]
    parents: torch.Tensor  # LongTensor [n]
    draft_probs: torch.Tensor | None = None  # float [n, V] or None (deterministic -> one-hot)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def chain(tokens: torch.Tensor | list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = t.shape[0]
        return DraftTree(t, torch.arange(-1, n - 1, dtype=torch.long), draft_probs)

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree.chain(torch.empty(0, dtype=torch.long))

    def is_chain(self) -> bool:
        n = self.size
        return bool(torch.equal(self.parents, torch.arange(-1, n - 1, dtype=torch.long)))

    def depths(self) -> torch.Tensor:
        """Depth of each node (1 for children of the root)."""
        d = torch.zeros(self.size, dtype=torch.long)
        par = self.parents.tolist()
        for i, p in enumerate(par):
            d[i] = 1 if p < 0 else d[p] + 1
        return d
