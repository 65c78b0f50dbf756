"""The opt-in lossy rule (SpecConfig.lossy = "typical": Medusa's typical acceptance).

It must (1) never run unless asked for, (2) do exactly what it claims: a statistical test against
its own predicted output distribution, which also shows that distribution is not the target's
(that is why it is behind a flag), and (3) be marked in the stats of every result it made.
"""

import itertools

import numpy as np
import pytest
import torch

from conftest import tiny_llama
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ConfigError
from specdraft.core.sampling import probs_from_logits
from specdraft.core.tree import DraftTree
from specdraft.core.verify import TypicalAcceptance, typical_verify, typical_verify_tree
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.engine import Job, generate, generate_batch
from specdraft.models.hf import HFModel
from stat_util import emitted_counts, fit_pvalue

V = 6
N = 200_000
S0 = 0
RULE = TypicalAcceptance(epsilon=0.3, delta=0.6)  # strict enough that both outcomes are frequent here


def test_threshold_and_known_answers():
    flat = torch.tensor([0.3] + [0.05] * 14)  # entropy 2.46, e^-H = 0.0856
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01] + [0.0] * 11)  # entropy 0.17
    rule = TypicalAcceptance(epsilon=0.09, delta=0.3)
    ent = [-(x[x > 0] * x[x > 0].log()).sum() for x in (flat.double(), peaked.double())]
    assert torch.allclose(
        rule.threshold(torch.stack([flat, peaked])), torch.tensor([0.3 * float(torch.exp(-ent[0])), 0.09])
    )
    assert rule.accepts(flat, torch.tensor(1))  # 0.05 > 0.3 e^-H = 0.026 (delta binds)
    assert not TypicalAcceptance(epsilon=0.09, delta=0.8).accepts(flat, torch.tensor(1))  # 0.05 < 0.068
    assert TypicalAcceptance(epsilon=0.04, delta=0.8).accepts(flat, torch.tensor(1))  # 0.05 > 0.04 (epsilon binds)
    # peaked: 0.01 < 0.09 rejected; a token outside top-k/top-p (p = 0) is never accepted
    assert rule.accepts(peaked, torch.tensor(0)) and not rule.accepts(peaked, torch.tensor(2))
    assert not TypicalAcceptance(epsilon=1.0, delta=0.0).accepts(peaked, torch.tensor(5))
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.97, 0.01, 0.01, 0.01]])
    # chain [1, 2] against rows (p0, p1, bonus): 1 accepted under p0, 2 rejected under p1 -> n = 1,
    # the next token is sampled from row 1 (here a point mass on 3)
    tp = torch.stack([p[0], torch.tensor([0.0, 0.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 1.0, 0.0])])
    n, nxt = typical_verify(torch.tensor([[1, 2]]), tp[None], rule, None)
    assert n.tolist() == [1] and nxt.tolist() == [3]
    # ragged: num_draft 0 -> nothing accepted, next token from row 0
    n, _ = typical_verify(torch.tensor([[1, 2]]), tp[None], rule, None, num_draft=torch.tensor([0]))
    assert n.tolist() == [0]


def test_tree_takes_the_deepest_accepted_path():
    # root children: a=1 (accepted), b=0 (accepted); under a: 2 (rejected); under b: 3 (accepted)
    tree = DraftTree(torch.tensor([1, 0, 2, 3]), torch.tensor([-1, -1, 0, 1]))
    rows = torch.tensor(
        [
            [0.4, 0.4, 0.1, 0.1],  # root
            [0.0, 0.0, 0.01, 0.99],  # after node 0 (token 1): 2 is rejected
            [0.0, 0.0, 0.2, 0.8],  # after node 1 (token 0): 3 accepted
            [1.0, 0.0, 0.0, 0.0],  # after node 2
            [0.0, 0.0, 1.0, 0.0],
        ]
    )  # after node 3: the next token is 2
    path, nxt = typical_verify_tree(tree, rows, TypicalAcceptance(), None)
    assert path == [1, 3] and nxt == 2
    # a chain as a tree agrees with the chain verifier
    chain = DraftTree.chain(torch.tensor([1, 3]))
    rows2 = torch.stack([rows[0], rows[2], rows[4]])
    path, nxt = typical_verify_tree(chain, rows2, TypicalAcceptance(), None)
    n, nx = typical_verify(chain.tokens[None], rows2[None], TypicalAcceptance(), None)
    assert len(path) == int(n) == 2 and nxt == int(nx) == 2


def tables(seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(V, V, generator=g) * 1.5
    Q = P + torch.randn(V, V, generator=g) * 1.5
    return P, Q


def predicted(Pp, Qp, acc, k):
    """Exact distribution of the k + 1 tokens the typical rule emits (completed with target samples)
    when a chain of k is drafted from Qp: P(t | s, m) = q(t1|s) acc(s,t1) P(t[1:] | t1, m-1) +
    R(s) p(t1|s) Pchain(t[1:] | t1), R(s) = sum_y q(y|s) (1 - acc(s, y))."""
    R = (Qp * (1 - acc)).sum(-1)

    def chain(seq, s):
        out = 1.0
        for t in seq:
            out *= Pp[s, t]
            s = t
        return out

    def prob(seq, s, m):
        if not seq:
            return 1.0
        t1, rest = seq[0], seq[1:]
        if m == 0:
            return chain(seq, s)
        return Qp[s, t1] * acc[s, t1] * prob(rest, t1, m - 1) + R[s] * Pp[s, t1] * chain(rest, t1)

    return np.array([prob(list(t), S0, k) for t in itertools.product(range(V), repeat=k + 1)])


def simulate(sp, k, seed=0):
    P, Q = tables(seed)
    Pp, Qp = probs_from_logits(P, sp), probs_from_logits(Q, sp)
    g = torch.Generator().manual_seed(seed + 1)
    prev = torch.full((N,), S0, dtype=torch.long)
    drafts = []
    for _ in range(k):
        prev = torch.multinomial(Qp[prev], 1, generator=g).squeeze(1)
        drafts.append(prev)
    d = torch.stack(drafts, 1)
    ctx = torch.cat([torch.full((N, 1), S0), d], 1)
    n, nxt = typical_verify(d, Pp[ctx], RULE, g)
    counts = emitted_counts(d, n, nxt, Pp, g)
    Pn, Qn = Pp.double().numpy(), Qp.double().numpy()
    ent = -(Pn * np.log(np.where(Pn > 0, Pn, 1.0))).sum(-1)  # the rule, written out independently
    acc = (Pn > np.minimum(RULE.epsilon, RULE.delta * np.exp(-ent))[:, None]).astype(np.float64)
    impl = RULE.accepts(Pp[:, None, :].expand(V, V, V), torch.arange(V)[None, :].expand(V, V)).numpy()
    assert (impl == (acc > 0)).all()  # the implementation accepts exactly what the written-out rule does
    exact = predicted(Pn, Pn, np.zeros((V, V)), k)  # the target's own distribution
    return counts, predicted(Pn, Qn, acc, k), exact, acc


CONFIGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("sp", CONFIGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
@pytest.mark.parametrize("k", [1, 2])
def test_typical_acceptance_follows_its_rule_and_is_lossy(sp, k):
    counts, rule_dist, target_dist, acc = simulate(sp, k)
    assert 0 < acc.mean() < 1  # the rule both accepts and rejects here
    assert abs(rule_dist.sum() - 1) < 1e-6  # float32 tables
    assert fit_pvalue(counts, rule_dist) > 1e-3  # does what it says
    assert fit_pvalue(counts, target_dist) < 1e-6  # and that is not the target's distribution


# --- through the engines ----------------------------------------------------------------------
VT = 16


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=VT, layers=2), tiny_llama(vocab=VT, noise_seed=5, noise=0.25)


def drafter(draft):
    return DraftModelDrafter(HFModel(draft.model, None, name="d"), SpecConfig(method="draft_model", k=3).validate(), VT)


def rule(lossy):
    return SpecConfig(lossy=lossy).lossy_rule() if lossy else None


def test_engines_use_the_rule_only_when_asked(pair):
    target, draft = pair
    t = HFModel(target.model, None)
    prompt = [1, 2, 3, 1, 2]
    greedy = SamplingParams(max_new_tokens=16)
    plain = generate(t, drafter(draft), prompt, greedy, eos_ids=set())
    typ = generate(t, drafter(draft), prompt, greedy, eos_ids=set(), lossy=rule("typical"))
    assert typ.token_ids == plain.token_ids and "lossy" not in typ.stats.to_dict()  # greedy: no effect
    sp = SamplingParams(temperature=1.0, seed=7, max_new_tokens=24)
    exact = generate(t, drafter(draft), prompt, sp, eos_ids=set())
    lossy = generate(t, drafter(draft), prompt, sp, eos_ids=set(), lossy=rule("typical"))
    assert "lossy" not in exact.stats.to_dict()
    assert lossy.stats.to_dict()["lossy"] == "typical" and lossy.stats.lossy == "typical"
    # the batch engine applies the same rule: a seeded row equals its batch-size-1 run
    b = generate_batch(
        target,
        [
            Job(prompt, sp, drafter(draft), lossy=rule("typical")),
            Job([5, 6], SamplingParams(max_new_tokens=4), drafter(draft)),
        ],
        eos_ids=set(),
    )
    assert b[0].token_ids == lossy.token_ids and b[0].stats.lossy == "typical" and b[1].stats.lossy is None


def test_rule_is_the_one_that_runs(pair, monkeypatch):
    """A lossy drafter's sampling steps go through typical_verify, a default drafter's never do."""
    import specdraft.core.verify as ver  # the engines reach it through verify.sample_verify / verify_tree

    calls = []
    real = ver.typical_verify
    monkeypatch.setattr(ver, "typical_verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    target, draft = pair
    t = HFModel(target.model, None)
    sp = SamplingParams(temperature=0.8, seed=1, max_new_tokens=10)
    generate(t, drafter(draft), [1, 2, 3], sp, eos_ids=set())
    assert not calls
    generate(t, drafter(draft), [1, 2, 3], sp, eos_ids=set(), lossy=rule("typical"))
    assert calls


def test_config_errors():
    with pytest.raises(ConfigError, match="unknown lossy rule 'nucleus'; choose one of: typical"):
        SpecConfig(lossy="nucleus").validate()
    with pytest.raises(ConfigError, match=r"typical_epsilon must be in \(0, 1\]"):
        SpecConfig(lossy="typical", typical_epsilon=0).validate()
    with pytest.raises(ConfigError, match="typical_delta must be a finite number >= 0"):
        SpecConfig(lossy="typical", typical_delta=-1).validate()
    assert SpecConfig().lossy_rule() is None
    assert SpecConfig.from_dict(
        {"method": "prompt_lookup", "lossy": "typical", "typical_epsilon": 0.2}
    ).lossy_rule() == TypicalAcceptance(0.2, 0.3)


def test_cli_flag(capsys):
    from specdraft.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--lossy", "bogus", "hi"])
    assert e.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err


def test_lossy_results_are_marked_in_report_and_server_usage():
    from specdraft.bench.report import label
    from specdraft.core.metrics import GenerationStats
    from specdraft.server.protocol import usage

    doc = {
        "settings": {
            "methods": {"medusa": {"method": "medusa"}, "medusa_typ": {"method": "medusa", "lossy": "typical"}},
            "sampling": {"temperature": 0.7},
        }
    }
    assert label(doc, "medusa") == "medusa" and label(doc, "medusa_typ") == "medusa_typ (LOSSY: typical)"
    doc["settings"]["sampling"]["temperature"] = 0.0  # greedy: the rule does not act
    assert label(doc, "medusa_typ") == "medusa_typ"
    assert "lossy" not in usage(GenerationStats(), "medusa")
    assert usage(GenerationStats(lossy="typical"), "medusa")["lossy"] == "typical"
