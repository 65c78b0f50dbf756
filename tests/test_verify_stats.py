"""Statistical exactness of the verifiers against the exact target distribution.

A Markov "language model" over a small vocabulary stands in for the models: the target's next-token
distribution given the previous token is P[prev], the draft's is Q[prev] (both raw logits, then
processed by temperature/top-k/top-p). For each of 300k rows we draft a chain, verify it, complete
the output with plain target samples up to k + 1 tokens, and compare the joint distribution of
those k + 1 tokens with the exact one. The same harness must reject deliberately broken rules.
"""

import itertools

import numpy as np
import pytest
import torch

from specdraft.core import verify
from specdraft.core.config import SamplingParams
from specdraft.core.sampling import probs_from_logits
from specdraft.core.verify import greedy_verify, rejection_sample
from stat_util import emitted_counts, fit_pvalue

V = 6
N = 300_000
S0 = 0

CONFIGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=4, top_p=0.9),
]


def tables(seed):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(V, V, generator=g) * 1.5
    Q = P + torch.randn(V, V, generator=g) * 1.5  # a related but different draft
    return P, Q


def sample_rows(probs, g):
    return torch.multinomial(probs, 1, generator=g).squeeze(1)


def simulate(sp, k, seed=0, bug=None):
    """-> (counts over V^(k+1) sequences, exact probabilities)."""
    P, Q = tables(seed)
    Pp, Qp = probs_from_logits(P, sp), probs_from_logits(Q, sp)
    g = torch.Generator().manual_seed(seed + 1)
    prev = torch.full((N,), S0, dtype=torch.long)
    drafts, qrows = [], []
    deterministic = bug in ("onehot", "onehot_claims_sampled")
    for _ in range(k):
        if deterministic:
            x = Q[prev].argmax(-1)  # a deterministic drafter (like prompt lookup)
        elif bug == "argmax_draft":
            x = Qp[prev].argmax(-1)
        else:
            x = sample_rows(Qp[prev], g)
        qrows.append(torch.softmax(Q[prev], -1) if bug == "draft_unprocessed" else Qp[prev])
        drafts.append(x)
        prev = x
    d = torch.stack(drafts, 1)
    ctx = torch.cat([torch.full((N, 1), S0), d], 1)  # context token before each target row
    Ptab = torch.softmax(P, -1) if bug == "target_unprocessed" else Pp
    tp = Ptab[ctx]  # [N, k+1, V]
    if bug == "bonus_off_by_one":
        tp = torch.cat([tp[:, :k], tp[:, k - 1 : k]], 1)
    q = None if bug == "onehot" else torch.stack(qrows, 1)
    n, nxt = rejection_sample(d, q, tp, g)
    counts = emitted_counts(d, n, nxt, Pp, g)  # emitted = d[:n] + [nxt], completed with target samples
    exact = np.zeros(V ** (k + 1))
    Pn = Pp.double().numpy()
    for c, tup in enumerate(itertools.product(range(V), repeat=k + 1)):
        pr, s = 1.0, S0
        for t in tup:
            pr *= Pn[s, t]
            s = t
        exact[c] = pr
    return counts, exact


@pytest.mark.parametrize("sp", CONFIGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejection_sampling_is_exact(sp, k):
    counts, exact = simulate(sp, k)
    assert fit_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("sp", CONFIGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_one_hot_draft_is_exact(sp):
    counts, exact = simulate(sp, 3, bug="onehot")
    assert fit_pvalue(counts, exact) > 1e-3


BROKEN = [
    ("argmax_draft", CONFIGS[0], 2),  # draft by argmax while the probabilities claim sampling
    ("draft_unprocessed", CONFIGS[1], 2),  # draft samples processed q, reports raw q
    ("target_unprocessed", CONFIGS[2], 2),  # processors applied to the draft side only
    ("bonus_off_by_one", CONFIGS[0], 1),  # bonus token from the wrong target row
    ("onehot_claims_sampled", CONFIGS[0], 2),  # deterministic draft passed with a sampled q
    ("residual_is_p", CONFIGS[3], 2),  # recovered token from p instead of norm(max(0, p - q))
]


@pytest.mark.parametrize("bug,sp,k", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_rules_are_caught(bug, sp, k, monkeypatch):
    if bug == "residual_is_p":
        monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    counts, exact = simulate(sp, k, bug=bug)
    assert fit_pvalue(counts, exact) < 1e-6


def test_greedy_verify_known_answers():
    logits = torch.full((2, 4, 5), -1.0)
    # row 0: argmax 1, 2, 3, 4 -> drafts [1, 2, 0] accept 2, next = argmax at pos 2 = 3
    # row 1: drafts all accepted -> bonus = argmax at pos 3
    for b in range(2):
        for i, t in enumerate([1, 2, 3, 4]):
            logits[b, i, t] = 5.0
    n, nxt = greedy_verify(torch.tensor([[1, 2, 0], [1, 2, 3]]), logits)
    assert n.tolist() == [2, 3] and nxt.tolist() == [3, 4]
    # ragged: row 1 has only 1 real draft token -> accept 1, next is argmax at pos 1
    n, nxt = greedy_verify(torch.tensor([[1, 2, 0], [1, 2, 3]]), logits, num_draft=torch.tensor([3, 1]))
    assert n.tolist() == [2, 1] and nxt.tolist() == [3, 2]
    n, nxt = greedy_verify(torch.zeros(1, 0, dtype=torch.long), logits[:1, :1])
    assert n.tolist() == [0] and nxt.tolist() == [1]


def test_probs_from_logits_truncation():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0  # the top token alone covers 0.64 >= 0.5
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    p = probs_from_logits(logits, SamplingParams(temperature=1e-4, top_p=1e-6))
    assert p[0, 0] == 1.0  # always keeps at least one token
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=7.4e-244))  # 0.0 in float32 (the fuzzer's)
    assert p[0, 0] == 1.0


def _off_by_one(probs, g):
    """A broken inverse CDF: the index before the right one (lands on the wrong token)."""
    from specdraft.core.sampling import sample

    return (sample(probs, g) - 1).clamp_min(0)


@pytest.mark.parametrize("sampler,fits", [("sample", True), ("off_by_one", False)])
def test_sampler_draws_each_row_from_its_distribution(sampler, fits):
    """sampling.sample (inverse CDF over the running sum) on rows with zero-weight tokens (first, middle
    and last), unnormalized weights, and a batch of different rows: chi-square per row; a token of
    weight 0 is never drawn. The broken variant must fail."""
    from specdraft.core.sampling import sample

    rows = torch.tensor(
        [
            [0.0, 0.2, 0.0, 0.5, 0.3, 0.0],
            [3.0, 1.0, 0.0, 0.0, 2.0, 4.0],  # unnormalized
            [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        ]
    )  # one possible token, last
    n = 60_000
    g = torch.Generator().manual_seed(7)
    draw = sample if sampler == "sample" else _off_by_one
    x = draw(rows[:, None, :].expand(3, n, V), g)  # [3, n]
    assert x.shape == (3, n)
    pvals = [fit_pvalue(np.bincount(x[r].numpy(), minlength=V), (rows[r] / rows[r].sum()).numpy()) for r in range(3)]
    assert (min(pvals) > 1e-4) == fits, pvals


def test_argmax_last_is_torchs_argmax():
    """The verifier's argmax (numpy's for float32 CPU tensors, for speed) picks what torch's picks: the
    first maximum, on views with strides, single rows and ties."""
    from specdraft.core.sampling import argmax_last

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (4, 6, 50), generator=g).float()  # many ties
    for t in (x, x[:, :3], x[0, 0], x.transpose(0, 1), torch.randn(2, 151936, generator=g), x.bfloat16()):
        assert torch.equal(argmax_last(t), t.argmax(-1))
