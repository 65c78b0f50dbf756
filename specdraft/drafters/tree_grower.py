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

import torch

from ..core.config import SpecConfig
from ..core.device import HOST
from ..core.sampling import probs_from_logits, sample
from ..core.tree import DraftTree


def choices_from_branching(branching: list[int]) -> list[tuple[int, ...]]:
    """[3, 2] -> (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), ... (level order)."""
    out, level = [], [()]
    for b in branching:
        level = [p + (r,) for p in level for r in range(b)]
        out.extend(level)
    return out


class TreeGrower:
    """The tree-building half of a tree drafter that scores one tree level per forward.

    The owner has ``spec``, ``sp``, ``gen`` and ``processor``; it calls ``_tree_shape(spec)`` once,
    ``_start_tree(ctx, history)`` at the start of every draft (ctx: the context positions the nodes
    attend to), then either ``_grow(root_logits, depth, score_level)``, where ``score_level(nodes)``
    feeds ``nodes`` (all at one depth) and returns the logits [len(nodes), V] of their children, or
    drives the generator ``_growth`` itself (the draft model's group, which batches the levels of
    many rows into one forward). ``_level_feed`` gives what a ``SequenceRows`` row feeds for a level,
    ``_level_mask`` the mask of a cache of one's own (EAGLE). Node i's token is ``_tok[i]``, its parent
    ``_par[i]`` (-1: the root), its path from the root ``_anc[i]``; ``_fed[i]`` is the cache slot
    ``_level_mask`` fed it at; ``_final`` the nodes kept in the returned DraftTree (their order is the
    tree's node order).
    """

    def _tree_shape(self, spec: SpecConfig) -> None:
        self.n_children: dict[tuple[int, ...], int] = {}
        if spec.tree == "static":
            ch = [tuple(c) for c in spec.tree_choices] if spec.tree_choices else choices_from_branching(spec.tree_branching)
            for c in ch:
                self.n_children[c[:-1]] = max(self.n_children.get(c[:-1], 0), c[-1] + 1)
            self.max_depth = max(len(c) for c in ch)
        else:
            self.max_depth = spec.k

    def _start_tree(self, ctx: int, history: list[int] | None = None) -> None:
        self._history = history  # the context's tokens, for the request's processor (penalties, grammar)
        self._tok, self._par, self._q, self._score, self._anc, self._rank = [], [], [], [], [], []
        self._fed: dict[int, int] = {}
        self._ctx = ctx
        self._final: list[int] = []

    # --- children of one node ----------------------------------------------------------------
    def _children(self, logits: torch.Tensor, m: int, parent: int = -1) -> list[tuple[int, torch.Tensor | None, float]]:
        """Up to m (token, proposal distribution or None, log draft prob) for one node's children; with
        the request's processor, from the logits processed with the node's own history."""
        if self.processor is not None and self._history is not None:
            path = [] if parent < 0 else [self._tok[a] for a in self._anc[parent]]
            logits = self.processor.process(logits[None], self._history + path)[0]
        if self.sp.greedy:
            lp = torch.log_softmax(logits, -1)
            top = torch.topk(lp, min(m, int(torch.isfinite(lp).sum())))  # never a token the draft cannot make
            return [(t, None, v) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        q = probs_from_logits(logits, self.sp)
        out, cur = [], q
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

    def _add(self, parent: int, kids, rank0: int = 0) -> list[int]:
        new = []
        base = 0.0 if parent < 0 else self._score[parent]
        for r, (t, q, lp) in enumerate(kids):
            i = len(self._tok)
            self._tok.append(t)
            self._par.append(parent)
            self._q.append(q)
            self._score.append(base + lp)
            self._anc.append(([] if parent < 0 else self._anc[parent]) + [i])
            self._rank.append(([] if parent < 0 else self._rank[parent]) + [rank0 + r])
            new.append(i)
        return new

    def _level_mask(self, nodes: list[int], past: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive 4D mask [1, 1, m, past + m] and positions [1, m] for feeding ``nodes`` (one depth)
        into a cache of ``past`` slots: node i sees the context (the first ``_ctx`` slots), its fed
        ancestors and itself, at position ``_ctx - 1 + depth``. Records the slot each node goes to."""
        m = len(nodes)
        allow = torch.zeros(m, past + m, dtype=torch.bool, device=HOST)
        allow[:, : self._ctx] = True
        for j, i in enumerate(nodes):
            for a in self._anc[i][:-1]:
                allow[j, self._fed[a]] = True
            allow[j, past + j] = True
            self._fed[i] = past + j
        mask = torch.zeros(m, past + m, dtype=dtype, device=HOST).masked_fill(~allow, torch.finfo(dtype).min)
        pos = torch.tensor([[self._ctx - 1 + len(self._anc[i]) for i in nodes]], device=HOST)
        return mask[None, None], pos

    def _level_feed(self, nodes: list[int]) -> tuple[list[int], tuple[torch.Tensor, torch.Tensor], list[int]]:
        """What a ``SequenceRows`` row whose cache holds the context feeds to score ``nodes`` (one depth):
        the nodes and all their ancestors (level order: the deepest, ``nodes``, come last) as a token
        tree ``(allow, offsets)`` (each sees the context, its ancestors and itself, at position context
        length - 1 + depth), and the fed index of each of ``nodes``. The caller then commits none of it."""
        fed = sorted({a for i in nodes for a in self._anc[i]})
        at = {n: j for j, n in enumerate(fed)}
        allow = torch.zeros(len(fed), len(fed), dtype=torch.bool, device=HOST)
        for j, n in enumerate(fed):
            allow[j, [at[a] for a in self._anc[n]]] = True
        offsets = torch.tensor([len(self._anc[n]) - 1 for n in fed], dtype=torch.long, device=HOST)
        return [self._tok[n] for n in fed], (allow, offsets), [at[i] for i in nodes]

    # --- the tree, level by level ------------------------------------------------------------
    def _grow(self, root: torch.Tensor, depth: int, score_level) -> DraftTree:
        """``_growth`` driven by ``score_level(nodes)`` -> the logits [len(nodes), V] of their children."""
        growth = self._growth(root, depth)
        try:
            nodes = next(growth)
            while True:
                nodes = growth.send(score_level(nodes))
        except StopIteration as done:
            return done.value

    def _growth(self, root: torch.Tensor, depth: int):
        """The tree as a generator: yields the nodes to expand (all at one depth), is sent their
        children's logits [len(nodes), V], returns the DraftTree. Static: the shape's children per
        node. Dynamic (EAGLE-2): expand the ``tree_topk`` frontier nodes with the highest cumulative
        draft log-probability, ``tree_topk`` children each; greedy reranks every candidate to the
        ``tree_budget`` best (ancestor-closed), sampling stops drawing at the budget."""
        static = self.spec.tree == "static"
        budget = self.spec.tree_budget
        greedy = self.sp.greedy
        topk = self.spec.tree_topk
        m0 = self.n_children.get((), 0) if static else topk
        if not static and not greedy:
            m0 = min(m0, budget)
        level = self._add(-1, self._children(root, m0))
        for _ in range(1, depth):
            if static:
                expand = [i for i in level if self.n_children.get(tuple(self._rank[i]), 0) > 0]
            else:  # the frontier nodes with the highest cumulative draft log-probability
                expand = sorted(level, key=lambda i: -self._score[i])[:topk]
                if not greedy:
                    expand = expand[: max(budget - len(self._tok), 0)]
            if not expand:
                break
            logits = yield expand
            level = []
            for j, i in enumerate(expand):
                m = self.n_children[tuple(self._rank[i])] if static else topk
                if not static and not greedy:  # stop drawing at the budget (decided before drawing)
                    m = min(m, budget - len(self._tok))
                    if m <= 0:
                        break
                level += self._add(i, self._children(logits[j], m, i))
        return self._finish(static, greedy, budget)

    def _finish(self, static: bool, greedy: bool, budget: int) -> DraftTree:
        keep = list(range(len(self._tok)))
        if not static and greedy and len(keep) > budget:  # rerank to the budget, ancestor-closed
            best = sorted(keep, key=lambda i: -self._score[i])[:budget]
            chosen = set(best)
            for i in best:
                chosen.update(self._anc[i])
            keep = sorted(chosen)
        self._final = keep
        new = {old: j for j, old in enumerate(keep)}
        parents = [new[self._par[i]] if self._par[i] >= 0 else -1 for i in keep]
        probs = None if greedy else torch.stack([self._q[i] for i in keep])
        return DraftTree.of([self._tok[i] for i in keep], parents, probs)
