"""History-dependent processing (penalties, logit_bias, min_tokens, a token constraint) under speculation.

The exact reference here is written out by hand (``reference_logits``), not taken from
``specdraft.core.processors``: the processed distribution at a position is a function of the tokens
before it, the draft tokens on its path included. A toy constraint stands in for a grammar on the
tiny models (a token may not follow itself); llguidance's grammars are tested on SmolLM2 in
test_structured_real.py.
"""

import numpy as np
import pytest
import torch

from conftest import logits_of, tiny_llama
from specdraft.core import processors
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ConfigError
from specdraft.core.processors import RequestProcessor, TokenConstraint
from specdraft.core.sampling import probs_from_logits
from specdraft.core.tree import DraftTree
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter, DraftModelGroup
from specdraft.drafters.draft_tree import DraftTreeDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine, Job, generate, generate_batch
from stat_util import fit_pvalue, sample_first_tokens

V = 6
PROMPT = [1, 2, 3, 1, 2]
N = 2000


class NoRepeat(TokenConstraint):
    """Toy grammar: a token may not follow itself (the first output token is free), and 0 forces 1."""

    def __init__(self):
        self.stack: list[int] = []

    def allowed(self):
        a = torch.ones(V, dtype=torch.bool)
        if self.stack:
            a[self.stack[-1]] = False
            if self.stack[-1] == 0:
                a[:] = False
                a[1] = True
        return a

    def push(self, t):
        if not self.allowed()[t]:
            return False
        self.stack.append(t)
        return True

    def pop(self, n):
        del self.stack[len(self.stack) - n :]

    def forced(self):
        return [1] if self.stack and self.stack[-1] == 0 else []


@pytest.fixture
def toy_grammar(monkeypatch):
    """SamplingParams(regex="toy") compiles to NoRepeat."""
    monkeypatch.setattr(processors, "compile_grammar", lambda sp, tok, vocab, eos: NoRepeat())


def reference_logits(
    logits: torch.Tensor, prompt: list[int], out: list[int], sp: SamplingParams, toy: bool
) -> torch.Tensor:
    """One position's processed logits, by the formulas: repetition penalty over prompt + output,
    OpenAI's presence / frequency penalties over the output, logit_bias, then the toy mask."""
    x = logits.double().clone()
    for t in set(prompt + out):
        x[t] = x[t] / sp.repetition_penalty if x[t] > 0 else x[t] * sp.repetition_penalty
    for t in set(out):
        x[t] -= sp.frequency_penalty * out.count(t) + sp.presence_penalty
    for t, b in sp.logit_bias.items():
        x[t] += b
    if toy and out:
        x[out[-1]] = float("-inf")
        if out[-1] == 0:
            x[torch.arange(V) != 1] = float("-inf")
    return x


PROC = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7, logit_bias={4: 1.5, 0: -2.0})


def test_tree_positions_see_their_own_path():
    """Every node's row is processed with the context + the tokens on its own path (a chain, a tree)."""
    sp = SamplingParams(**PROC)
    g = torch.Generator().manual_seed(0)
    prompt, out = [1, 2, 3], [4, 3, 4, 5]
    tree = DraftTree(torch.tensor([4, 2, 4, 4, 1]), torch.tensor([-1, -1, 0, 2, 1]))
    logits = torch.randn(tree.size + 1, V, generator=g) * 3
    proc = RequestProcessor(sp, len(prompt), V, set(), NoRepeat())
    proc.commit(out)
    got = proc.process(logits, prompt + out, tree)
    for slot in range(tree.size + 1):
        path = [] if slot == 0 else tree.tokens[tree.path_to(slot - 1)].tolist()
        seq = out + path
        if any(a == b or (a == 0 and b != 1) for a, b in zip(seq, seq[1:])):
            continue  # a node the grammar rules out: pruned before the forward, its row never read
        want = reference_logits(logits[slot], prompt, seq, sp, toy=True)
        assert torch.allclose(got[slot].double(), want, atol=1e-5), slot


def test_prune_keeps_valid_subtrees_and_cuts_chains():
    proc = RequestProcessor(SamplingParams(), 1, V, set(), NoRepeat())
    proc.commit([3])
    tree = DraftTree(torch.tensor([3, 2, 2, 1, 5]), torch.tensor([-1, -1, 1, 1, 0]))  # 3 after 3: invalid
    pruned = proc.prune([0, 3], tree)
    assert pruned.tokens.tolist() == [2, 1] and pruned.parents.tolist() == [-1, 0]
    chain = proc.prune([0, 3], DraftTree.chain([1, 2, 2, 4]))
    assert chain.tokens.tolist() == [1, 2] and chain.is_chain()


def test_min_tokens_masks_eos_until_reached():
    sp = SamplingParams(min_tokens=2)
    proc = RequestProcessor(sp, 2, V, {5}, None)
    x = proc.process(torch.zeros(3, V), [0, 1], DraftTree.chain([2, 3]))
    assert torch.isinf(x[:2, 5]).all() and x[2, 5] == 0  # the 3rd position follows 2 generated tokens


def test_bad_parameters_name_the_field():
    for bad, field in [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"json_schema": "{oops"}, "json_schema"),
        ({"json_schema": {}, "regex": "a"}, "json_schema"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_tokens": 9, "max_new_tokens": 4}, "min_tokens"),
    ]:
        with pytest.raises(ConfigError, match=field):
            SamplingParams.from_dict(bad)
    with pytest.raises(ConfigError, match="logit_bias token id 99"):
        RequestProcessor.for_request(SamplingParams(logit_bias={99: 1}), [1], V, set())


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V), tiny_llama(vocab=V, noise_seed=5, noise=0.25)


def drafters(pair):
    target, draft = pair
    return {
        "draft_model": lambda: DraftModelDrafter(draft, SpecConfig(method="draft_model", k=3).validate(), V),
        "dynamic_tree": lambda: DraftTreeDrafter(
            draft, SpecConfig(method="draft_model", tree="dynamic", k=3, tree_topk=2, tree_budget=6).validate(), V
        ),
        "prompt_lookup_tree": lambda: PromptLookupDrafter(
            SpecConfig(method="prompt_lookup", k=3, min_ngram=1, max_ngram=2, branches=3).validate()
        ),
    }


@pytest.mark.parametrize("method", ["draft_model", "dynamic_tree", "prompt_lookup_tree"])
def test_greedy_processed_equals_plain_processed(pair, toy_grammar, method):
    """Greedy with penalties, bias and the toy grammar: speculative == plain, batch of 1 and of 3."""
    target = pair[0]
    prompts = [PROMPT, [0, 1, 2, 3, 4, 5, 0, 1], [5, 5, 4]]
    sp = SamplingParams(max_new_tokens=24, regex="toy", **PROC)
    plain = [generate(target, NoDrafter(), p, sp, eos_ids=set()).token_ids for p in prompts]
    for out in plain:
        assert all(a != b and (a != 0 or b == 1) for a, b in zip(out, out[1:]))  # the grammar held
    make = drafters(pair)[method]
    spec = [generate(target, make(), p, sp, eos_ids=set()) for p in prompts]
    assert [r.token_ids for r in spec] == plain
    assert sum(st.accepted for r in spec for st in r.stats.steps) > 0
    batch = generate_batch(target, [Job(p, sp, make()) for p in prompts], eos_ids=set())
    assert [r.token_ids for r in batch] == plain


def exact_first_two(target, sp, toy):
    def dist(prefix_out):
        lg = logits_of(target, PROMPT + prefix_out)[-1]
        return probs_from_logits(reference_logits(lg, PROMPT, prefix_out, sp, toy).float(), sp).double()

    p1 = dist([])
    return np.stack([(p1[a] * dist([a])).numpy() for a in range(V)])


def _draw_raw_report_processed(orig):
    """Broken: the draft samples from its raw distribution but reports the processed q."""

    def draw(m, logits, step, out, probs, cap, proposal=None):
        proc, m.processor = m.processor, None
        try:
            more = orig(m, logits, step, out, probs, cap, proposal)
        finally:
            m.processor = proc
        if probs and not m.sp.greedy:
            hist = m.tokens + [int(t) for t in out[:-1]]
            probs[-1] = probs_from_logits(proc.process(logits[None], hist)[0], m.sp)
        return more

    return draw


SAMPLED = SamplingParams(temperature=1.0, min_p=0.02, regex="toy", **PROC)
BUGS = {
    # penalties and the mask from the step start's history at every draft position (both sides)
    "step_start_history": lambda mp: mp.setattr(RequestProcessor, "process", _at_step_start(RequestProcessor.process)),
    # processing on the draft side only: the verifier sees the raw target
    "target_unprocessed": lambda mp: mp.setattr(Engine, "_process", lambda self, rows, drafts, logits: logits),
    # the mask reaches the reported q but not the distribution the draft samples from
    "draft_samples_raw": lambda mp: mp.setattr(
        DraftModelGroup, "_draw", staticmethod(_draw_raw_report_processed(DraftModelGroup._draw))
    ),
}


def _at_step_start(orig):
    def process(self, logits, history, tree=None):
        rows = [orig(self, logits[i : i + 1], history[: self.committed])[0] for i in range(logits.shape[0])]
        return torch.stack(rows)

    return process


@pytest.mark.parametrize("method", ["draft_model", "dynamic_tree", "prompt_lookup_tree", "plain"])
def test_sampling_follows_the_processed_target(pair, toy_grammar, method):
    target = pair[0]
    make = NoDrafter if method == "plain" else drafters(pair)[method]
    counts, drafted, accepted = sample_first_tokens(target, make, PROMPT, SAMPLED, 5, 2, N, V, seed0=20_000)
    if method != "plain":
        assert 0 < accepted < drafted
    assert fit_pvalue(counts, exact_first_two(target, SAMPLED, toy=True)) > 1e-3


def test_draft_side_processing_is_not_needed_for_exactness(pair, toy_grammar, monkeypatch):
    """A drafter that samples and reports its raw q stays exact (the verifier processes the target);
    processing the draft too only raises acceptance."""
    monkeypatch.setattr(DraftModelGroup, "_draw", staticmethod(_unprocessed(DraftModelGroup._draw)))
    counts, _, _ = sample_first_tokens(pair[0], drafters(pair)["draft_model"], PROMPT, SAMPLED, 5, 2, N, V, 30_000)
    assert fit_pvalue(counts, exact_first_two(pair[0], SAMPLED, toy=True)) > 1e-3


def _unprocessed(orig):
    def draw(m, *a, **kw):
        proc, m.processor = m.processor, None
        try:
            return orig(m, *a, **kw)
        finally:
            m.processor = proc

    return draw


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_broken_processing_is_caught(pair, toy_grammar, bug, monkeypatch):
    BUGS[bug](monkeypatch)
    make = drafters(pair)["draft_model"]
    # N // 4 samples (CI time): each bug measured p < 1e-36 at 500 (2026-12-03), against the 1e-3 bound
    counts, _, _ = sample_first_tokens(pair[0], make, PROMPT, SAMPLED, 5, 2, N // 4, V, seed0=20_000)
    assert fit_pvalue(counts, exact_first_two(pair[0], SAMPLED, toy=True)) < 1e-3


def test_logprobs_are_the_processed_targets(pair):
    """Greedy with logprobs: every emitted token's entry is log_softmax of the processed logits after its
    history, top alternatives sorted, the same with and without speculation."""
    target, draft = pair
    sp = SamplingParams(max_new_tokens=10, logprobs=3, **PROC)
    plain = generate(target, NoDrafter(), PROMPT, sp, eos_ids=set())
    spec = generate(
        target, DraftModelDrafter(draft, SpecConfig(method="draft_model", k=3).validate(), V), PROMPT, sp, eos_ids=set()
    )
    assert spec.token_ids == plain.token_ids and len(plain.logprobs) == 10
    for i, (e, f) in enumerate(zip(plain.logprobs, spec.logprobs)):
        out = plain.token_ids[:i]
        lg = logits_of(target, PROMPT + out)[-1]
        want = torch.log_softmax(reference_logits(lg, PROMPT, out, sp, toy=False), -1)
        assert e["token_id"] == plain.token_ids[i] and abs(e["logprob"] - float(want[e["token_id"]])) < 1e-4
        assert abs(f["logprob"] - e["logprob"]) < 1e-4
        assert [t for t, _ in e["top"]] == want.topk(3).indices.tolist()


@pytest.fixture(scope="module")
def head_dirs(pair, tmp_path_factory):
    from head_util import train_tiny_heads

    return train_tiny_heads(
        pair[0], tmp_path_factory.mktemp("heads"), [PROMPT, [0, 1, 2, 3, 4, 5], [5, 4, 3, 2]], n_heads=2
    )


HEAD_AND_SELF = {
    "medusa_tree": lambda h: SpecConfig(method="medusa", head=str(h["medusa"]), tree="static", tree_branching=[2, 2]),
    "eagle_tree": lambda h: SpecConfig(
        method="eagle", head=str(h["eagle"]), tree="dynamic", k=3, tree_topk=2, tree_budget=6
    ),
    "eagle_chain": lambda h: SpecConfig(method="eagle", head=str(h["eagle"]), k=3),
    "early_exit": lambda h: SpecConfig.from_dict({"method": "early_exit", "exit_layer": 1, "k": 3}),
    "auto": lambda h: SpecConfig(method="auto"),
}


@pytest.mark.parametrize("method", sorted(HEAD_AND_SELF))
def test_greedy_processed_heads_and_self_speculation(pair, head_dirs, toy_grammar, method):
    """The drafters that read the fed positions (heads: not pruned) and self-speculation, with penalties
    and the toy grammar: speculative == plain, batch of one and of three."""
    from specdraft.api import SpecDecoder

    dec = SpecDecoder(pair[0], pair[1])
    spec = HEAD_AND_SELF[method](head_dirs)
    prompts = [PROMPT, [0, 1, 2, 3, 4, 5, 0, 1], [5, 5, 4]]
    sp = SamplingParams(max_new_tokens=20, regex="toy", **PROC)
    plain = [generate(pair[0], NoDrafter(), p, sp, eos_ids=set()).token_ids for p in prompts]
    assert [generate(pair[0], dec.make_drafter(spec), p, sp, eos_ids=set()).token_ids for p in prompts] == plain
    batch = generate_batch(pair[0], [Job(p, sp, dec.make_drafter(spec)) for p in prompts], eos_ids=set())
    assert [r.token_ids for r in batch] == plain
