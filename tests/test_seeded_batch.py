"""A seeded sampling request emits the same tokens alone and in any batch (docs/server.md, ``seed``).

SmolLM2-135M, float32 on transformers and Q4_1 on llama.cpp; plain, prompt lookup (a chain) and prompt
lookup with branches (a token tree) rows, seeded, decoded alone and then in batch layouts: next to one
other row, next to three (one of them leaving after a few tokens, which frees llama.cpp cells that later
tokens take), and with the other rows joining part way. The seeded row's tokens must be identical in
every layout, and so must the target's logits it was verified with, bit for bit: a shared forward
rounds differently (a 4-row matmul is not a 1-row one), which flips a sample only now and then, so the
logits show what the tokens would show on a longer run.
"""

import pytest
import torch

from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine, Job

pytestmark = pytest.mark.slow

NEW = 32
SEEDED = {  # method: (prompt, seed, drafter config; None: plain)
    "plain": ("Once upon a time, in a small village by the sea,", 1, None),
    "prompt_lookup": (
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
        2,
        SpecConfig(method="prompt_lookup", k=4, max_ngram=2).validate(),
    ),
    "tree": (
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
        3,
        SpecConfig(method="prompt_lookup", k=3, max_ngram=2, branches=3).validate(),
    ),
}
OTHERS = [("Write a list of ten fruits:", 5), ("def fibonacci(n):", 24), ("The history of Rome begins", 16)]


@pytest.fixture(params=["hf", "llama"])
def target(request):
    if request.param == "llama":
        pytest.importorskip("llama_cpp")
        return request.getfixturevalue("smol_gguf")
    return request.getfixturevalue("smol_f32")


def seeded_job(target, method, log):
    prompt, seed, spec = SEEDED[method]
    drafter = NoDrafter() if spec is None else PromptLookupDrafter(spec)
    observe = drafter.observe

    def spy(step):  # the target's logits this row was verified with, each step
        log.append(step.logits.clone())
        observe(step)

    drafter.observe = spy
    sp = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=NEW, ignore_eos=True)
    return Job(_ids(target, prompt), sp, drafter)


def other_job(target, i):
    prompt, n = OTHERS[i]
    drafter = NoDrafter() if i % 2 else PromptLookupDrafter(SpecConfig(method="prompt_lookup", k=3).validate())
    return Job(_ids(target, prompt), SamplingParams(temperature=0.8, max_new_tokens=n, ignore_eos=True), drafter)


def _ids(target, text):
    return target.tokenizer(text, add_special_tokens=False)["input_ids"]


def decode(target, layout: list[tuple[int, Job]]) -> list:
    """Jobs joining at their step (those of one step admitted together, as the server does); -> rows."""
    eng = Engine(target)
    rows: list = [None] * len(layout)
    step = 0
    while any(r is None for r in rows) or eng.rows:
        now = [i for i, (at, _) in enumerate(layout) if at == step]
        for i, row in zip(now, eng.add_many([layout[i][1] for i in now])):
            rows[i] = row
        eng.step()
        step += 1
    return rows


def test_seeded_rows_equal_alone_in_every_layout(target):
    methods = list(SEEDED)
    alone, steps = {}, {}
    for m in methods:
        log: list = []
        (row,) = decode(target, [(0, seeded_job(target, m, log))])
        alone[m] = (row.result.token_ids, log)
        steps[m] = row.stats.steps
    assert sum(s.accepted for s in steps["prompt_lookup"]) > 0  # its drafts were verified, some kept
    assert any(s.depth is not None for s in steps["tree"])  # it drafted token trees
    layouts = {
        "plain and prompt lookup, a pair": [(0, "plain"), (0, "prompt_lookup")],
        "tree + 1 other": [(0, "tree"), (0, 1)],
        "all three + 1 leaving early": [(0, m) for m in methods] + [(0, 0)],
    }
    layouts["others join part way"] = [(0, "plain"), (0, "tree"), (3, 0), (3, 1), (6, 2), (6, "prompt_lookup")]
    for name, layout in layouts.items():
        logs = {m: [] for m in methods}
        jobs = [
            (at, seeded_job(target, x, logs[x]) if isinstance(x, str) else other_job(target, x)) for at, x in layout
        ]
        rows = decode(target, jobs)
        for (_, x), row in zip(layout, rows):
            if not isinstance(x, str):
                continue
            tokens, log = alone[x]
            assert row.result.token_ids == tokens, f"{name}: {x} row differs from alone"
            assert len(logs[x]) == len(log) and all(torch.equal(a, b) for a, b in zip(logs[x], log)), (
                f"{name}: {x} row was verified with other logits than alone"
            )
            assert row.stats.reproducible is True


def test_neither_lane_waits_for_the_other(target):
    """A seeded row's own lane and the shared lane both advance on every step: each row gets a step record
    (and at least one token) in every step it is in, so neither a seeded request nor the batch it left can be
    starved by the other (docs/server.md measures what the lane costs the batch)."""
    log: list = []
    eng = Engine(target)
    rows = eng.add_many([seeded_job(target, "prompt_lookup", log)] + [other_job(target, i) for i in range(3)])
    assert rows[0].own_lane and not any(r.own_lane for r in rows[1:])
    lived = [0] * len(rows)
    while eng.rows:
        alive = [r in eng.rows for r in rows]
        before = [len(r.output) for r in rows]
        eng.step()
        for i, r in enumerate(rows):
            if alive[i]:
                lived[i] += 1
                assert len(r.output) > before[i], f"row {i} emitted nothing in a step it was in"
    assert [len(r.stats.steps) for r in rows] == lived
