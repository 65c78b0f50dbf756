"""The draft model in a Ray actor of its own (method remote_draft, drafters/remote_draft.py) on a local Ray
instance: SmolLM2-135M fp32 verifying in this process, its first 26 (of 30) layers drafting in the actor.
Drafting ahead and in turns, one request or several batched, the output is token-identical to the
target's plain greedy decoding; the runs have both hits (blocks drafted while the target verified) and
misses; the time model of ``specdraft overlap`` adds up as its docstring says."""

from __future__ import annotations

import pytest

from specdraft.api import SpecDecoder, load_draft
from specdraft.bench.overlap import model_time
from specdraft.core.config import SamplingParams
from specdraft.core.errors import ConfigError
from specdraft.drafters.remote_draft import PREFETCHED
from specdraft.engine import Job, generate_batch

pytestmark = [pytest.mark.slow, pytest.mark.long]

PROMPTS = ["def fibonacci(n):\n    ", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", "The capital of France is"]
N = 24


@pytest.fixture(scope="module")
def dec(smol_f32):
    d = SpecDecoder(smol_f32, load_draft(smol_f32, "smollm2-135m", "smollm2-135m", "float32", 26, "hf"))
    yield d
    from specdraft.scale.cluster import connect

    connect().shutdown()


def _spec(prefetch: bool) -> dict:
    return {"method": "remote_draft", "k": 3, "prefetch": prefetch}


def test_remote_draft_is_plain_greedy(dec):
    """Output == plain greedy; drafts == the in-process draft model's (the same model drafting from the same
    context: a stale actor cache would draft otherwise), so the same count is accepted."""
    arms = []
    for prompt in PROMPTS[:2]:
        ids = dec.encode(prompt)
        want = dec.generate(ids, sampling={"max_new_tokens": N}, spec={"method": "plain"}).token_ids
        local = dec.generate(ids, sampling={"max_new_tokens": N}, spec={"method": "draft_model", "k": 3}).stats
        for prefetch in (True, False):
            r = dec.generate(ids, sampling={"max_new_tokens": N}, spec=_spec(prefetch))
            assert r.token_ids == want, (prompt, prefetch)
            assert (r.stats.accepted, len(r.stats.steps)) == (local.accepted, len(local.steps)), (prompt, prefetch)
            if prefetch:
                arms += [s.arm for s in r.stats.steps]
            else:
                assert PREFETCHED not in (r.stats.arms or {})
    assert PREFETCHED in arms and "drafted" in arms[1:]  # both paths ran


def test_remote_draft_rows_batch(dec):
    """Three requests decoded together (staggered joins, one leaving early) equal batch-size-1 plain."""
    ids = [dec.encode(p) for p in PROMPTS]
    lens = [N, 10, 18]
    want = [
        dec.generate(i, sampling={"max_new_tokens": n}, spec={"method": "plain"}).token_ids for i, n in zip(ids, lens)
    ]
    spec = dec.usable(dec_spec(_spec(True)))
    jobs = [Job(i, SamplingParams(max_new_tokens=n), dec.make_drafter(spec)) for i, n in zip(ids, lens)]
    out = generate_batch(dec.target, jobs, eos_ids=dec.target.eos_token_ids(), join_every=2)
    assert [r.token_ids for r in out] == want


def dec_spec(d: dict):
    from specdraft.core.config import SpecConfig

    return SpecConfig.from_dict(d).validate()


def test_remote_draft_refusals(dec, smol_f32):
    with pytest.raises(ConfigError, match="used by method 'remote_draft' only"):
        dec_spec({"method": "draft_model", "prefetch": False})
    with pytest.raises(ConfigError, match="remote_threads"):
        dec_spec({"method": "remote_draft", "remote_threads": 0})
    d = SpecDecoder(smol_f32, load_draft(smol_f32, "smollm2-135m", "self:int8", "float32", None, "hf"))
    with pytest.raises(ConfigError, match="loads the draft by its name"):
        d.make_drafter(dec_spec({"method": "remote_draft"}))


def test_explain_reads_the_bench_records():
    """The measured decode time is each run's wall time less its prefill (the engine's records); results
    without a prefill time are refused with a message, not a KeyError."""
    from specdraft.bench.overlap import explain
    from specdraft.core.errors import SpecDraftError

    rec = {
        "method": "pair_overlap",
        "steps": [[3, 3, 3], [3, 1, 1]],
        "hits": [False, True],
        "new_tokens": 6,
        "wall_s": 1.0,
        "prefill_s": 0.25,
    }
    costs = {"target_ms": {1: 10.0, 4: 10.0}, "draft_ms": 3.0, "rtt_ms": 1.0}
    m = explain({"records": [rec]}, costs, costs, 3)["methods"]["pair_overlap"]
    assert m["decode_s_measured"] == pytest.approx(0.75) and m["hits"] == 1 and m["tokens"] == 6
    del rec["prefill_s"]
    with pytest.raises(SpecDraftError, match="record no prefill time"):
        explain({"records": [rec]}, costs, costs, 3)


def test_model_time_adds_up():
    costs = {"target_ms": {4: 10.0}, "draft_ms": 3.0, "rtt_ms": 1.0}
    assert model_time([(3, False)] * 3, 3, costs, overlap=False) == pytest.approx(3 * (9 + 10 + 1) / 1000)
    steps = [(3, False), (3, True), (1, True)]
    # overlapped: a step keeping all 3 lasts max(10, 4 * 3) = 12 ms; one keeping fewer stops the drafter
    # (10 + 3 / 2 ms); the first step's drafts (not a hit) add 9 ms
    assert model_time(steps, 3, costs, overlap=True) == pytest.approx((9 + 12 + 12 + 11.5 + 3) / 1000)
