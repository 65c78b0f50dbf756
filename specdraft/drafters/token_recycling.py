"""Token Recycling (Luo et al. 2024): recycle the candidate tokens the target already computed.

An adjacency table ``M`` [V, top_k] (int32) holds, for each token id, the target's top-k next tokens
the last time that token was scored. After every target forward the engine hands the drafter the
rows' logits [n + 1, V] and each row's token (``observe``); one batched ``topk`` over the rows
and one indexed write refresh the table (``M[row_tokens] = topk(logits).indices``), no loop over the
vocabulary. Rows never observed are -1 and draft nothing.

The draft is a static tree expanded from the last context token: ``branching[d]`` children per node
at depth d, child j of node x being ``M[x, j]``; one gather per depth. Deterministic, so
``draft_probs`` is None. Memory: V x top_k x 4 bytes (151,936 x 8 x 4 = 4.9 MB for Qwen2.5).
"""

from __future__ import annotations

import torch

from ..core.config import SpecConfig
from ..core.device import HOST
from ..core.tree import DraftTree
from .base import Drafter


class AdjacencyTable:
    """The [V, top_k] int32 successor table, shared by the drafters of one SpecDecoder (on the host: drafts
    are read from it token by token)."""

    def __init__(self, vocab_size: int, top_k: int):
        self.table = torch.full((vocab_size, top_k), -1, dtype=torch.int32, device=HOST)

    @property
    def top_k(self) -> int:
        return int(self.table.shape[1])

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def update(self, row_tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """``logits`` [n, V'] (V' may exceed the table's V for padded heads; only ids < V are kept)."""
        V, k = self.table.shape
        top = torch.topk(logits[:, :V].float(), k, dim=-1).indices.to(device=HOST, dtype=torch.int32)
        self.table[row_tokens.long()] = top  # on duplicates the later row wins


def static_tree(branching: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """The tree's shape: (parents [n], rank [n] = which child of its parent a node is, and per depth
    the slice of node indices). Breadth-first order, so parents precede children."""
    parents, ranks, levels = [], [], []
    start, prev = 0, [-1]
    for b in branching:
        level = [(p, j) for p in prev for j in range(b)]
        parents += [p for p, _ in level]
        ranks += [j for _, j in level]
        levels.append((start, start + len(level)))
        prev = list(range(start, start + len(level)))
        start += len(level)
    parent_ids = torch.tensor(parents, dtype=torch.long, device=HOST)
    return parent_ids, torch.tensor(ranks, dtype=torch.long, device=HOST), levels


def expand(table: torch.Tensor, root: int, branching: list[int]) -> DraftTree:
    """The static tree filled from ``table`` starting at token ``root``, without the nodes whose
    token (or an ancestor's) is unknown (-1)."""
    parents, ranks, levels = static_tree(branching)
    n = parents.shape[0]
    tokens = torch.empty(n, dtype=torch.long, device=HOST)
    for d, (a, b) in enumerate(levels):
        par_tok = torch.full((b - a,), root, dtype=torch.long, device=HOST) if d == 0 else tokens[parents[a:b]]
        row = table[par_tok.clamp(min=0)].long()  # [nodes at this depth, top_k]: one gather per depth
        tok = row[torch.arange(b - a, device=HOST), ranks[a:b]]
        tokens[a:b] = torch.where(par_tok >= 0, tok, torch.full_like(tok, -1))
    valid = tokens >= 0  # a -1 parent made its children -1 above, so valid is ancestor-closed
    if bool(valid.all()):
        return DraftTree(tokens, parents)
    new_id = torch.cumsum(valid.long(), 0) - 1
    keep = valid.nonzero().squeeze(1)
    par = parents[keep]
    par = torch.where(par >= 0, new_id[par.clamp(min=0)], par)
    return DraftTree(tokens[keep], par)


class TokenRecyclingDrafter(Drafter):
    name = "token_recycling"
    reproducible = False  # its table learns from every request the decoder serves

    def __init__(self, spec: SpecConfig, vocab_size: int, table: AdjacencyTable | None = None):
        self.spec = spec
        self.branching = list(spec.params.recycle_branching)
        top_k = max(self.branching)
        if table is None or table.top_k != top_k or table.table.shape[0] != vocab_size:
            table = AdjacencyTable(vocab_size, top_k)
        self.adj = table

    def begin(self, prompt_ids, sp, generator, processor=None):
        pass  # the table is recycled across requests (it is the target's own statistics)

    def max_draft_depth(self) -> int:
        return len(self.branching)

    def observe(self, step) -> None:
        self.adj.update(step.fed, step.logits)

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        depth = min(len(self.branching), max_tokens)
        if depth <= 0 or not tokens:
            return DraftTree.empty()
        return expand(self.adj.table, int(tokens[-1]), self.branching[:depth])
