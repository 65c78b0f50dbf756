"""Statistical exactness of tree sampling verification (multi-draft recursive rejection sampling).

The same Markov stand-in as test_verify_stats.py: target next-token logits P[prev], draft Q[prev]
over a small vocabulary, processed by temperature/top-k/top-p. Per sample we draw a whole draft
tree of a fixed shape (branching 1-4 per depth, depth 1-5), with siblings drawn without
replacement (each node stores its conditional proposal), i.i.d. (with replacement), or
deterministically (the draft's top ranks, one-hot), verify it with ``rejection_sample_tree``,
complete the output with plain target samples to L tokens and compare the joint distribution of
those L tokens with the exact one. Deliberately broken variants must be rejected.
"""

import itertools

import numpy as np
import pytest
import torch

from specdraft import verify
from specdraft.config import SamplingParams
from specdraft.sampling import probs_from_logits
from specdraft.tree import DraftTree
from specdraft.verify import rejection_sample_tree
from stat_util import fit_pvalue

V = 5
S0 = 0
L = 3
N = 12_000

T1 = SamplingParams(temperature=1.0)
TK = SamplingParams(temperature=0.7, top_k=3)
TP = SamplingParams(temperature=1.3, top_p=0.8)
TKP = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)


def tables(seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(V, V, generator=g) * 1.5
    Q = P + torch.randn(V, V, generator=g) * 1.5
    return P, Q


def shape(branching):
    """Parents (level order) of the full tree with branching[d] children per node at depth d."""
    parents, level = [], [-1]
    for b in branching:
        nxt = []
        for par in level:
            for _ in range(b):
                parents.append(par)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def draw_tree(parents, Qp, Qraw, kind, g):
    """One draft tree: tokens (-1 = could not be drawn: no mass left), per-node proposals."""
    n = len(parents)
    tok = [-1] * n
    q = [None] * n
    drawn_children: dict[int, list[int]] = {}
    for i, par in enumerate(parents):
        if par >= 0 and tok[par] < 0:
            continue
        ctx = S0 if par < 0 else tok[par]
        sib = drawn_children.setdefault(par, [])
        if kind == "det":
            order = torch.argsort(Qraw[ctx], descending=True).tolist()
            tok[i] = order[len(sib)]
        else:
            base = Qp[ctx].clone()
            if kind in ("wor", "wor_claims_iid"):
                for s in sib:
                    base[tok[s]] = 0.0
                if base.sum() <= 0:
                    continue
                base = base / base.sum()
            tok[i] = int(torch.multinomial(base, 1, generator=g))
            q[i] = Qp[ctx] if kind == "wor_claims_iid" else base
        sib.append(i)
    return tok, q


def subtree(parents, tok, q, with_probs):
    keep = [i for i in range(len(parents)) if tok[i] >= 0]
    new = {old: j for j, old in enumerate(keep)}
    par = [new[parents[i]] if parents[i] >= 0 else -1 for i in keep]
    probs = torch.stack([q[i] for i in keep]) if with_probs and keep else None
    return DraftTree(torch.tensor([tok[i] for i in keep], dtype=torch.long), torch.tensor(par, dtype=torch.long), probs)


def simulate(sp, branching, kind, seed=0, bug=None):
    P, Q = tables(seed)
    Pp, Qp = probs_from_logits(P, sp), probs_from_logits(Q, sp)
    g = torch.Generator().manual_seed(seed + 1)
    parents = shape(branching)
    codes = np.zeros(N, dtype=np.int64)
    for s in range(N):
        tok, q = draw_tree(parents, Qp, Q, kind, g)
        tree = subtree(parents, tok, q, with_probs=kind != "det")
        if bug == "det_claims_sampled":
            ctx_tok = [S0] + tree.tokens.tolist()
            tree.draft_probs = torch.stack([Qp[ctx_tok[p + 1]] for p in tree.parents.tolist()])
        ctx = torch.cat([torch.tensor([S0]), tree.tokens])
        tp = Pp[ctx]
        if bug == "rows_off_by_one":  # each node's successor judged by its parent's row
            tp = torch.cat([tp[:1], tp[tree.parents + 1]])
        path, nxt = rejection_sample_tree(tree, tp, g)
        seq = tree.tokens[path].tolist() + [nxt]
        while len(seq) < L:
            seq.append(int(torch.multinomial(Pp[seq[-1]], 1, generator=g)))
        c = 0
        for t in seq[:L]:
            c = c * V + t
        codes[s] = c
    counts = np.bincount(codes, minlength=V**L)
    Pn = Pp.double().numpy()
    exact = np.zeros(V**L)
    for c, tup in enumerate(itertools.product(range(V), repeat=L)):
        pr, prev = 1.0, S0
        for t in tup:
            pr *= Pn[prev, t]
            prev = t
        exact[c] = pr
    return counts, exact


CASES = [  # (sampling, branching per depth, sibling proposal kind)
    (T1, [4], "wor"),
    (TK, [3, 2], "wor"),
    (TP, [2, 2, 2], "wor"),
    (TKP, [4, 2, 1, 1, 1], "wor"),
    (T1, [1, 1, 1, 1, 1], "wor"),
    (T1, [3, 2], "iid"),
    (TKP, [2, 2, 1], "iid"),
    (T1, [4, 1, 1], "det"),
    (TK, [2, 2, 2, 1], "det"),
    (TP, [3, 1], "det"),
]


@pytest.mark.parametrize("sp,branching,kind", CASES,
                         ids=[f"T{c[0].temperature}-k{c[0].top_k}-p{c[0].top_p}-b{''.join(map(str, c[1]))}-{c[2]}" for c in CASES])
def test_tree_rejection_sampling_is_exact(sp, branching, kind):
    counts, exact = simulate(sp, branching, kind)
    assert fit_pvalue(counts, exact) > 1e-3


BROKEN = [  # each with a table seed where the bug's effect on the first token is large (TV >= 0.1)
    ("residual_is_p", T1, [3, 2], "wor"),  # after a rejection, the next sibling is judged against p
    ("wor_claims_iid", T1, [4, 1], "wor_claims_iid"),  # siblings without replacement, q not renormalized
    ("rows_off_by_one", T1, [2, 2], "wor"),  # bonus / children judged by the parent's row
    ("det_claims_sampled", T1, [3, 1], "det"),  # deterministic top-k children passed with a sampled q
]


@pytest.mark.parametrize("bug,sp,branching,kind", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_tree_rules_are_caught(bug, sp, branching, kind, monkeypatch):
    if bug == "residual_is_p":
        monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    counts, exact = simulate(sp, branching, kind, seed=1 if bug == "wor_claims_iid" else 0, bug=bug)
    assert fit_pvalue(counts, exact) < 1e-6


def test_tree_sampling_known_answers():
    # p puts all mass on token 2; a one-hot child 1 is always rejected, child 2 always accepted
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 1]))
    tp = torch.zeros(4, 5)
    tp[0, 2] = 1.0
    tp[2, 3] = 1.0  # after node 1 (token 2): token 3 for sure -> node 2 accepted
    tp[3, 4] = 1.0  # bonus after node 2
    g = torch.Generator().manual_seed(0)
    assert rejection_sample_tree(tree, tp, g) == ([1, 2], 4)
    empty = DraftTree.empty()
    assert rejection_sample_tree(empty, tp[:1], g) == ([], 2)
