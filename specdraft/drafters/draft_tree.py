"""Token trees drafted by a draft model: static shapes (branching per depth, or Medusa-style
"choices") and dynamic trees (EAGLE-2's idea: expand the most probable frontier, rerank to a budget).

The draft model scores one tree level per forward: the level's nodes attend to the context and to
their own ancestors through a 4D tree mask, at position (last context position + depth). Its cache
then holds the context plus every node it has fed; after verification ``feedback`` gathers the
context plus the accepted path's fed nodes (``HFModel.keep_positions``), so the next step starts
from a cache equal to one built by decoding the accepted tokens directly.

Sampling: the children of a node are drawn without replacement from the processed draft
distribution q (the same ``probs_from_logits`` as the target), and each node records the
distribution it was actually drawn from (q with its earlier siblings removed, renormalized), which
is what ``verify.rejection_sample_tree`` needs to stay exact. Greedy takes the top ranks.
"""

from __future__ import annotations

import math

import torch

from ..config import SamplingParams, SpecConfig
from ..models.adapter import HFModel
from ..sampling import probs_from_logits, sample
from ..tree import DraftTree
from .draft_model import DraftModelDrafter


def choices_from_branching(branching: list[int]) -> list[tuple[int, ...]]:
    """[3, 2] -> (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), ... (level order)."""
    out, level = [], [()]
    for b in branching:
        level = [p + (r,) for p in level for r in range(b)]
        out.extend(level)
    return out


class DraftTreeDrafter(DraftModelDrafter):
    name = "draft_model"

    def __init__(self, model: HFModel, cfg: SpecConfig, target_vocab: int):
        super().__init__(model, cfg, target_vocab)
        if cfg.tree == "static":
            ch = [tuple(c) for c in cfg.tree_choices] if cfg.tree_choices else choices_from_branching(cfg.tree_branching)
            self.n_children: dict[tuple[int, ...], int] = {}
            for c in ch:
                self.n_children[c[:-1]] = max(self.n_children.get(c[:-1], 0), c[-1] + 1)
            self.max_depth = max(len(c) for c in ch)
        else:
            self.max_depth = cfg.k

    # --- children of one node ----------------------------------------------------------------
    def _children(self, logits: torch.Tensor, m: int) -> list[tuple[int, torch.Tensor | None, float]]:
        """Up to m (token, proposal distribution or None, log draft prob) for one node's children."""
        logits = self._fit(logits)
        if self.sp.greedy:
            lp = torch.log_softmax(logits, -1)
            top = torch.topk(lp, min(m, lp.shape[-1]))
            return [(int(t), None, float(v)) for v, t in zip(top.values, top.indices)]
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

    # --- one level of the tree through the draft model ---------------------------------------
    def _score_level(self, nodes: list[int]) -> torch.Tensor:
        """Feed ``nodes`` (all at one depth) in one forward; logits [len(nodes), V]."""
        past, m = self.model.cached_len, len(nodes)
        allow = torch.zeros(m, past + m, dtype=torch.bool)
        allow[:, : self._ctx] = True
        for j, i in enumerate(nodes):
            for a in self._anc[i][:-1]:
                allow[j, self._fed[a]] = True
            allow[j, past + j] = True
            self._fed[i] = past + j
        dt = self.model.dtype
        mask = torch.zeros(m, past + m, dtype=dt).masked_fill(~allow, torch.finfo(dt).min)[None, None]
        pos = torch.tensor([[self._ctx - 1 + len(self._anc[i]) for i in nodes]])
        ids = torch.tensor([self._tok[i] for i in nodes], dtype=torch.long)
        return self.model.forward(ids, keep=m, attention_mask=mask, position_ids=pos)

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

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        depth = min(self.max_depth, max_tokens)
        self._tok, self._par, self._q, self._score, self._anc, self._rank = [], [], [], [], [], []
        self._fed: dict[int, int] = {}
        self._ctx = len(tokens)
        self._final: list[int] = []
        if depth <= 0:
            return DraftTree.empty()
        feed = torch.tensor(tokens[self.model.cached_len :], dtype=torch.long)
        root = self.model.forward(feed, keep=1)[-1]
        static = self.cfg.tree == "static"
        budget = self.cfg.tree_budget
        greedy = self.sp.greedy
        topk = self.cfg.tree_topk
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
            logits = self._score_level(expand)
            level = []
            for j, i in enumerate(expand):
                m = self.n_children[tuple(self._rank[i])] if static else topk
                if not static and not greedy:  # stop drawing at the budget (decided before drawing)
                    m = min(m, budget - len(self._tok))
                    if m <= 0:
                        break
                level += self._add(i, self._children(logits[j], m))
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
        self._drafted = len(keep)
        return DraftTree(torch.tensor([self._tok[i] for i in keep], dtype=torch.long),
                         torch.tensor(parents, dtype=torch.long), probs)

    def feedback(self, num_accepted: int, emitted: list[int]) -> None:
        # Walk the accepted tokens down the tree (siblings carry distinct tokens), then keep the
        # context and the accepted path's nodes that were fed to the draft model.
        keep = list(range(self._ctx))
        parent = -1
        for t in emitted[:num_accepted]:
            nxt = next(i for i in self._final if self._par[i] == parent and self._tok[i] == t)
            if nxt not in self._fed:
                break
            keep.append(self._fed[nxt])
            parent = nxt
        if self.model.cached_len > len(keep):
            self.model.keep_positions(torch.tensor(keep, dtype=torch.long))
