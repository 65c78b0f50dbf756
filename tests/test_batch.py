"""The batch engine: every greedy row emits exactly its batch-size-1 output; ragged acceptance;
rows join and leave between steps; the KV cache is compacted without changing anything."""

import pytest
import torch

from conftest import tiny_llama
from specdraft.batch import BatchedDraftModel, BatchEngine, BatchKV, BatchSpecPolicy, GroupDraft, generate_batch
from specdraft.config import SamplingParams, SpecConfig
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import generate
from specdraft.models.adapter import HFModel

V = 16
PROMPTS = [[1, 2, 3, 1, 2], [5], [7, 7, 7, 7, 7, 7, 7, 3, 4], [2, 9, 4, 2, 9], [11, 12, 13, 14, 15, 11, 12, 13],
           [3, 3], [8, 1, 8, 1, 8, 1, 8], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V, layers=2), tiny_llama(vocab=V, noise_seed=5, noise=0.25)


_GROUPS = {}


def make(method, draft, k=3):
    if method == "draft_batched":  # one BatchedDraftModel per draft model and test
        g = _GROUPS.setdefault(id(draft), BatchedDraftModel(HFModel(draft.model, None, name="d"), V))
        return GroupDraft(g, SpecConfig(k=k))
    if method == "plain":
        return NoDrafter()
    if method == "prompt_lookup":
        return PromptLookupDrafter(SpecConfig(method="prompt_lookup", k=k, max_ngram=2))
    return DraftModelDrafter(HFModel(draft.model, None, name="d"), SpecConfig(k=k), V)


def single(target, draft, method, prompt, n):
    method = "draft_model" if method == "draft_batched" else method
    t = HFModel(target.model, None, name="t")
    return generate(t, make(method, draft), prompt, SamplingParams(max_new_tokens=n), eos_ids=set()).token_ids


METHODS = ["plain", "prompt_lookup", "draft_model"]


@pytest.mark.parametrize("method", METHODS + ["draft_batched"])
def test_greedy_rows_equal_batch1(pair, method):
    target, draft = pair
    lens = [12, 20, 7, 16, 25, 3, 18, 10]
    jobs = [(p, SamplingParams(max_new_tokens=n), make(method, draft)) for p, n in zip(PROMPTS, lens)]
    out = generate_batch(target, jobs, eos_ids=set())
    for (p, n), r in zip(zip(PROMPTS, lens), out):
        assert r.token_ids == single(target, draft, method, p, n)
        assert r.stats.new_tokens == n and r.stats.finish_reason == "length"


def test_mixed_methods_join_leave_and_compaction(pair):
    target, draft = pair
    jobs, refs = [], []
    for i in range(16):
        m, p, n = (METHODS + ["draft_batched"])[i % 4], PROMPTS[i % len(PROMPTS)], 5 + (7 * i) % 17
        jobs.append((p, SamplingParams(max_new_tokens=n), make(m, draft, k=1 + i % 4)))
        refs.append(single(target, draft, m, p, n))
    out = generate_batch(target, jobs, eos_ids=set(), max_batch=5, join_every=2)
    assert [r.token_ids for r in out] == refs
    g = _GROUPS[id(draft)]
    assert g.members == [] and g.kv.B == 0 and g.kv.L == 0  # draft rows left with their rows
    # ragged acceptance: within one step rows accepted different numbers of drafts
    accs = {tuple(s.accepted for s in r.stats.steps[:1]) for r in out if r.stats.drafted}
    assert len({a for t in accs for a in t}) > 1 or any(r.stats.accepted for r in out)


def test_engine_step_ragged_and_cancel(pair):
    target, draft = pair
    eng = BatchEngine(target, eos_ids=set(), compact_slack=1)
    rows = [eng.add(p, SamplingParams(max_new_tokens=30), make(m, draft, k=4))
            for p, m in zip(PROMPTS[:6], METHODS * 2)]
    per_step = []
    for _ in range(4):
        eng.step()
        per_step.append([r.stats.steps[-1].accepted for r in rows])
        assert eng.kv.holes() <= sum(eng.kv.L - n for n in eng.kv.lens)
    assert any(len(set(a)) > 1 for a in per_step)  # rows accept ragged amounts in one step
    eng.cancel(rows[1])
    assert rows[1].result.stats.finish_reason == "cancelled" and eng.num_rows == 5
    while eng.rows:
        eng.step()
    assert eng.cache_len == 0 and eng.kv.B == 0
    for r, p, m in zip(rows, PROMPTS[:6], METHODS * 2):
        if r is not rows[1]:
            assert r.result.token_ids == single(target, draft, m, p, 30)


def test_policy_shrinks_speculation_with_batch_size(pair):
    target, draft = pair
    pol = BatchSpecPolicy(shrink_at=3, off_at=5)
    assert [pol.cap(b, 4) for b in (1, 2, 3, 4, 5, 9)] == [4, 4, 2, 2, 0, 0]
    jobs = [(p, SamplingParams(max_new_tokens=8), make("prompt_lookup", draft, k=4)) for p in PROMPTS[:6]]
    out = generate_batch(target, jobs, eos_ids=set(), policy=pol)
    assert all(r.stats.drafted == 0 for r in out)  # 6 rows >= off_at: plain steps
    assert [r.token_ids for r in out] == [single(target, draft, "plain", p, 8) for p in PROMPTS[:6]]


@pytest.mark.parametrize("method", ["draft_model", "draft_batched"])
def test_sampling_rows_reproducible_by_seed(pair, method):
    target, draft = pair
    sp = SamplingParams(temperature=0.9, seed=3, max_new_tokens=12)
    a = generate_batch(target, [(PROMPTS[0], sp, make(method, draft)),
                                (PROMPTS[1], SamplingParams(max_new_tokens=5), NoDrafter())], eos_ids=set())
    b = generate(HFModel(target.model, None), make("draft_model", draft), PROMPTS[0], sp, eos_ids=set())
    assert a[0].token_ids == b.token_ids and len(a[0].token_ids) == 12  # the seed's batch-1 sample


def test_batchkv_empty_prefix_rows(pair):
    target, _ = pair
    kv = BatchKV(target)
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


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS + ["draft_batched"])
def test_smollm2_greedy_rows_equal_batch1(smol_f32, method):
    """fp32 SmolLM2-135M: 8 rows (ragged prompts and lengths, staggered joins) == batch-size-1."""
    from specdraft.models.loading import load_model

    tok = smol_f32.tokenizer
    draft = load_model("smollm2-135m", "float32", num_layers=4) if method.startswith("draft") else None
    texts = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
             "1, 2, 3, 4, 5, 6, 7,", "Once upon a time", "import numpy as np\nimport pandas as pd\nimport",
             "The quick brown fox jumps over the lazy dog. The quick brown", "Water boils at", "Hello"]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    lens = [24, 16, 30, 12, 20, 28, 8, 18]

    group = BatchedDraftModel(HFModel(draft.model, tok), smol_f32.vocab_size) if draft else None

    def mk(batched=method == "draft_batched"):
        if batched:
            return GroupDraft(group, SpecConfig(k=4))
        if draft is not None:
            return DraftModelDrafter(HFModel(draft.model, tok, name="d"), SpecConfig(k=4), smol_f32.vocab_size)
        return make(method, None, k=4)

    refs = [generate(HFModel(smol_f32.model, tok), mk(False), p, SamplingParams(max_new_tokens=n), eos_ids=set()).token_ids
            for p, n in zip(prompts, lens)]
    jobs = [(p, SamplingParams(max_new_tokens=n), mk()) for p, n in zip(prompts, lens)]
    out = generate_batch(smol_f32, jobs, eos_ids=set(), max_batch=6, join_every=3)
    assert [r.token_ids for r in out] == refs
    if method != "plain":
        assert sum(r.stats.accepted for r in out) > 0
