"""Greedy exactness of the model-free drafters on SmolLM2-135M float32: token-identical to plain."""

import pytest

from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.drafters import datastore as ds
from test_greedy_real import PROMPTS

pytestmark = pytest.mark.slow
NEW = 32  # at most conftest.smol_reference's (test_greedy_real.NEW)


@pytest.fixture(scope="module")
def smol(smol_dec):
    return smol_dec


@pytest.fixture(scope="module")
def reference(smol_reference):
    """The shared plain greedy reference (conftest.smol_reference), cut to this file's NEW tokens."""
    return {p: ids[:NEW] for p, ids in smol_reference.items()}


@pytest.fixture(scope="module")
def store(smol, reference, tmp_path_factory):
    """A global store holding the plain outputs of half the prompts (and their prompts)."""
    docs = [smol.encode(p, chat=True) + reference[p] for p in PROMPTS[::2]]
    path = tmp_path_factory.mktemp("store") / "s"
    meta = {
        "target": "smollm2-135m",
        "vocab_size": len(smol.tokenizer),
        "tokenizer_sha256": ds.tokenizer_sha256(smol.tokenizer),
    }
    ds.build(docs, path, meta)
    return str(path)


CONFIGS = {
    "suffix": dict(method="suffix", k=8),
    "suffix_store": dict(method="suffix", k=8, datastore="STORE"),
    "token_recycling": dict(method="token_recycling", recycle_branching=[4, 2, 1]),
    "lookahead": dict(method="lookahead", lookahead_window=4, lookahead_ngram=3, lookahead_max_ngrams=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_free_greedy_exact(smol, reference, store, name):
    d = dict(CONFIGS[name])
    if d.get("datastore") == "STORE":
        d["datastore"] = store
    spec = SpecConfig.from_dict(d)
    sp = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    accepted = drafted = 0
    for p in PROMPTS[:3] + PROMPTS[5:6]:  # two in the store, one not, one that repeats itself (CI time: 4 of 7)
        out = smol.generate(p, sampling=sp, spec=spec, chat=True)
        assert out.token_ids == reference[p], f"{name} diverged on {p!r}"
        accepted += out.stats.accepted
        drafted += out.stats.drafted
    print(f"{name}: accepted {accepted} of {drafted} drafted")
    assert 0 < accepted < drafted
