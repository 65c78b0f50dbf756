"""Growing a token tree one level per forward, written once for every drafter that scores tree levels:
the draft model's rows (``draft_model.DraftModelGroup``, many requests per forward) and the EAGLE head
(``eagle.py``). Static shapes (branching per depth, or Medusa-style "choices") and dynamic trees
(EAGLE-2's idea: expand the most probable frontier, rerank to a budget).

Sampling: the children of a node are drawn without replacement from the processed draft
distribution q (the same ``probs_from_logits`` as the target), and each node records the
distribution it was actually drawn from (q with its earlier siblings removed, renormalized), which
is what ``verify.rejection_sample_tree`` needs to stay exact. Greedy takes the top ranks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

from ..core.device import HOST
from ..core.sampling import probs_from_logits, sample
from ..core.tree import DraftTree, TreeShape

if TYPE_CHECKING:
    from ..core.config import SamplingParams
    from ..core.processors import RequestProcessor


def spec_shape(spec) -> TreeShape:
    """The tree a spec's ``tree`` asks for: its static shape (``tree_choices`` or ``tree_branching``), a dynamic
    tree (``tree_budget``, ``tree_topk``; both the method's own settings, core/methods.py), or a chain ``k`` deep."""
    p = spec.params
    if spec.tree == "static":
        return TreeShape.of("static", spec.k, p.tree_choices, p.tree_branching)
    if spec.tree == "dynamic":
        return TreeShape.of("dynamic", spec.k, budget=p.tree_budget, topk=p.tree_topk)
    return TreeShape.of(spec.tree, spec.k)


class GrowingTree:
    """One draft's token tree of ``shape`` as it grows, one level per forward, under the request's
    sampling ``sp``, random stream ``gen`` and ``processor`` (penalties, a grammar: applied to a node's
    children with the node's own history when ``history``, the context's tokens, is given).

    ``grow(root_logits, depth, score_level)`` builds it, ``score_level(nodes)`` feeding ``nodes`` (all at one
    depth) and returning the logits [len(nodes), V] of their children; or the caller drives the generator
    ``growth`` itself (the draft model's group, which batches the levels of many rows into one forward).
    ``level_feed`` gives what a ``SequenceRows`` row feeds for a level, ``level_mask`` the mask of a cache of
    the drafter's own (EAGLE), whose first ``ctx`` slots hold the context. Node i's token is ``tokens[i]``,
    its parent ``parents[i]`` (-1: the root), its path from the root ``paths[i]`` (node indices, itself
    last); ``fed[i]`` is the cache slot ``level_mask`` fed it at.
    """

    def __init__(
        self,
        shape: TreeShape,
        sp: SamplingParams,
        gen: torch.Generator | None,
        processor: RequestProcessor | None = None,
        ctx: int = 0,
        history: list[int] | None = None,
    ):
        self.shape, self.sp, self.gen, self.processor = shape, sp, gen, processor
        self.ctx, self.history = ctx, history
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.paths: list[list[int]] = []
        self.fed: dict[int, int] = {}
        self._q: list[torch.Tensor | None] = []  # the distribution each node was drawn from (None: greedy)
        self._score: list[float] = []  # cumulative draft log-probability
        self._rank: list[tuple[int, ...]] = []  # a node's place in a static shape (its ranks from the root)

    # --- children of one node ----------------------------------------------------------------
    def _children(self, logits: torch.Tensor, m: int, parent: int = -1) -> list[tuple[int, torch.Tensor | None, float]]:
        """Up to m (token, proposal distribution or None, log draft prob) for one node's children; with
        the request's processor, from the logits processed with the node's own history."""
        if self.processor is not None and self.history is not None:
            path = [] if parent < 0 else [self.tokens[a] for a in self.paths[parent]]
            logits = self.processor.process(logits[None], self.history + path)[0]
        if self.sp.greedy:
            lp = torch.log_softmax(logits, -1)
            top = torch.topk(lp, min(m, int(torch.isfinite(lp).sum())))  # never a token the draft cannot make
            return [(t, None, v) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        q = probs_from_logits(logits, self.sp)
        out: list[tuple[int, torch.Tensor | None, float]] = []
        cur = q
        for _ in range(m):  # without replacement: each child records the distribution it came from
            s = cur.sum()
            if s <= 0:
                break
            cur = cur / s
            t = int(sample(cur, self.gen))
            out.append((t, cur, math.log(float(q[t]))))
            cur = cur.clone()
            cur[t] = 0.0
        return out

    def _add(self, parent: int, kids) -> list[int]:
        new = []
        base = 0.0 if parent < 0 else self._score[parent]
        for r, (t, q, lp) in enumerate(kids):
            i = len(self.tokens)
            self.tokens.append(t)
            self.parents.append(parent)
            self._q.append(q)
            self._score.append(base + lp)
            self.paths.append(([] if parent < 0 else self.paths[parent]) + [i])
            self._rank.append((() if parent < 0 else self._rank[parent]) + (r,))
            new.append(i)
        return new

    def level_mask(self, nodes: list[int], past: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive 4D mask [1, 1, m, past + m] and positions [1, m] for feeding ``nodes`` (one depth)
        into a cache of ``past`` slots: node i sees the context (the first ``ctx`` slots), its fed
        ancestors and itself, at position ``ctx - 1 + depth``. Records the slot each node goes to."""
        m = len(nodes)
        allow = torch.zeros(m, past + m, dtype=torch.bool, device=HOST)
        allow[:, : self.ctx] = True
        for j, i in enumerate(nodes):
            for a in self.paths[i][:-1]:
                allow[j, self.fed[a]] = True
            allow[j, past + j] = True
            self.fed[i] = past + j
        mask = torch.zeros(m, past + m, dtype=dtype, device=HOST).masked_fill(~allow, torch.finfo(dtype).min)
        pos = torch.tensor([[self.ctx - 1 + len(self.paths[i]) for i in nodes]], device=HOST)
        return mask[None, None], pos

    def level_feed(self, nodes: list[int]) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor], list[int]]:
        """What a ``SequenceRows`` row whose cache holds the context feeds to score ``nodes`` (one depth):
        the nodes and all their ancestors (level order: the deepest, ``nodes``, come last) as a token
        tree ``(allow, offsets)`` (each sees the context, its ancestors and itself, at position context
        length - 1 + depth), and the fed index of each of ``nodes``. The caller then commits none of it."""
        fed = sorted({a for i in nodes for a in self.paths[i]})
        at = {n: j for j, n in enumerate(fed)}
        allow = torch.zeros(len(fed), len(fed), dtype=torch.bool, device=HOST)
        for j, n in enumerate(fed):
            allow[j, [at[a] for a in self.paths[n]]] = True
        offsets = torch.tensor([len(self.paths[n]) - 1 for n in fed], dtype=torch.long, device=HOST)
        return [self.tokens[n] for n in fed], (allow, offsets), [at[i] for i in nodes]

    # --- the tree, level by level ------------------------------------------------------------
    def grow(self, root: torch.Tensor, depth: int, score_level: Callable[[list[int]], torch.Tensor]) -> DraftTree:
        """``growth`` driven by ``score_level(nodes)`` -> the logits [len(nodes), V] of their children."""
        growth = self.growth(root, depth)
        try:
            nodes = next(growth)
            while True:
                nodes = growth.send(score_level(nodes))
        except StopIteration as done:
            return done.value

    def growth(self, root: torch.Tensor, depth: int):
        """The tree as a generator: yields the nodes to expand (all at one depth), is sent their
        children's logits [len(nodes), V], returns the DraftTree. Static: the shape's children per
        node. Dynamic (EAGLE-2): expand the ``topk`` frontier nodes with the highest cumulative
        draft log-probability, ``topk`` children each; greedy reranks every candidate to the
        ``budget`` best (ancestor-closed), sampling stops drawing at the budget."""
        shape, greedy = self.shape, self.sp.greedy
        static, budget, topk = shape.static, shape.budget, shape.topk
        m0 = shape.children.get((), 0) if static else topk
        if not static and not greedy:
            m0 = min(m0, budget)
        level = self._add(-1, self._children(root, m0))
        for _ in range(1, depth):
            if static:
                expand = [i for i in level if shape.children.get(self._rank[i], 0) > 0]
            else:  # the frontier nodes with the highest cumulative draft log-probability
                expand = sorted(level, key=lambda i: -self._score[i])[:topk]
                if not greedy:
                    expand = expand[: max(budget - len(self.tokens), 0)]
            if not expand:
                break
            logits = yield expand
            level = []
            for j, i in enumerate(expand):
                m = shape.children[self._rank[i]] if static else topk
                if not static and not greedy:  # stop drawing at the budget (decided before drawing)
                    m = min(m, budget - len(self.tokens))
                    if m <= 0:
                        break
                level += self._add(i, self._children(logits[j], m, i))
        return self._finish(static, greedy, budget)

    def _finish(self, static: bool, greedy: bool, budget: int) -> DraftTree:
        keep = list(range(len(self.tokens)))
        if not static and greedy and len(keep) > budget:  # rerank to the budget, ancestor-closed
            best = sorted(keep, key=lambda i: -self._score[i])[:budget]
            chosen = set(best)
            for i in best:
                chosen.update(self.paths[i])
            keep = sorted(chosen)
        new = {old: j for j, old in enumerate(keep)}
        parents = [new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]
        probs = None if greedy else torch.stack([q for q in (self._q[i] for i in keep) if q is not None])
        return DraftTree.of([self.tokens[i] for i in keep], parents, probs)
