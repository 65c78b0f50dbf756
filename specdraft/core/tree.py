"""The draft: a token tree. A chain is a tree whose node i has parent i - 1.

``parents[i]`` is the index of node i's parent, or -1 for a child of the root (the last token
of the context, which the target already has as its pending token). Nodes are topologically
ordered (parent index < own index). ``draft_probs[i]`` is the draft distribution that node i
was sampled from (the distribution at its parent), or None for a deterministic drafter, which
the verifier treats as one-hot.

A tree's tokens and parents live on the host (``device.HOST``: the loop builds feeds and masks from
them and reads them as lists); ``chain`` takes a drafter's tokens from its device in one copy.
``draft_probs`` stay where the drafter computed them; verification moves them to the target's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from .device import HOST


@dataclass
class DraftTree:
    tokens: torch.Tensor  # LongTensor [n]
    parents: torch.Tensor  # LongTensor [n]
    draft_probs: torch.Tensor | None = None  # float [n, V] or None (deterministic -> one-hot)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def of(tokens: list[int], parents: list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A tree from its nodes' tokens and parents as lists."""
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long, device=HOST),
            torch.tensor(parents, dtype=torch.long, device=HOST),
            draft_probs,
        )

    @staticmethod
    def chain(tokens: torch.Tensor | list[int], draft_probs: torch.Tensor | None = None) -> "DraftTree":
        t = torch.as_tensor(tokens, dtype=torch.long, device=HOST).reshape(-1)
        n = t.shape[0]
        return DraftTree(t, torch.arange(-1, n - 1, dtype=torch.long, device=HOST), draft_probs)

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree.chain(torch.empty(0, dtype=torch.long, device=HOST))

    def is_chain(self) -> bool:
        n = self.size
        return bool(torch.equal(self.parents, torch.arange(-1, n - 1, dtype=torch.long, device=HOST)))

    def depths(self) -> torch.Tensor:
        """Depth of each node (1 for children of the root)."""
        d: list[int] = []
        for p in self.parents.tolist():  # nodes are topologically ordered
            d.append(1 if p < 0 else d[p] + 1)
        return torch.tensor(d, dtype=torch.long, device=HOST)

    # --- tree attention (the target scores a whole tree in one forward) ------------------------
    def ancestors(self) -> torch.Tensor:
        """Bool [n, n]: A[i, j] is True iff node j is node i or one of its ancestors."""
        n = self.size
        a = torch.eye(n, dtype=torch.bool, device=HOST)
        for i, p in enumerate(self.parents.tolist()):  # nodes, not vocabulary: n is small
            if p >= 0:
                a[i] |= a[p]
        return a

    def attention_mask(self, past_len: int, n_pending: int = 1, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Additive 4D mask (1, 1, q, past_len + q), q = n_pending + n: the pending tokens are causal
        among themselves; each tree node sees the cache, every pending token and its own ancestors.
        0 where attention is allowed, the dtype's minimum elsewhere."""
        q = n_pending + self.size
        allow = torch.zeros(q, past_len + q, dtype=torch.bool, device=HOST)
        allow[:, :past_len] = True
        causal = torch.tril(torch.ones(n_pending, n_pending, dtype=torch.bool, device=HOST))
        allow[:n_pending, past_len : past_len + n_pending] = causal
        allow[n_pending:, past_len : past_len + n_pending] = True
        allow[n_pending:, past_len + n_pending :] = self.ancestors()
        mask = torch.zeros(q, past_len + q, dtype=dtype, device=HOST).masked_fill(~allow, torch.finfo(dtype).min)
        return mask[None, None]

    def position_ids(self, past_len: int, n_pending: int = 1) -> torch.Tensor:
        """(1, n_pending + n): pending tokens at past_len.., node i at (last pending) + depth(i)."""
        pend = torch.arange(past_len, past_len + n_pending, device=HOST)
        nodes = past_len + n_pending - 1 + self.depths()
        return torch.cat([pend, nodes])[None]

    def subset(self, keep: torch.Tensor) -> "DraftTree":
        """The nodes where ``keep`` (bool [n]) is True, re-indexed; a kept node's parent must be kept."""
        new_index = torch.cumsum(keep.long(), 0) - 1
        par = self.parents[keep]
        parents = torch.where(par >= 0, new_index[par.clamp(min=0)], par)
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        return DraftTree(self.tokens[keep], parents, probs)

    def extra_leaves(self) -> int:
        """Leaves beyond the first (0 for a chain or an empty tree): a token tree's extra sequences on llama.cpp."""
        if self.size == 0:
            return 0
        has_child = torch.zeros(self.size, dtype=torch.bool, device=HOST)
        has_child[self.parents[self.parents >= 0]] = True
        return int((~has_child).sum()) - 1

    def first(self, n: int) -> "DraftTree":
        """The first ``n`` nodes (topological order keeps every kept node's ancestors): a smaller draft of
        the same candidates, as if the drafter had stopped after them."""
        return self if n >= self.size else self.subset(torch.arange(self.size, device=HOST) < n)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to ``node`` (empty for node -1, the root)."""
        path, par = [], self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = par[node]
        return path[::-1]


def feed_mask(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(allow, offsets) for feeding [pending token] + a token tree's nodes: the pending token sees
    itself, node i sees the pending token and its own ancestors (itself included), at depth(i)."""
    n = tree.size
    allow = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=HOST)
    allow[:, 0] = True
    allow[1:, 1:] = tree.ancestors()
    return allow, torch.cat([torch.zeros(1, dtype=torch.long, device=HOST), tree.depths()])


class _NodeIndex:
    """A tree built node by node where a (parent, token) pair is one node: what inserting paths or
    another tree's nodes finds there already is shared, not repeated."""

    def __init__(self, tokens: list[int] | None = None, parents: list[int] | None = None):
        self.tokens, self.parents = list(tokens or []), list(parents or [])
        self.index = {(p, t): i for i, (p, t) in enumerate(zip(self.parents, self.tokens))}

    def node(self, parent: int, token: int) -> int:
        """The index of ``parent``'s child carrying ``token``, added when missing."""
        key = (parent, token)
        if key not in self.index:
            self.index[key] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return self.index[key]

    def tree(self) -> DraftTree:
        return DraftTree.of(self.tokens, self.parents)


def trie(paths) -> DraftTree:
    """Token paths (sequences of token ids from the root's child down) merged into a tree: shared
    prefixes become shared nodes. Deterministic candidates (no draft_probs)."""
    nodes = _NodeIndex()
    for path in paths:
        parent = -1
        for t in path.tolist() if hasattr(path, "tolist") else path:
            parent = nodes.node(parent, int(t))
    return nodes.tree()


def merge_trees(a: DraftTree, b: DraftTree) -> DraftTree:
    """One tree holding both (nodes of ``b`` with the same parent and token as a node of ``a`` merge
    into it); ``a``'s nodes keep their indices. Deterministic candidates only (no draft_probs)."""
    nodes = _NodeIndex(a.tokens.tolist(), a.parents.tolist())
    where: list[int] = []  # b's node j -> its index in the merged tree
    for t, p in zip(b.tokens.tolist(), b.parents.tolist()):
        where.append(nodes.node(-1 if p < 0 else where[p], t))
    return nodes.tree()


def accepted_rows(draft: DraftTree, n_fed: int, n_acc: int, emitted: Sequence[int]) -> list[int]:
    """Rows of the target's fed positions (pending tokens, then draft nodes) that are now verified
    context: every pending row, then the accepted path's nodes. Siblings carry distinct tokens, so
    the accepted tokens identify the path."""
    n_pend = n_fed - draft.size
    rows = list(range(n_pend))
    if n_acc == 0:
        return rows
    if draft.is_chain():
        return rows + [n_pend + i for i in range(n_acc)]
    parents, toks = draft.parents.tolist(), draft.tokens.tolist()
    parent = -1
    for t in emitted[:n_acc]:
        parent = next(i for i in range(draft.size) if parents[i] == parent and toks[i] == t)
        rows.append(n_pend + parent)
    return rows


# --- tree shapes: what a drafter that scores one tree level per forward grows --------------------------
Path = tuple[int, ...]  # a node as the ranks of its ancestors' and its own place among siblings


def choices_from_branching(branching: list[int]) -> list[Path]:
    """[3, 2] -> (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), ... (level order)."""
    out: list[Path] = []
    level: list[Path] = [()]
    for b in branching:
        level = [p + (r,) for p in level for r in range(b)]
        out.extend(level)
    return out


@dataclass(frozen=True)
class TreeShape:
    """The tree a drafter grows per step: ``static``, a fixed set of node paths (Medusa's "choices",
    level order; ``children[path]``: how many children the node at ``path`` gets, () being the root), or
    dynamic (EAGLE-2: ``topk`` children for each of the ``topk`` most probable frontier nodes, reranked
    to ``budget``), at most ``max_depth`` deep. A chain is a dynamic shape never grown."""

    static: bool
    max_depth: int
    choices: tuple[Path, ...] = ()
    budget: int = 0
    topk: int = 0

    @staticmethod
    def of(
        tree: str,
        k: int,
        choices: list[list[int]] | None = None,
        branching: list[int] | None = None,
        budget: int = 0,
        topk: int = 0,
    ) -> "TreeShape":
        """A spec's shape: ``tree`` "static" takes ``choices`` (or ``branching`` per depth); otherwise
        ``k`` levels."""
        if tree != "static":
            return TreeShape(False, k, budget=budget, topk=topk)
        paths = [tuple(c) for c in choices] if choices else choices_from_branching(branching or [])
        ordered = tuple(sorted(set(paths), key=lambda c: (len(c), c)))
        return TreeShape(True, max(len(c) for c in ordered), ordered, budget, topk)

    @cached_property
    def children(self) -> dict[Path, int]:
        return child_counts(self.choices)


def child_counts(choices) -> dict[Path, int]:
    """Per node path (() the root): how many children a static shape's ``choices`` give it."""
    out: dict[Path, int] = {}
    for c in choices:
        out[c[:-1]] = max(out.get(c[:-1], 0), c[-1] + 1)
    return out
