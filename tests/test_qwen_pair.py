"""The real pair: Qwen2.5-Coder 1.5B target, 0.5B draft, both bfloat16, greedy.

In bf16, scoring several tokens in one forward can flip a near-tie argmax; every divergence is
reported with the target's top-2 logit gap at that position, and one that is not a near-tie fails.
"""

import warnings

import pytest

from specdraft.api import SpecDecoder
from specdraft.bench.harness import compare
from specdraft.core.config import SamplingParams, SpecConfig

pytestmark = [pytest.mark.slow, pytest.mark.qwen]

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Summarize in two sentences: Speculative decoding lets a small draft model propose tokens that a large "
    "model verifies in one forward pass, so the output is unchanged while decoding gets faster.",
]  # 2 prompts x 24 tokens (3 x 48 took 4.5 min of one CI worker): one real bf16 path; the table is the bench's
NEAR_TIE = 0.25  # bf16 logits of magnitude ~20 are spaced 0.125 apart


@pytest.fixture(scope="module")
def qwen():
    return SpecDecoder.load("qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", dtype="bfloat16", backend="hf")


SP = SamplingParams(max_new_tokens=24)


@pytest.fixture(scope="module")
def plain_ref(qwen):
    """Each prompt's plain greedy output, computed once for all methods."""
    return {p: qwen.generate(qwen.encode(p, chat=True), sampling=SP, spec=SpecConfig(method="plain")).token_ids
            for p in PROMPTS}


@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup"])
def test_qwen_pair_greedy_matches_plain(qwen, plain_ref, method):
    sp = SP
    divergences = []
    accepted = 0
    for p in PROMPTS:
        ids = qwen.encode(p, chat=True)
        ref = plain_ref[p]
        out = qwen.generate(ids, sampling=sp, spec=SpecConfig(method=method, k=4))
        accepted += out.stats.accepted
        c = compare(qwen.target, ids, ref, out.token_ids)
        if not c["exact"]:
            divergences.append((p[:40], c))
    for prompt, c in divergences:  # reported in pytest's warnings summary
        warnings.warn(f"bf16 {method} diverged from plain on {prompt!r} at token {c['first_divergence']}, "
                      f"target top-2 logit gap {c.get('top2_gap')}")
    bugs = [d for d in divergences if d[1].get("top2_gap", float("inf")) > NEAR_TIE]
    assert not bugs, f"divergences that are not near-ties: {bugs}"
    assert accepted > 0


@pytest.fixture(scope="module")
def smol_for_qwen(qwen):
    """SmolLM2-135M (another tokenizer: 49,152 tokens against 151,936) drafting for the same Qwen 1.5B."""
    from specdraft.models.backends import load_model

    return SpecDecoder(qwen.target, load_model("smollm2-135m", "bfloat16"))


def test_smollm2_drafts_for_qwen_through_text(smol_for_qwen, plain_ref):
    """The real cross-tokenizer pair, bf16: greedy equals plain up to near-ties, and the draft's text
    is accepted."""
    dec = smol_for_qwen
    assert dec.cross_vocab and len(dec.vocab_bridge().draft_ids) > 35_000  # 39,237 of 49,152
    accepted, bugs = 0, []
    for p in PROMPTS:
        ids = dec.encode(p, chat=True)
        out = dec.generate(ids, sampling=SP, spec=SpecConfig(method="draft_model", k=4))
        accepted += out.stats.accepted
        c = compare(dec.target, ids, plain_ref[p], out.token_ids)
        if not c["exact"]:
            warnings.warn(f"bf16 cross-tokenizer draft diverged on {p[:40]!r} at token {c['first_divergence']}, "
                          f"target top-2 logit gap {c.get('top2_gap')}")
            if c.get("top2_gap", float("inf")) > NEAR_TIE:
                bugs.append((p[:40], c))
    assert not bugs, f"divergences that are not near-ties: {bugs}"
    assert accepted > 0
