"""The engine against the one-screen reference decoder (tests/reference_decoder.py) on tiny models in float32:
the same tokens, the same draft tokens accepted at every step."""

import pytest

from conftest import tiny_llama
from reference_decoder import reference_generate
from specdraft.api import SpecDecoder
from specdraft.core.config import SamplingParams

V = 16


@pytest.mark.parametrize("k", [1, 3, 5])
def test_the_engine_decodes_as_the_reference_decoder(k):
    target, draft = tiny_llama(vocab=V), tiny_llama(vocab=V, noise_seed=5, noise=0.25)
    dec = SpecDecoder(target, draft, prefix_cache_mb=0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 3, 4, 5]
    ref, acc = reference_generate(target, draft, prompt, 30, k)
    out = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), {"method": "draft_model", "k": k})
    assert out.token_ids == ref
    assert [s.accepted for s in out.stats.steps] == acc
    assert 0 < sum(acc) < k * len(acc)  # not vacuous: guesses were kept and rejected
    plain = dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), {"method": "plain"})
    assert ref == plain.token_ids  # and the reference itself is lossless
