"""End-to-end engine behaviour on tiny random-weight models (mechanics, sampling exactness)."""

import numpy as np
import pytest
import torch

from conftest import logits_of, tiny_llama
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ContextLengthError
from specdraft.core.sampling import probs_from_logits
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.draft_tree import DraftTreeDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import generate
from stat_util import fit_pvalue, sample_first_tokens

V = 6
PROMPT = [1, 2, 3, 1, 2]
N = 2000


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V), tiny_llama(vocab=V, noise_seed=5, noise=0.25)


def draft_spec(**keys) -> SpecConfig:
    """A draft model's spec, validated (what its drafters are made from)."""
    return SpecConfig(method="draft_model", **keys).validate()


def exact_first_two(target, sp):
    p1 = probs_from_logits(logits_of(target, PROMPT)[-1], sp).double()
    joint = np.zeros((V, V))
    for a in range(V):
        p2 = probs_from_logits(logits_of(target, PROMPT + [a])[-1], sp).double()
        joint[a] = (p1[a] * p2).numpy()
    return joint


def sample_first_two(target, make_drafter, sp, max_new):
    """-> (counts of the first two tokens, draft tokens drafted / accepted in the steps that made them)."""
    return sample_first_tokens(target, make_drafter, PROMPT, sp, max_new, 2, N, V, seed0=10_000)


T1 = SamplingParams(temperature=1.0)
TRUNC = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
CASES = [  # max_new 2: the first step drafts 1 token, so accepted -> bonus path; 5: chain positions
    ("draft_model", 2, T1),
    ("draft_model", 5, TRUNC),
    ("prompt_lookup", 3, TRUNC),
    ("plain", 2, T1),
    ("prompt_lookup_tree", 4, TRUNC),
    ("static_tree", 4, T1),
    ("dynamic_tree", 5, TRUNC),
    ("early_exit", 5, TRUNC),
    ("layer_skip", 5, TRUNC),
    ("layer_skip_tree", 4, T1),
]


def drafter_maker(pair, method: str):
    """-> a callable making a fresh drafter for ``method`` (every sampled run gets its own)."""
    target, draft = pair
    if method == "draft_model":
        return lambda: DraftModelDrafter(draft, draft_spec(k=3), V)
    if method == "static_tree":
        return lambda: DraftTreeDrafter(draft, draft_spec(tree="static", tree_branching=[3, 2]), V)
    if method == "dynamic_tree":
        return lambda: DraftTreeDrafter(draft, draft_spec(tree="dynamic", k=3, tree_topk=2, tree_budget=6), V)
    if method == "early_exit":  # the target's first layer drafts (a view over its own weights)
        from specdraft.models.views import layer_view

        view = layer_view(target, [0])
        return lambda: DraftModelDrafter(
            view, SpecConfig.from_dict({"method": "early_exit", "exit_layer": 1, "k": 3}), V
        )
    if method.startswith("layer_skip"):  # the target with layer 0 skipped drafts, built as users get it
        from specdraft.api import SpecDecoder

        tree = dict(tree="dynamic", tree_topk=2, tree_budget=5) if method.endswith("tree") else {}
        spec, dec = SpecConfig(method="layer_skip", skip_layers=[0], k=3, **tree), SpecDecoder(target, None)
        return lambda: dec.make_drafter(spec)
    if method == "prompt_lookup_tree":
        tree_spec = SpecConfig(method="prompt_lookup", k=3, min_ngram=1, max_ngram=2, branches=3).validate()
        return lambda: PromptLookupDrafter(tree_spec)
    if method == "prompt_lookup":
        chain_spec = SpecConfig(method="prompt_lookup", k=3, min_ngram=1, max_ngram=2).validate()
        return lambda: PromptLookupDrafter(chain_spec)
    return NoDrafter


@pytest.mark.parametrize("method,max_new,sp", CASES, ids=[f"{m}-{n}-T{s.temperature}" for m, n, s in CASES])
def test_sampling_first_two_tokens_match_target(pair, sp, method, max_new):
    target = pair[0]
    make = drafter_maker(pair, method)
    counts, drafted, accepted = sample_first_two(target, make, sp, max_new)
    if method == "plain":
        assert drafted == 0
    else:  # not vacuous: the tested tokens went through drafting and verification, with acceptances and rejections
        assert 0 < accepted < drafted, (accepted, drafted)
    assert fit_pvalue(counts, exact_first_two(target, sp)) > 1e-3


def test_greedy_matches_plain_and_accepts(pair):
    target, draft = pair
    sp = SamplingParams(max_new_tokens=40)
    ref = generate(target, NoDrafter(), PROMPT, sp, eos_ids=set())
    for spec in [
        draft_spec(k=3),
        draft_spec(k=2, schedule="heuristic", max_k=8),
        draft_spec(k=4, confidence_threshold=0.5),
    ]:
        out = generate(target, DraftModelDrafter(draft, spec, V), PROMPT, sp, eos_ids=set())
        assert out.token_ids == ref.token_ids
        assert out.stats.accepted > 0 and out.stats.drafted > out.stats.accepted
    assert len(ref.token_ids) == 40 and ref.stats.finish_reason == "length"
    assert ref.stats.mat == 1.0 and ref.stats.acceptance_rate is None


def test_stop_at_eos_and_max_tokens(pair):
    target, draft = pair
    sp = SamplingParams(max_new_tokens=30)
    ref = generate(target, NoDrafter(), PROMPT, sp, eos_ids=set()).token_ids
    eos = ref[7]
    first = ref.index(eos)
    for drafter in [NoDrafter(), DraftModelDrafter(draft, draft_spec(k=4), V)]:
        out = generate(target, drafter, PROMPT, sp, eos_ids={eos})
        assert out.token_ids == ref[: first + 1] and out.stats.finish_reason == "stop"
    for n in [1, 2, 3, 7]:
        out = generate(
            target,
            DraftModelDrafter(draft, draft_spec(k=4), V),
            PROMPT,
            SamplingParams(max_new_tokens=n),
            eos_ids=set(),
        )
        assert out.token_ids == ref[:n]


def test_context_length_errors():
    t = tiny_llama(vocab=V, max_pos=16)
    with pytest.raises(ContextLengthError, match="context is 16 tokens"):
        generate(t, NoDrafter(), list(range(6)) * 3, SamplingParams(max_new_tokens=1), eos_ids=set())
    with pytest.raises(ContextLengthError, match="lower max_new_tokens to at most 6"):
        generate(t, NoDrafter(), [1] * 10, SamplingParams(max_new_tokens=20), eos_ids=set())


def test_cost_aware_schedule_is_exact_and_learns(pair):
    from specdraft.core.policy import CostAwareLength, CostAwarePolicy

    target, draft = pair
    sp = SamplingParams(max_new_tokens=40)
    ref = generate(target, NoDrafter(), PROMPT, sp, eos_ids=set()).token_ids
    pol = CostAwarePolicy(4)
    accepted = 0
    for _ in range(2):
        out = generate(
            target,
            DraftModelDrafter(draft, draft_spec(k=4, schedule="cost_aware"), V),
            PROMPT,
            sp,
            eos_ids=set(),
            length=CostAwareLength(pol),
        )
        assert out.token_ids == ref
        drafted = [s.drafted for s in out.stats.steps]
        assert all(0 <= d <= 4 for d in drafted) and max(drafted) > 0
        accepted += out.stats.accepted
    # it drafted, some drafts were accepted (whether the second request still drafts depends on the
    # machine's measured costs), and the acceptance it learned matches what happened
    assert accepted > 0
    assert pol.acc and all(0.0 < a < 1.0 for a in pol.acc[:1])
    assert pol.draft_cost > 0 and all(c > 0 for c in pol.cost.values())


def test_cost_aware_policy_decisions():
    from specdraft.core.policy import CostAwarePolicy

    p = CostAwarePolicy(4, explore_every=3)
    assert p.choose(4) == 0  # measure a plain step first
    p.observe(0, 0, 0.0, 1.0, scored=1)
    assert p.choose(4) == 4  # then the longest draft
    # verification nearly free, high acceptance: draft the most
    p.observe(4, 4, 0.0, 1.1, scored=5)
    assert p.choose(4) == 4
    # verification costs 5x a token and drafts are rejected: plain decoding
    for _ in range(20):
        p.observe(4, 0, 0.4, 5.0, scored=5)
    assert p.choose(4) == 0
    for _ in range(3):
        p.observe(0, 0, 0.0, 1.0, scored=1)
    assert p.choose(4) >= 1  # periodic exploration keeps the estimates current
    assert p.expected_tokens(0) == 1.0


class _CharTok:
    """Token i decodes to the letter 'a' + i: enough to test stop strings."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(i)) for i in ids)


def test_stop_strings_emit_nothing_past_the_stop(pair):
    target, draft = pair
    tok = _CharTok()
    sp = SamplingParams(max_new_tokens=30)
    ref = generate(target, NoDrafter(), PROMPT, sp, eos_ids=set(), tokenizer=tok)
    stop = ref.text[5:7]  # a two-character stop string first completed at some token j
    first = ref.text.find(stop)
    for drafter in [NoDrafter(), DraftModelDrafter(draft, draft_spec(k=4), V)]:
        s = SamplingParams(max_new_tokens=30, stop=[stop])
        out = generate(target, drafter, PROMPT, s, eos_ids=set(), tokenizer=tok)
        assert out.stats.finish_reason == "stop"
        assert out.token_ids == ref.token_ids[: first + 2]  # up to the token that completes the stop
        assert out.text == ref.text[:first]  # the stop string itself is not returned


def test_draft_tree_rows_match_direct_decoding(pair):
    """After each tree step the draft model's rows (its group's ``SequenceRows``) hold a prefix of the
    request's tokens as if decoded directly: feeding the rest gives the logits of a fresh forward of
    the whole sequence. Single row, then a row among others (greedy: trees drafted together; seeded
    sampling: the row drafts in a group of its own)."""
    from specdraft.engine import Engine
    from specdraft.models.hf import HFModel

    target, draft = pair
    fresh = HFModel(draft.model)
    static = draft_spec(tree="static", tree_branching=[2, 2, 1])
    dynamic = draft_spec(tree="dynamic", k=3, tree_topk=2, tree_budget=5)
    for spec, sp in [
        (static, SamplingParams(max_new_tokens=30)),
        (dynamic, SamplingParams(temperature=1.0, seed=3, max_new_tokens=30)),
    ]:
        for others in ([], [[2, 3], [4, 1, 0, 5]]):
            eng = Engine(target, eos_ids=set())
            row = eng.add(PROMPT, sp, DraftTreeDrafter(draft, spec, V))
            for p in others:
                eng.add(p, sp, DraftTreeDrafter(draft, spec, V))
            group = eng.groups[row.group_key]  # (a seeded sampling row drafts in a group of its own)
            checked = 0
            while row in eng.rows:
                eng.step()
                if row in eng.rows:
                    i, kv = group.members.index(row), group.kv
                    got = kv.forward([row.tokens[kv.lens[j] :] if j == i else [] for j in range(kv.B)], keep=1)[i, -1]
                    kv.commit([0] * kv.B)  # the check's feed is dropped again
                    want = logits_of(fresh, row.tokens)[-1]
                    assert torch.allclose(got, want, atol=1e-4)
                    checked += 1
            assert row.stats.accepted > 0 and len(row.output) == 30 and checked > 5


def test_tiny_temperature_is_greedy(pair):
    """A temperature below config.GREEDY_BELOW is greedy: 1e-39 used to pass validation, overflow
    logits / temperature to NaN probabilities and fail in torch.multinomial."""
    from specdraft.api import SpecDecoder
    from specdraft.core.config import GREEDY_BELOW

    target, draft = pair
    dec = SpecDecoder(target, draft)
    base = {"max_new_tokens": 12, "ignore_eos": True}
    greedy = dec.generate(PROMPT, sampling=base, spec={"method": "plain"}).token_ids
    for spec in [{"method": "plain"}, {"method": "draft_model", "k": 3}, {"method": "prompt_lookup"}]:
        out = dec.generate(PROMPT, sampling={**base, "temperature": 1e-39, "seed": 0}, spec=spec)
        assert out.token_ids == greedy, spec
    assert SamplingParams(temperature=1e-39).validate().greedy and not SamplingParams(temperature=GREEDY_BELOW).greedy


def test_a_job_reaches_its_drafter_through_begin_only(pair):
    """The engine admits typed jobs and hands a drafter its request (sampling, random stream, processor)
    through ``begin``; it sets no attribute of the drafter."""
    from specdraft.engine import Engine, Job

    class Watched(NoDrafter):
        def __setattr__(self, name, value):
            raise AssertionError(f"the engine set drafter.{name}")

        def begin(self, prompt_ids, sp, generator, processor=None):
            object.__setattr__(self, "began", (list(prompt_ids), sp, generator, processor))

    eng = Engine(pair[0], eos_ids=set())
    drafter, plain = Watched(), Watched()
    sp = SamplingParams(max_new_tokens=3, min_tokens=2)  # a processed request: it has a processor
    rows = eng.add_many(
        [Job(PROMPT, sp, drafter, tag="a"), Job(PROMPT, {"temperature": 1.5, "max_new_tokens": 2}, plain, tag="b")]
    )
    assert [r.tag for r in rows] == ["a", "b"] and rows[0].processor is not None and rows[1].processor is None
    assert drafter.began == (PROMPT, rows[0].sp, rows[0].gen, rows[0].processor)
    assert plain.began[3] is None
    while eng.rows:
        eng.step()
    assert [len(r.result.token_ids) for r in rows] == [3, 2]
