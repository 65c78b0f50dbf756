"""The overlapped draft/verify pair (specdraft/scale/overlap.py) on a local Ray instance: SmolLM2-135M fp32
verifying, its first 26 (of 30) layers drafting, in two actor processes. Overlapped and in turns, the output is
token-identical to the target's plain greedy decoding; the run has both hits (drafts made while the
target verified) and misses; the time model adds up as its docstring says."""

from __future__ import annotations

import pytest

from specdraft.api import SpecDecoder
from specdraft.errors import ConfigError
from specdraft.models.hf import HFModel
from specdraft.scale.overlap import OverlapPair, _cut, model_time, ratio_k

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n    ", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"]
N = 24


@pytest.fixture(scope="module")
def pair():
    p = OverlapPair("smollm2-135m", "smollm2-135m", dtype="float32", k=3, draft_layers=26)
    yield p
    p.close()
    p.ray.shutdown()


def test_overlap_is_plain_greedy(pair, smol_f32):
    ref = SpecDecoder(HFModel(smol_f32.model, smol_f32.tokenizer, name="smol"))
    hits = misses = 0
    for prompt in PROMPTS:
        ids = ref.encode(prompt)
        want = ref.generate(ids, sampling={"max_new_tokens": N}, spec={"method": "plain"}).token_ids
        for overlap in (True, False):
            r = pair.generate(ids, N, overlap=overlap)
            assert r.token_ids == want, (prompt, overlap)
            if overlap:
                hits += sum(h for _, h in r.steps)
                misses += sum(not h for _, h in r.steps)
            else:
                assert not any(h for _, h in r.steps)
    assert hits and misses  # both paths ran


def test_model_time_adds_up(pair):
    c = pair.costs([4], threads=1)
    assert c["target_ms"][4] > 0 and c["draft_ms"] > 0 and c["rtt_ms"] > 0
    costs = {"target_ms": {4: 10.0}, "draft_ms": 3.0, "rtt_ms": 1.0}
    assert model_time([(3, False)] * 3, 3, costs, overlap=False) == pytest.approx(3 * (9 + 10 + 1) / 1000)
    steps = [(3, False), (3, True), (1, True)]
    # overlapped: a step keeping all 3 lasts max(10, 4 * 3) = 12 ms; one keeping fewer stops the drafter
    # (10 + 3 / 2 ms); the first step's drafts (not a hit) add 9 ms
    assert model_time(steps, 3, costs, overlap=True) == pytest.approx((9 + 12 + 12 + 11.5 + 3) / 1000)


def test_ratio_k():
    costs = {"target_ms": {2: 100.0, 3: 105.0, 4: 110.0, 5: 115.0}, "draft_ms": 40.0}
    assert ratio_k(costs) == 2  # 3 ahead tokens (120 ms) fit a 3-token verification (105 ms, 15% slack); 4 do not
    assert ratio_k({**costs, "draft_ms": 90.0}) == 1  # a drafter as slow as the target: the least k
    assert ratio_k({**costs, "draft_ms": 10.0}) == 4


def test_cut_like_plain():
    assert _cut([5, 6, 2, 7], 10, {2}) == [5, 6, 2]
    assert _cut([5, 6, 7], 2, {2}) == [5, 6]


def test_pair_needs_one_tokenizer():
    with pytest.raises(ConfigError, match="one tokenizer"):
        OverlapPair("qwen2.5-coder-1.5b", "smollm2-135m")
