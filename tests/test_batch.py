"""The batch engine: every greedy row emits exactly its batch-size-1 output; ragged acceptance;
rows join and leave between steps; the KV cache is compacted without changing anything."""

import pytest
import torch

from conftest import logits_of, tiny_llama
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.policy import BatchRule
from specdraft.core.tree import feed_mask
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine, Job, generate, generate_batch
from specdraft.models.hf import HFModel

V = 16
PROMPTS = [
    [1, 2, 3, 1, 2],
    [5],
    [7, 7, 7, 7, 7, 7, 7, 3, 4],
    [2, 9, 4, 2, 9],
    [11, 12, 13, 14, 15, 11, 12, 13],
    [3, 3],
    [8, 1, 8, 1, 8, 1, 8],
    [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
]


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V, layers=2), tiny_llama(vocab=V, noise_seed=5, noise=0.25)


def make(method, draft, k=3):
    if method == "plain":
        return NoDrafter()
    if method == "prompt_lookup":
        return PromptLookupDrafter(SpecConfig(method="prompt_lookup", k=k, max_ngram=2).validate())
    return DraftModelDrafter(HFModel(draft.model, None, name="d"), SpecConfig(method="draft_model", k=k).validate(), V)


def single(target, draft, method, prompt, n):
    t = HFModel(target.model, None, name="t")
    return generate(t, make(method, draft), prompt, SamplingParams(max_new_tokens=n), eos_ids=set()).token_ids


METHODS = ["plain", "prompt_lookup", "draft_model"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_rows_equal_batch1(pair, method):
    target, draft = pair
    lens = [12, 20, 7, 16, 25, 3, 18, 10]
    jobs = [Job(p, SamplingParams(max_new_tokens=n), make(method, draft)) for p, n in zip(PROMPTS, lens)]
    out = generate_batch(target, jobs, eos_ids=set())
    for (p, n), r in zip(zip(PROMPTS, lens), out):
        assert r.token_ids == single(target, draft, method, p, n)
        assert r.stats.new_tokens == n and r.stats.finish_reason == "length"


def record_steps(monkeypatch):
    """Patch Engine.step to log, per engine step, the StepRecord of every row that took part."""
    log = []
    real = Engine.step

    def step(self):
        rows = list(self.rows)
        before = [len(r.stats.steps) for r in rows]
        done = real(self)
        log.append([r.stats.steps[-1] for r, n in zip(rows, before) if len(r.stats.steps) == n + 1])
        return done

    monkeypatch.setattr(Engine, "step", step)
    return log


def assert_ragged(log):
    """Within one step, rows that drafted had different draft sizes, and rows that drafted accepted
    different numbers: one accepted its whole draft while another's was cut short by a rejection."""
    drafting = [[s for s in recs if s.drafted > 0] for recs in log]
    assert any(len({s.drafted for s in recs}) > 1 for recs in drafting), log
    assert any(len({s.accepted for s in recs}) > 1 for recs in drafting), log
    assert any(
        any(s.accepted == s.drafted for s in recs) and any(s.accepted < s.drafted for s in recs) for recs in drafting
    ), log


def test_mixed_methods_join_leave_and_compaction(pair, monkeypatch):
    target, draft = pair
    jobs, refs = [], []
    for i in range(16):
        m, p, n = METHODS[i % 3], PROMPTS[i % len(PROMPTS)], 5 + (7 * i) % 17
        jobs.append(Job(p, SamplingParams(max_new_tokens=n), make(m, draft, k=1 + i % 4)))
        refs.append(single(target, draft, m, p, n))
    log = record_steps(monkeypatch)  # the batch's steps only (the references above run the loop too)
    out = generate_batch(target, jobs, eos_ids=set(), max_batch=5, join_every=2)
    assert [r.token_ids for r in out] == refs
    # every row's steps were logged, and rows were ragged within a step (draft sizes and acceptances)
    assert sum(len(recs) for recs in log) == sum(len(r.stats.steps) for r in out)
    assert_ragged(log)


def test_engine_step_ragged_and_cancel(pair, monkeypatch):
    target, draft = pair
    log = record_steps(monkeypatch)
    eng = Engine(target, eos_ids=set(), compact_slack=1)
    rows = [
        eng.add(p, SamplingParams(max_new_tokens=30), make(m, draft, k=4)) for p, m in zip(PROMPTS[:6], METHODS * 2)
    ]
    for _ in range(4):
        eng.step()
        assert [len(recs) for recs in log] == [6] * len(log)
        assert eng.kv.holes() <= sum(eng.kv.L - n for n in eng.kv.lens)
    eng.cancel(rows[1])
    assert rows[1].result.stats.finish_reason == "cancelled" and eng.num_rows == 5
    while eng.rows:
        eng.step()
    assert eng.cache_len == 0 and eng.kv.B == 0
    g = eng.groups[("draft_model", id(draft.model))]
    assert g.members == [] and g.kv.B == 0 and g.kv.L == 0  # draft rows left with their rows
    assert_ragged(log)  # rows drafted and accepted ragged amounts within one step
    for r, p, m in zip(rows, PROMPTS[:6], METHODS * 2):
        if r is not rows[1]:
            assert r.result.token_ids == single(target, draft, m, p, 30)


def test_policy_shrinks_speculation_with_batch_size(pair):
    target, draft = pair
    pol = BatchRule(shrink_at=3, off_at=5)
    assert [pol.cap(b, 4) for b in (1, 2, 3, 4, 5, 9)] == [4, 4, 2, 2, 0, 0]
    jobs = [Job(p, SamplingParams(max_new_tokens=8), make("prompt_lookup", draft, k=4)) for p in PROMPTS[:6]]
    out = generate_batch(target, jobs, eos_ids=set(), rule=pol)
    assert all(r.stats.drafted == 0 for r in out)  # 6 rows >= off_at: plain steps
    assert [r.token_ids for r in out] == [single(target, draft, "plain", p, 8) for p in PROMPTS[:6]]


def test_sampling_rows_reproducible_by_seed(pair):
    target, draft = pair
    sp = SamplingParams(temperature=0.9, seed=3, max_new_tokens=12)
    a = generate_batch(
        target,
        [
            Job(PROMPTS[0], sp, make("draft_model", draft)),
            Job(PROMPTS[1], SamplingParams(max_new_tokens=5), NoDrafter()),
        ],
        eos_ids=set(),
    )
    b = generate(HFModel(target.model, None), make("draft_model", draft), PROMPTS[0], sp, eos_ids=set())
    assert a[0].token_ids == b.token_ids and len(a[0].token_ids) == 12  # the seed's batch-1 sample


def test_seeded_rows_share_the_forward_when_not_isolated(pair):
    """``isolate_seeded=False`` batches seeded sampling rows with the others (one lane), and their stats
    no longer claim the seed pins their tokens whatever else runs."""
    target, _ = pair
    sp = SamplingParams(temperature=0.9, seed=3, max_new_tokens=4)
    for isolate, lanes in [(True, 3), (False, 1)]:
        eng = Engine(target, eos_ids=set(), isolate_seeded=isolate)
        rows = [eng.add(p, sp, NoDrafter()) for p in PROMPTS[:3]]
        assert len(eng.kv.lanes()) == lanes
        while eng.rows:
            eng.step()
        assert [r.stats.reproducible for r in rows] == [isolate] * 3


def test_batchkv_empty_prefix_rows(pair):
    target, _ = pair
    kv = target.new_rows()
    kv.add_row([])
    kv.add_row([1, 2, 3])
    kv.add_row([])
    assert kv.lens == [0, 3, 0] and kv.L == 3
    logits = kv.forward([[4], [5, 6], []])
    assert logits.shape[:2] == (3, 2) and torch.isfinite(logits[:, 0]).all()
    kv.commit([1, 2, 0])
    assert kv.lens == [1, 5, 0]
    kv.remove_rows([0, 1, 2])
    assert kv.B == 0 and kv.L == 0


SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "1, 2, 3, 4, 5, 6, 7,",
    "Once upon a time",
    "import numpy as np\nimport pandas as pd\nimport",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Water boils at",
    "Hello",
]
SMOL_LENS = [24, 16, 30, 12, 20, 28, 8, 18]


@pytest.fixture(scope="module")
def smol_plain(smol_f32):
    """{prompt: its first 30 greedy tokens}: plain decoding, one sequence at a time, of SMOL_TEXTS: what
    every batched row must emit (greedy speculation is token-identical to it; test_greedy_real)."""
    tok = smol_f32.tokenizer
    prompts = [tuple(tok(t, add_special_tokens=False)["input_ids"]) for t in SMOL_TEXTS]
    t = HFModel(smol_f32.model, tok)
    return {
        p: generate(t, NoDrafter(), list(p), SamplingParams(max_new_tokens=30), eos_ids=set()).token_ids
        for p in prompts
    }


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_smollm2_greedy_rows_equal_batch1(smol_f32, smol_draft4, smol_plain, method):
    """fp32 SmolLM2-135M: 8 rows (ragged prompts and lengths, staggered joins) == plain decoding of each
    prompt alone."""
    tok = smol_f32.tokenizer
    draft = smol_draft4 if method == "draft_model" else None
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in SMOL_TEXTS]

    def mk():
        if draft is not None:
            return DraftModelDrafter(
                HFModel(draft.model, tok, name="d"),
                SpecConfig(method="draft_model", k=4).validate(),
                smol_f32.vocab_size,
            )
        return make(method, None, k=4)

    refs = [smol_plain[tuple(p)][:n] for p, n in zip(prompts, SMOL_LENS)]
    jobs = [Job(p, SamplingParams(max_new_tokens=n), mk()) for p, n in zip(prompts, SMOL_LENS)]
    out = generate_batch(smol_f32, jobs, eos_ids=set(), max_batch=6, join_every=3)
    assert [r.token_ids for r in out] == refs
    if method != "plain":
        assert sum(r.stats.accepted for r in out) > 0


# --- every drafter batches: trees, self-speculation, model-free ----------------------------------
from specdraft.api import SpecDecoder  # noqa: E402


class BatchDrafters:
    """A decoder's drafters and draft lengths for batch jobs."""

    def __init__(self, dec):
        self.dec = dec

    def job(self, prompt, sp, spec):
        spec = SpecConfig.from_dict(spec)
        return Job(prompt, sp, self.dec.make_drafter(spec), length=self.dec.draft_length(spec))


ALL_SPECS = {
    "plain": {"method": "plain"},
    "prompt_lookup": {"method": "prompt_lookup", "k": 3, "max_ngram": 2},
    "prompt_lookup_tree": {"method": "prompt_lookup", "k": 3, "min_ngram": 1, "max_ngram": 2, "branches": 3},
    "draft_model": {"method": "draft_model", "k": 3},
    "draft_static": {"method": "draft_model", "tree": "static", "tree_branching": [2, 2, 1]},
    "draft_dynamic": {"method": "draft_model", "tree": "dynamic", "k": 3, "tree_topk": 2, "tree_budget": 6},
    "suffix": {"method": "suffix", "k": 4, "min_token_prob": 0.0},
    "token_recycling": {"method": "token_recycling", "recycle_branching": [3, 2, 1]},
    "lookahead": {"method": "lookahead", "lookahead_window": 3, "lookahead_ngram": 3, "lookahead_max_ngrams": 3},
    "early_exit": {"method": "early_exit", "exit_layer": 1, "k": 3},
    "early_exit_tree": {"method": "early_exit", "exit_layer": 2, "tree": "static", "tree_branching": [2, 1, 1]},
    "layer_skip": {"method": "layer_skip", "skip_layers": [1, 2], "k": 3, "schedule": "heuristic"},
    "layer_skip_tree": {"method": "layer_skip", "skip_layers": [2], "tree": "dynamic", "k": 3, "tree_budget": 5},
}
TREE_SPECS = {
    "prompt_lookup_tree",
    "draft_static",
    "draft_dynamic",
    "suffix",
    "token_recycling",
    "lookahead",
    "early_exit_tree",
    "layer_skip_tree",
}


@pytest.fixture(scope="module")
def quad():
    """A 4-layer target (so layer views have layers to skip) and a related 2-layer draft."""
    return tiny_llama(vocab=V, layers=4, seed=1), tiny_llama(vocab=V, layers=2, seed=1, noise_seed=5, noise=0.25)


def reference(target, draft, spec, prompt, sp):
    """The single-sequence engine on fresh wrappers (own caches) of the same weights."""
    dec = SpecDecoder(HFModel(target.model, None, name="t"), HFModel(draft.model, None, name="d"))
    spec = SpecConfig.from_dict(spec)
    return generate(dec.target, dec.make_drafter(spec), prompt, sp, eos_ids=set(), length=dec.draft_length(spec))


@pytest.mark.parametrize("name", list(ALL_SPECS))
def test_every_drafter_greedy_rows_equal_batch1(quad, name):
    """Rows of each method (plus a plain row) join at different steps; every row == batch size 1."""
    target, draft = quad
    fac = BatchDrafters(SpecDecoder(target, draft))
    lens = [14, 20, 9, 17, 12]
    prompts = PROMPTS[:4] + [PROMPTS[6]]
    jobs = [fac.job(p, SamplingParams(max_new_tokens=n), ALL_SPECS[name]) for p, n in zip(prompts, lens)]
    jobs.append(fac.job(PROMPTS[4], SamplingParams(max_new_tokens=11), {"method": "plain"}))
    out = generate_batch(target, jobs, eos_ids=set(), max_batch=4, join_every=2)
    for job, r in zip(jobs[:-1], out):
        assert r.token_ids == reference(target, draft, ALL_SPECS[name], job.prompt_ids, job.sampling).token_ids
    assert out[-1].token_ids == reference(target, draft, {"method": "plain"}, PROMPTS[4], jobs[-1].sampling).token_ids
    if name != "plain":
        assert sum(r.stats.drafted for r in out[:-1]) > 0
    if name in TREE_SPECS:  # token trees really went through the batched tree path
        assert any(s.depth is not None for r in out[:-1] for s in r.stats.steps)


def test_all_methods_in_one_batch_with_sampling_rows(quad):
    """Every method at once in one batch, greedy and seeded sampling rows mixed: every row equals its
    batch-size-1 output (a seeded sampling row draws the same samples: its generator serves its own
    drafting and verification in the same order as at batch size 1)."""
    target, draft = quad
    fac = BatchDrafters(SpecDecoder(target, draft))
    jobs, refs = [], []
    for i, name in enumerate(ALL_SPECS):
        p, n = PROMPTS[i % len(PROMPTS)], 6 + (5 * i) % 13
        sp = (
            SamplingParams(max_new_tokens=n)
            if i % 3
            else SamplingParams(temperature=0.8, top_k=8, seed=i, max_new_tokens=n)
        )
        jobs.append(fac.job(p, sp, ALL_SPECS[name]))
        refs.append(reference(target, draft, ALL_SPECS[name], p, sp).token_ids)
    out = generate_batch(target, jobs, eos_ids=set(), max_batch=6, join_every=1)
    for job, ref, r in zip(jobs, refs, out):
        n = job.sampling.max_new_tokens
        assert len(r.token_ids) == n and all(0 <= t < V for t in r.token_ids)
        assert r.token_ids == ref
        assert r.stats.accepted <= r.stats.drafted and r.stats.new_tokens == n


def test_draft_trees_batch_across_rows(pair):
    """Model-drafted token trees of several rows are drafted together, tree and chain rows of one draft
    model in one group: each step the draft model runs one catch-up forward plus one forward per tree
    level, whatever the number of tree rows, each feeding every tree row; every row's greedy output
    equals its batch-size-1 output."""
    from specdraft.drafters.draft_tree import DraftTreeDrafter

    target, draft = pair
    static = SpecConfig(method="draft_model", tree="static", tree_branching=[2, 2, 1]).validate()
    dynamic = SpecConfig(method="draft_model", tree="dynamic", k=3, tree_topk=2, tree_budget=6).validate()
    specs = [static, dynamic, static, SpecConfig(method="draft_model", k=3).validate()]
    mk = lambda s: DraftTreeDrafter(draft, s, V) if s.tree != "chain" else DraftModelDrafter(draft, s, V)  # noqa: E731
    sp = SamplingParams(max_new_tokens=12)
    eng = Engine(target, eos_ids=set())
    rows = [eng.add(p, sp, mk(s)) for p, s in zip(PROMPTS[:4], specs)]
    (group,) = eng.groups.values()
    fed, real = [], group.kv.forward
    group.kv.forward = lambda seqs, *a, **k: fed.append([len(q) for q in seqs]) or real(seqs, *a, **k)
    eng.step()
    trees = [f for f in fed if f[3] == 0]  # the roots, then depth 1 and depth 2: every tree row in each
    assert len(trees) == 3 and all(min(f[:3]) > 0 for f in trees), fed
    assert all(f[:3] == [0, 0, 0] for f in fed if f[3] > 0), fed  # the chain row's forwards
    assert all(r.stats.steps[0].depth is not None for r in rows[:3])
    while eng.rows:
        eng.step()
    for r, s, p in zip(rows, specs, PROMPTS):
        assert r.result.token_ids == generate(target, mk(s), p, sp, eos_ids=set()).token_ids, s
    assert all(r.stats.accepted > 0 for r in rows[:3])


def test_batchkv_tree_feed_keeps_only_the_path(pair):
    """A tree fed through the rows and committed to its accepted path leaves a cache whose next
    logits equal a plain forward of prefix + path."""
    from specdraft.core.tree import DraftTree

    target, _ = pair
    kv = target.new_rows()
    kv.add_rows([[1, 2, 3], [4, 5]])
    tree = DraftTree(torch.tensor([6, 7, 8, 9]), torch.tensor([-1, -1, 1, 2]))  # path 7 -> 8 -> 9
    kv.forward([[4] + tree.tokens.tolist(), [6]], trees=[feed_mask(tree), None])
    kv.commit([[0, 2, 3, 4], 1])
    assert kv.lens == [7, 3]
    got = kv.forward([[10], [11]])[:, 0]
    ref = HFModel(target.model)
    for r, seq in enumerate([[1, 2, 3, 4, 7, 8, 9, 10], [4, 5, 6, 11]]):
        assert torch.allclose(got[r], logits_of(ref, seq)[-1], atol=1e-4)


# sampling: tree rows in a batch still sample the target's exact distribution (first two tokens)
V6, P6, NS, NS_MODEL = 6, [1, 2, 3, 1, 2], 2000, 1200  # model trees draft per row: fewer samples
T1 = SamplingParams(temperature=1.0)
TRUNC = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
SAMPLING_CASES = [
    ("draft_static", 4, T1),
    ("draft_dynamic", 5, TRUNC),
    ("prompt_lookup_tree", 4, TRUNC),
    pytest.param("early_exit_tree", 4, T1, marks=pytest.mark.slow),
]


def _exact_first_two(target, sp):
    import numpy as np

    from specdraft.core.sampling import probs_from_logits

    p1 = probs_from_logits(logits_of(target, P6)[-1], sp).double()
    joint = np.zeros((V6, V6))
    for a in range(V6):
        p2 = probs_from_logits(logits_of(target, P6 + [a])[-1], sp).double()
        joint[a] = (p1[a] * p2).numpy()
    return joint


@pytest.mark.parametrize(
    "name,max_new,sp",
    SAMPLING_CASES,
    ids=["draft_static-T1", "draft_dynamic-T0.8", "prompt_lookup_tree-T0.8", "early_exit_tree-T1"],
)
def test_tree_rows_in_a_batch_sample_the_target_distribution(name, max_new, sp):
    import numpy as np

    from stat_util import fit_pvalue

    target = tiny_llama(vocab=V6, layers=3)
    draft = tiny_llama(vocab=V6, noise_seed=5, noise=0.25)
    fac = BatchDrafters(SpecDecoder(target, draft))
    spec = {**ALL_SPECS[name], "exit_layer": 1} if name == "early_exit_tree" else ALL_SPECS[name]
    jobs = [
        fac.job(P6, SamplingParams(**{**sp.to_dict(), "seed": 10_000 + i, "max_new_tokens": max_new}), spec)
        for i in range(NS if name == "prompt_lookup_tree" else NS_MODEL)
    ]
    # rows leave raggedly, others join; the seeds only pin the samples: the rows share forwards
    out = generate_batch(target, jobs, eos_ids=set(), max_batch=64, isolate_seeded=False)
    counts = np.zeros((V6, V6))
    for r in out:
        a, b = r.token_ids[:2]
        counts[a, b] += 1
    assert sum(r.stats.accepted for r in out) > 0
    assert fit_pvalue(counts, _exact_first_two(HFModel(target.model), sp)) > 1e-3


SMOL_SPECS = {
    "plain": {"method": "plain"},
    "prompt_lookup": {"method": "prompt_lookup", "k": 4},
    "prompt_lookup_tree": {"method": "prompt_lookup", "k": 4, "branches": 3},
    "draft_model": {"method": "draft_model", "k": 3},
    "draft_static": {"method": "draft_model", "tree": "static", "tree_branching": [2, 2, 1]},
    "draft_dynamic": {"method": "draft_model", "tree": "dynamic", "k": 3},
    "suffix": {"method": "suffix"},
    "token_recycling": {"method": "token_recycling"},
    "lookahead": {"method": "lookahead"},
    "early_exit": {"method": "early_exit", "exit_layer": 8, "k": 3},
    "early_exit_tree": {"method": "early_exit", "exit_layer": 8, "tree": "static"},
    "layer_skip": {"method": "layer_skip", "skip_layers": list(range(4, 28, 2)), "k": 3},
    "layer_skip_tree": {"method": "layer_skip", "skip_layers": list(range(4, 28, 2)), "tree": "dynamic", "k": 3},
}


@pytest.mark.slow
def test_smollm2_every_drafter_rows_equal_batch1(smol_f32, smol_draft4, smol_plain):
    """fp32 SmolLM2-135M, every drafter in one batch: one row per method (plus a plain row), at most
    6 rows at a time, rows joining at different steps, 16 new tokens each; every row's greedy output
    == plain decoding of its prompt alone."""
    tok = smol_f32.tokenizer
    texts = [SMOL_TEXTS[i] for i in (1, 5, 2, 3)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    fac = BatchDrafters(SpecDecoder(smol_f32, smol_draft4))
    names = list(SMOL_SPECS) + ["plain"]
    jobs = [fac.job(prompts[i % 4], SamplingParams(max_new_tokens=16), SMOL_SPECS[n]) for i, n in enumerate(names)]
    out = generate_batch(smol_f32, jobs, eos_ids=set(), max_batch=6, join_every=2)
    for n, job, r in zip(names, jobs, out):
        assert r.token_ids == smol_plain[tuple(job.prompt_ids)][:16], n
        if n != "plain":
            assert r.stats.drafted > 0, n
        if n in TREE_SPECS:
            assert any(s.depth is not None for s in r.stats.steps), n
    assert sum(r.stats.accepted for r in out) > 0


def test_batchbench_cli_on_a_tiny_model(tmp_path, capsys):
    """`specdraft batchbench`: every (batch size, method) measured, speedup vs plain, MAT, greedy rows
    equal plain's, crossover and plot written; bad arguments are one-line errors."""
    import json

    from conftest import tiny_model_dir
    from specdraft.cli import main

    d = tiny_model_dir(tmp_path / "tiny", layers=3)
    ds = tmp_path / "q.jsonl"
    ds.write_text(
        "\n".join(
            json.dumps({"question_id": i, "category": c, "turns": [f"Say {c} {i} {c} {i}."]})
            for i, c in enumerate(["qa", "writing", "qa"])
        )
        + "\n"
    )
    out, png = tmp_path / "bb.json", tmp_path / "bb.png"
    args = [
        "batchbench",
        "--target",
        str(d),
        "--dtype",
        "float32",
        "--methods",
        "prompt_lookup,early_exit",
        "--exit-layer",
        "1",
        "--batch-sizes",
        "1,2",
        "--prompts",
        "3",
        "--max-new-tokens",
        "6",
        "--dataset",
        str(ds),
        "--no-chat",
        "--out",
        str(out),
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert [(r["batch_size"], r["method"]) for r in res["summary"]] == [
        (b, m) for b in (1, 2) for m in ("plain", "prompt_lookup", "early_exit")
    ]
    for r in res["summary"]:
        assert r["tokens"] == 3 * 6 and r["tokens_per_s"] > 0 and r["mat"] >= 1 and r["greedy_exact_rows"] == "3/3"
        assert (r["speedup_vs_plain"] == 1.0) == (r["method"] == "plain")
    assert set(res["crossover"]) == {"prompt_lookup", "early_exit"} and png.stat().st_size > 0
    assert "speedup" in capsys.readouterr().out
    assert main(args[:-4] + ["--batch-sizes", "0"]) == 2
    assert "--batch-sizes must list integers >= 1" in capsys.readouterr().err
    assert main(args[:1] + ["--target", str(d), "--methods", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


# --- trained heads (Medusa, EAGLE): per-row drafters fed their own rows of the target's features ----
HEAD_SPECS = {
    "medusa_chain": {"method": "medusa", "k": 3},
    "medusa_tree": {
        "method": "medusa",
        "tree": "static",
        "tree_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]],
    },
    "eagle": {"method": "eagle", "k": 3},
    "eagle_tree": {"method": "eagle", "tree": "dynamic", "k": 3, "tree_topk": 2, "tree_budget": 6},
}


@pytest.fixture(scope="module")
def head_dirs(quad, tmp_path_factory):
    """Medusa (3 heads) and EAGLE heads trained a few steps on the target's own greedy continuations."""
    from head_util import train_tiny_heads

    return train_tiny_heads(quad[0], tmp_path_factory.mktemp("tiny_heads"), PROMPTS)


def _head_spec(name, head_dirs):
    spec = HEAD_SPECS.get(name) or ALL_SPECS[name]
    if spec["method"] in ("medusa", "eagle"):
        spec = {**spec, "head": str(head_dirs[spec["method"]])}
    return spec


@pytest.mark.parametrize("name", list(HEAD_SPECS))
def test_head_rows_greedy_equal_batch1(quad, head_dirs, name):
    """Medusa chain / tree and EAGLE chain / tree rows, with plain and prompt-lookup rows, joining at different
    steps (ragged prompts, the first a 1-token prompt): every greedy row == its batch-size-1 output."""
    target, draft = quad
    fac = BatchDrafters(SpecDecoder(target, draft))
    names = [name, "plain", name, "prompt_lookup", name, name, "prompt_lookup", name]
    prompts = [PROMPTS[1]] + PROMPTS[:1] + PROMPTS[2:]
    lens = [14, 9, 20, 12, 17, 11, 15, 19]
    jobs = [
        fac.job(p, SamplingParams(max_new_tokens=n), _head_spec(m, head_dirs)) for m, p, n in zip(names, prompts, lens)
    ]
    out = generate_batch(target, jobs, eos_ids=set(), max_batch=4, join_every=2)
    for m, job, r in zip(names, jobs, out):
        assert (
            r.token_ids == reference(target, draft, _head_spec(m, head_dirs), job.prompt_ids, job.sampling).token_ids
        ), m
        assert r.stats.new_tokens == job.sampling.max_new_tokens
    heads = [r for m, r in zip(names, out) if m == name]
    assert sum(r.stats.drafted for r in heads) > 0 and sum(r.stats.accepted for r in heads) > 0
    if name in ("medusa_tree", "eagle_tree"):  # token trees really went through the batched tree path
        assert any(s.depth is not None for r in heads for s in r.stats.steps)
    assert target.capture_hidden is False and target.last_hidden_batch is None  # switched on per forward only


def test_head_rows_mixed_with_sampling_rows(quad, head_dirs):
    """Medusa chain / tree, EAGLE chain / tree, plain and prompt-lookup rows in one batch, greedy and seeded sampling
    rows mixed, at most 3 rows at a time joining one per step: every row equals its batch-size-1
    output (a seeded sampling row draws the same drafts and samples as at batch size 1)."""
    target, draft = quad
    fac = BatchDrafters(SpecDecoder(target, draft))
    names = list(HEAD_SPECS) + ["plain", "prompt_lookup"] + list(HEAD_SPECS) + ["prompt_lookup_tree"]
    jobs, refs = [], []
    for i, name in enumerate(names):
        p, n = PROMPTS[(3 * i) % len(PROMPTS)], 8 + (5 * i) % 11
        sp = (
            SamplingParams(temperature=0.8, top_k=8, seed=i, max_new_tokens=n)
            if i % 2
            else SamplingParams(max_new_tokens=n)
        )
        spec = _head_spec(name, head_dirs)
        jobs.append(fac.job(p, sp, spec))
        refs.append(reference(target, draft, spec, p, sp).token_ids)
    out = generate_batch(target, jobs, eos_ids=set(), max_batch=3, join_every=1)
    for name, job, ref, r in zip(names, jobs, refs, out):
        assert r.token_ids == ref, name
        assert len(r.token_ids) == job.sampling.max_new_tokens and r.stats.accepted <= r.stats.drafted
    assert all(r.stats.drafted > 0 for n, r in zip(names, out) if n in HEAD_SPECS)
