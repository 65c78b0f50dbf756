"""Greedy exactness on real models: speculative output == the target's own greedy output.

SmolLM2-135M in float32 (like with like): drafts from a layer-truncated copy of itself, from a
bfloat16 copy of itself (high acceptance, so long accepted runs and rollbacks both happen), and
from prompt lookup; and the engine's plain decoding equals transformers' own generate().
"""

import pytest
import torch

from specdraft.api import SpecDecoder
from specdraft.core.config import SamplingParams, SpecConfig

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works, with an example in Python.",
    "List five facts about the Moon.",
    "Summarize: The city council voted on Tuesday to expand the bike lane network, citing safety data "
    "and rising ridership. The plan adds 40 km of protected lanes over three years.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Describe the water cycle to a ten-year-old.",
]  # 7 prompts (10 before; CI time): the second to last repeats itself (retrieval drafters, test_auto)
NEW = 32  # every test compares 32 new tokens with the shared reference (conftest.smol_reference)


@pytest.fixture(scope="module")
def smol(smol_dec):
    return smol_dec


@pytest.fixture(scope="module")
def reference(smol_reference):
    return smol_reference


def test_plain_equals_transformers_generate(smol, reference):
    model = smol.target.model
    for p in PROMPTS[:2]:
        ids = torch.tensor([smol.encode(p, chat=True)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        assert out[0, ids.shape[1] :].tolist() == reference[p]


DRAFTS = {  # id: (draft dtype, draft layers, spec)
    "truncated-20": ("float32", 20, SpecConfig(method="draft_model", k=2)),
    "bf16-copy": ("bfloat16", None, SpecConfig(method="draft_model", k=4, schedule="heuristic", max_k=8)),
    "truncated-20-static-tree": (
        "float32",
        20,
        SpecConfig(method="draft_model", tree="static", tree_branching=[3, 2, 1]),
    ),
    "truncated-20-dynamic-tree": (
        "float32",
        20,
        SpecConfig(method="draft_model", tree="dynamic", k=4, tree_topk=3, tree_budget=12),
    ),
}  # (a static tree given as tree_choices: Medusa's, tests/test_heads.py; trees in a batch: tests/test_batch.py)


def prompts_for(kind):
    """Chains run every third prompt; trees (several draft forwards per step) the first (CI time: the
    batch tests run every drafter on other prompts)."""
    return PROMPTS[:1] if kind.endswith("tree") else PROMPTS[::3]


@pytest.mark.parametrize("draft_kind", list(DRAFTS))
def test_draft_model_greedy_exact(smol_f32, smol_variant, reference, draft_kind):
    dtype, layers, spec = DRAFTS[draft_kind]
    draft = smol_variant(dtype, layers)  # loaded once per session
    dec = SpecDecoder(smol_f32, draft)
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    accepted = drafted = 0
    for p in prompts_for(draft_kind):
        out = dec.generate(p, sampling=sp, spec=spec, chat=True)
        assert out.token_ids == reference[p], f"{draft_kind} diverged on {p!r}"
        accepted += out.stats.accepted
        drafted += out.stats.drafted
    assert 0 < accepted <= drafted
    if layers is not None:  # a truncated draft is wrong somewhere: the reject path was exercised too (a bf16
        assert accepted < drafted  # copy can agree with every token, as on an AVX2-only CPU's emulated bf16)


def test_prompt_lookup_greedy_exact(smol, reference):
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    accepted = 0
    for p in PROMPTS[1::2]:  # code, a summary, text that repeats itself
        out = smol.generate(p, sampling=sp, spec=SpecConfig(method="prompt_lookup", k=5), chat=True)
        assert out.token_ids == reference[p], f"prompt_lookup diverged on {p!r}"
        accepted += out.stats.accepted
    assert accepted > 0


def test_prompt_lookup_tree_greedy_exact(smol, reference):
    """Several lookup matches as one token tree, scored with a tree attention mask in one forward."""
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    accepted = 0
    for p in PROMPTS[1::2]:
        out = smol.generate(p, sampling=sp, spec=SpecConfig(method="prompt_lookup", k=4, branches=3), chat=True)
        assert out.token_ids == reference[p], f"prompt_lookup tree diverged on {p!r}"
        accepted += out.stats.accepted
    assert accepted > 0


SELF = {
    "early_exit-24": SpecConfig.from_dict({"method": "early_exit", "exit_layer": 24, "k": 3}),
    "layer_skip-6": SpecConfig(method="layer_skip", skip_layers=[5, 9, 13, 17, 21, 25], k=3),
    "layer_skip-6-dynamic-tree": SpecConfig(
        method="layer_skip", skip_layers=[5, 9, 13, 17, 21, 25], tree="dynamic", k=3, tree_topk=2, tree_budget=8
    ),
}


@pytest.mark.parametrize("kind", list(SELF))
def test_self_speculation_greedy_exact(smol, reference, kind):
    """The target drafts for itself through a view of its own layers (shared weights)."""
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    accepted = drafted = 0
    for p in prompts_for(kind):
        out = smol.generate(p, sampling=sp, spec=SELF[kind], chat=True)
        assert out.token_ids == reference[p], f"{kind} diverged on {p!r}"
        accepted += out.stats.accepted
        drafted += out.stats.drafted
    assert 0 < accepted < drafted


def test_cross_tokenizer_draft_greedy_exact(smol_f32, reference):
    """A draft with another tokenizer (Qwen2.5-Coder-0.5B, 151,936 tokens) for SmolLM2-135M float32
    (49,152): its drafts go through text, and the output is the target's own greedy output. The
    draft's precision does not matter for exactness (the float32 target verifies), so it runs bf16."""
    from specdraft.models.backends import load_model

    dec = SpecDecoder(smol_f32, load_model("qwen2.5-coder-0.5b", "bfloat16"))
    assert dec.cross_vocab
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    accepted = 0
    for p in (PROMPTS[1], PROMPTS[-2]):  # code, and text that repeats itself
        out = dec.generate(p, sampling=sp, spec=SpecConfig(method="draft_model", k=3), chat=True)
        assert out.token_ids == reference[p][:24]
        accepted += out.stats.accepted
    assert accepted > 0


def test_two_level_draft_on_the_targets_own_gguf_greedy_exact(smol_f32, smol_gguf, reference):
    """Issue 31's arrangement on SmolLM2: the float32 target drafted by its own 4-bit file (the weights
    its dense copy was made from, ``self:Q4_1``) on llama.cpp, with prompt lookup proposing for that
    draft (cascade: two levels); and the draft alone. Output = the float32 target's greedy output."""
    from specdraft.api import _self_draft

    draft = _self_draft(smol_f32, "smollm2-135m", "Q4_1", "float32", "llama")
    assert str(draft.path) == str(smol_gguf.path)  # the pulled file itself, not a requantized one
    dec = SpecDecoder(smol_f32, draft)
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    accepted = drafted = 0
    for p in (PROMPTS[1], PROMPTS[-2]):
        for spec in (
            SpecConfig.from_dict({"method": "cascade", "k": 5, "cascade_k": 3}),
            SpecConfig(method="draft_model", k=5),
        ):
            out = dec.generate(p, sampling=sp, spec=spec, chat=True)
            assert out.token_ids == reference[p], f"{spec.method} diverged on {p!r}"
            accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
    assert accepted > 0.5 * drafted  # a 4-bit copy of the same weights drafts well
