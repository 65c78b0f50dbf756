"""Statistical exactness of tree sampling verification (multi-draft recursive rejection sampling).

The stand-in "language model" is second order and position dependent: the target's next-token
logits are P[j, a, b] for the j-th emitted token after the two tokens a, b (the prompt's for j < 2),
the draft's Q[j, a, b], over a small vocabulary, processed by temperature/top-k/top-p. So the row
the verifier must use after a node depends on the node's depth and its parent's token, not only on
its own token: a verifier that fetches rows by token (or by depth, or from a stale ancestor) is wrong
here, while a first-order Markov stand-in could not tell.

Per sample we draw a whole draft tree of a fixed shape (branching 1-4 per depth, depth 1-5), with
siblings drawn without replacement (each node stores its conditional proposal), i.i.d. (with
replacement), or deterministically (the draft's top ranks, one-hot), verify it with
``rejection_sample_tree``, complete the output with plain target samples to L = depth + 1 tokens
(the most one tree step emits) and compare with the exact distribution: the joint of the first
min(L, 4) tokens as a whole, and for every position j < L (every drafted depth and the bonus token)
the distribution of token j given the two tokens before it, which for the exact output is the
target's row P[j, a, b]. Deliberately broken verifiers must be rejected, among them one that fetches
rows by token and ones that mishandle only depths >= 3 (one of them invisible in the first three
tokens, which is all an earlier version of this test compared).
"""

import numpy as np
import pytest
import torch

from specdraft.core import verify
from specdraft.core.config import SamplingParams
from specdraft.core.sampling import probs_from_logits
from specdraft.core.tree import DraftTree
from specdraft.core.verify import rejection_sample_tree
from stat_util import chi2_pvalue, conditional_fit

V = 5
PROMPT = (3, 1)  # the two context tokens before the first emitted one
POS = 6  # the tables cover 6 emitted positions: trees up to depth 5
JOINT = 4  # the joint of the first JOINT tokens is tested as a whole (V^4 cells)
N = 16_000

T1 = SamplingParams(temperature=1.0)
TK = SamplingParams(temperature=0.7, top_k=3)
TP = SamplingParams(temperature=1.3, top_p=0.8)
TKP = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)


def tables(seed):
    """Raw logits [POS, V (a), V (b), V]: P[j, a, b] for the j-th emitted token after tokens a, b."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(POS, V, V, V, generator=g) * 1.5
    Q = P + torch.randn(POS, V, V, V, generator=g) * 1.0
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


def draw_trees(parents, Qp, Q, kind, g):
    """N draft trees of one shape, drawn together node by node. -> tokens [N, n] (-1: not drawn, no
    mass left), proposals [N, n, V] (what the node was drawn from), the parent's draft distribution
    [N, n, V], and the context id (j * V * V + a * V + b) of the target row after each node [N, n]."""
    n = len(parents)
    tok = torch.full((N, n), -1, dtype=torch.long)
    q = torch.zeros(N, n, V)
    base_q = torch.zeros(N, n, V)
    after = torch.zeros(N, n, dtype=torch.long)
    depth = [0] * n
    sibs: dict[int, list[int]] = {}
    rows = torch.arange(N)
    for i, par in enumerate(parents):
        if par < 0:
            depth[i] = 1
            a, b = torch.full((N,), PROMPT[0]), torch.full((N,), PROMPT[1])
            live = torch.ones(N, dtype=torch.bool)
        else:
            depth[i] = depth[par] + 1
            live = tok[:, par] >= 0
            b = tok[:, par].clamp(min=0)
            a = after[:, par] // V % V  # the parent's own context token b is the token before it
        j = depth[i] - 1
        base = Qp[j, a, b]  # [N, V]
        sib = sibs.setdefault(par, [])
        if kind == "det":
            t = torch.argsort(Q[j, a, b], dim=1, descending=True)[:, len(sib)]
            prop = base
        else:
            prop = base.clone()
            if kind in ("wor", "wor_claims_iid"):
                for s in sib:  # a dead sibling means a dead node: its token 0 stands in harmlessly
                    prop[rows, tok[:, s].clamp(min=0)] = 0.0
                mass = prop.sum(1, keepdim=True)
                live &= mass[:, 0] > 0
                prop = torch.where(mass > 0, prop / mass.clamp(min=1e-30), torch.full_like(prop, 1.0 / V))
            t = torch.multinomial(prop, 1, generator=g).squeeze(1)
            if kind == "wor_claims_iid":
                prop = base
        tok[:, i] = torch.where(live, t, -1)
        q[:, i], base_q[:, i] = prop, base
        after[:, i] = depth[i] * V * V + b * V + t
        sib.append(i)
    return tok, q, base_q, after


def simulate(sp, branching, kind, seed=0, verifier=rejection_sample_tree, bug=None):
    """-> (emitted sequences completed to L tokens [N, L], processed target table [POS, V, V, V],
    the depth each sample's accepted path reached [N])."""
    P, Q = tables(seed)
    Pp, Qp = probs_from_logits(P, sp), probs_from_logits(Q, sp)
    g = torch.Generator().manual_seed(seed + 1)
    parents = shape(branching)
    L = len(branching) + 1
    tok, q, base_q, after = draw_trees(parents, Qp, Q, kind, g)
    Pflat = Pp.reshape(-1, V)
    root = torch.tensor([PROMPT[0] * V + PROMPT[1]])
    seqs = torch.full((N, L), -1, dtype=torch.long)
    reached = torch.zeros(N, dtype=torch.long)
    full_par = torch.tensor(parents, dtype=torch.long)
    tok_l = tok.tolist()
    for s in range(N):
        ts = tok_l[s]
        if -1 in ts:  # some nodes could not be drawn: the subtree of the drawn ones
            keep = [i for i, t in enumerate(ts) if t >= 0]
            new = {old: j for j, old in enumerate(keep)}
            par = torch.tensor([new[parents[i]] if parents[i] >= 0 else -1 for i in keep], dtype=torch.long)
            keep = torch.tensor(keep, dtype=torch.long)
        else:
            keep, par = slice(None), full_par
        tree = DraftTree(tok[s, keep], par, None if kind == "det" else q[s, keep])
        if bug == "det_claims_sampled":
            tree.draft_probs = base_q[s, keep]
        tp = Pflat[torch.cat([root, after[s, keep]])]
        if bug == "rows_off_by_one":  # each node's successor judged by its parent's row
            tp = torch.cat([tp[:1], tp[tree.parents + 1]])
        path, nxt = verifier(tree, tp, g)
        emitted = tree.tokens[path].tolist() + [nxt]
        seqs[s, : len(emitted)] = torch.tensor(emitted)
        reached[s] = len(path)
    for j in range(L):  # complete with plain target samples
        todo = seqs[:, j] < 0
        if todo.any():
            a = seqs[:, j - 2] if j >= 2 else torch.full((N,), PROMPT[j])
            b = seqs[:, j - 1] if j >= 1 else torch.full((N,), PROMPT[1])
            t = torch.multinomial(Pp[j, a.clamp(min=0), b.clamp(min=0)], 1, generator=g).squeeze(1)
            seqs[:, j] = torch.where(todo, t, seqs[:, j])
    return seqs.numpy(), Pp.double().numpy(), reached.numpy()


def context_tokens(seqs, j):
    """The two tokens before position j of each sequence (the prompt's where j < 2)."""
    n = len(seqs)
    a = seqs[:, j - 2] if j >= 2 else np.full(n, PROMPT[j])
    b = seqs[:, j - 1] if j >= 1 else np.full(n, PROMPT[1])
    return a, b


def exact_joint(Pp, d):
    """The target's exact joint distribution of its first d emitted tokens, flattened (first token most
    significant)."""
    joint = Pp[0, PROMPT[0], PROMPT[1]]  # [V]
    for j in range(1, d):
        prev2 = np.arange(V**j) // V % V if j >= 2 else np.full(V, PROMPT[1])
        prev1 = np.arange(V**j) % V
        joint = (joint[:, None] * Pp[j, prev2, prev1]).ravel()
    return joint


def pvalues(seqs, Pp, joint=JOINT):
    """{test name: p-value}: the joint of the first min(L, joint) tokens, and for every position j the
    distribution of token j given the two tokens before it."""
    L = seqs.shape[1]
    d = min(L, joint)
    codes = (seqs[:, :d] * V ** np.arange(d - 1, -1, -1)).sum(1)
    joint = np.bincount(codes, minlength=V**d)[None]
    out = {f"joint{d}": chi2_pvalue(*conditional_fit(joint, exact_joint(Pp, d)[None]))}
    for j in range(L):
        a, b = context_tokens(seqs, j)
        counts = np.zeros((V * V, V))
        np.add.at(counts, (a * V + b, seqs[:, j]), 1)
        out[f"token{j + 1}"] = chi2_pvalue(*conditional_fit(counts, Pp[j].reshape(V * V, V)))
    return out


def combined(ps):
    """Bonferroni: the smallest p-value times the number of tests."""
    return min(1.0, min(ps.values()) * len(ps))


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


@pytest.mark.parametrize(
    "sp,branching,kind",
    CASES,
    ids=[f"T{c[0].temperature}-k{c[0].top_k}-p{c[0].top_p}-b{''.join(map(str, c[1]))}-{c[2]}" for c in CASES],
)
def test_tree_rejection_sampling_is_exact(sp, branching, kind):
    seqs, Pp, reached = simulate(sp, branching, kind)
    D = len(branching)
    # not vacuous: whole paths to the deepest level are accepted often, and rejections happen
    assert (reached == D).mean() > 0.05 and (reached < D).mean() > 0.01, np.bincount(reached)
    ps = pvalues(seqs, Pp)
    assert combined(ps) > 1e-3, ps


# --- deliberately broken verifiers: the same harness must reject each ----------------------------
def by_token(tree, tp, g):
    """Broken: the target row after a node fetched by the node's token (the first node carrying that
    token) instead of by the node, as a cache keyed by token would. Right for a first-order Markov
    target, where rows depend on the token alone."""
    first: dict[int, int] = {}
    rows = [0] + [1 + first.setdefault(t, i) for i, t in enumerate(tree.tokens.tolist())]
    return rejection_sample_tree(tree, tp[rows], g)


def unchecked_from(d):
    """Broken: nodes at depth >= d accepted without the p/q test (q(x) = 0 passes whenever p(x) > 0)."""

    def verifier(tree, tp, g):
        q = tree.draft_probs.clone()
        q[tree.depths() >= d] = 0.0
        return rejection_sample_tree(DraftTree(tree.tokens, tree.parents, q), tp, g)

    return verifier


def stale_rows_from(d):
    """Broken: a node at depth >= d gets the target row of its ancestor at depth d - 1 (the verifier
    looked at the first d - 1 levels only): its children and the bonus after it are judged wrongly, so
    only tokens d + 1 and later are affected."""

    def verifier(tree, tp, g):
        depths, rows = tree.depths().tolist(), [0]
        for i in range(tree.size):
            anc = i
            while depths[anc] > d - 1:
                anc = int(tree.parents[anc])
            rows.append(1 + anc if anc >= 0 else 0)
        return rejection_sample_tree(tree, tp[rows], g)

    return verifier


BROKEN = [  # (name, sampling, branching, kind, table seed)
    ("residual_is_p", T1, [3, 2], "wor", 0),  # after a rejection, the next sibling is judged against p
    ("wor_claims_iid", T1, [4, 1], "wor_claims_iid", 1),  # siblings without replacement, q not renormalized
    ("rows_off_by_one", T1, [2, 2], "wor", 0),  # bonus / children judged by the parent's row
    ("det_claims_sampled", T1, [3, 1], "det", 0),  # deterministic top-k children passed with a sampled q
    ("rows_by_token", T1, [3, 2, 1], "wor", 0),  # target rows fetched by token instead of by node
    ("unchecked_from_depth3", T1, [4, 2, 1, 1, 1], "wor", 0),  # depths >= 3 accepted without the test
    ("stale_rows_from_depth3", TKP, [4, 2, 1, 1, 1], "wor", 0),  # depths >= 3 judged by the depth-2 row
]
VERIFIERS = {
    "rows_by_token": by_token,
    "unchecked_from_depth3": unchecked_from(3),
    "stale_rows_from_depth3": stale_rows_from(3),
}


@pytest.mark.parametrize("bug,sp,branching,kind,seed", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_tree_rules_are_caught(bug, sp, branching, kind, seed, monkeypatch):
    if bug == "residual_is_p":
        monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    seqs, Pp, _ = simulate(sp, branching, kind, seed=seed, verifier=VERIFIERS.get(bug, rejection_sample_tree), bug=bug)
    ps = pvalues(seqs, Pp)
    assert combined(ps) < 1e-6, ps
    if bug == "stale_rows_from_depth3":  # the first three tokens are exact: only the deeper checks see it
        first3 = pvalues(seqs[:, :3], Pp, joint=3)
        assert combined(first3) > 1e-3, first3


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
