"""fidelity.py: sampled outputs scored under the target give Z about N(0, 1) when a method samples the
target's distribution (plain, a draft model through rejection sampling), and a large |Z| when it does
not (a sampler at another temperature, one that keeps the draft's tokens unchecked)."""

import pytest

from conftest import tiny_llama
from specdraft.api import SpecDecoder
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.fidelity import output_terms
from specdraft.core.metrics import fidelity_z

V = 12
PROMPT = [1, 2, 3, 1]


@pytest.fixture(scope="module")
def dec():
    return SpecDecoder(tiny_llama(vocab=V, scale=3.0), tiny_llama(vocab=V, seed=5, scale=3.0))


def z_of(dec, spec, sp_run, sp_score, n=120):
    terms = []
    for seed in range(n):
        out = dec.generate(PROMPT, sampling=SamplingParams(**{**sp_run.to_dict(), "seed": seed}), spec=spec).token_ids
        terms.append(output_terms(dec.target, PROMPT, out, sp_score))
    assert sum(t["fid_tokens"] for t in terms) == n * sp_run.max_new_tokens
    return fidelity_z(terms)


T1 = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)


@pytest.mark.parametrize(
    "spec", [SpecConfig(method="plain"), SpecConfig(method="draft_model", k=3)], ids=["plain", "draft_model"]
)
def test_a_lossless_sampler_scores_near_zero(dec, spec):
    assert abs(z_of(dec, spec, T1, T1)) < 4


def test_another_distribution_is_caught(dec):
    cooler = SamplingParams(temperature=0.6, max_new_tokens=16, ignore_eos=True)
    assert z_of(dec, SpecConfig(method="plain"), cooler, T1) > 6  # likelier tokens than T=1 gives


def test_a_lossy_rule_is_caught(dec):
    """The engine's opt-in lossy typical acceptance keeps drafts the target would reject: not its distribution."""
    spec = SpecConfig(method="draft_model", k=3, lossy="typical", typical_epsilon=0.5, typical_delta=0.5)
    assert abs(z_of(dec, spec, T1, T1)) > 5


def test_greedy_and_processed_requests_are_not_scored(dec):
    assert output_terms(dec.target, PROMPT, [1, 2], SamplingParams()) == {}
    assert output_terms(dec.target, PROMPT, [1, 2], SamplingParams(temperature=1.0, repetition_penalty=1.2)) == {}
