"""Metric definitions on hand-made step records, and prompt lookup's matching."""

import numpy as np

from specdraft.core.metrics import (
    GenerationStats,
    StepRecord,
    acceptance_rate,
    mean_accepted_tokens,
    per_position_acceptance,
    speedup,
)
from specdraft.drafters.prompt_lookup import find_candidate


def test_metrics_known_answers():
    steps = [StepRecord(4, 4, 5), StepRecord(4, 0, 1), StepRecord(2, 1, 2), StepRecord(0, 0, 1)]
    assert mean_accepted_tokens(steps) == (5 + 1 + 2 + 1) / 4
    assert acceptance_rate(steps) == 5 / 10
    # position 0: drafted in 3 steps, accepted in 2; position 1: drafted in 3, accepted in 1;
    # positions 2 and 3: drafted in 2 steps (the k=4 ones), accepted in 1
    assert per_position_acceptance(steps) == [2 / 3, 1 / 3, 1 / 2, 1 / 2]
    assert acceptance_rate([StepRecord(0, 0, 1)]) is None
    assert mean_accepted_tokens([]) is None
    assert speedup(100, 10.0, 100, 20.0) == 2.0
    assert speedup(50, 10.0, 100, 10.0) == 0.5
    s = GenerationStats(new_tokens=9, wall_s=3.0, steps=steps)
    d = s.to_dict()
    assert d["drafted"] == 10 and d["accepted"] == 5 and d["tokens_per_s"] == 3.0 and d["steps"] == 4
    # token trees: positions are depths (a 6-node tree of depth 3 offers 3 positions)
    trees = [StepRecord(6, 2, 3, depth=3), StepRecord(6, 0, 1, depth=3), StepRecord(3, 1, 2, depth=1)]
    assert per_position_acceptance(trees) == [2 / 3, 1 / 2, 0.0]
    assert mean_accepted_tokens(trees) == 2.0 and acceptance_rate(trees) == 3 / 15


def test_prompt_lookup_matching():
    t = np.array([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7])
    # longest suffix n-gram (3): [5, 6, 7] last seen at index 5 -> continuation [1, 2, 5]
    assert find_candidate(t, 1, 3, 3).tolist() == [1, 2, 5]
    assert find_candidate(t, 1, 3, 10).tolist() == [1, 2, 5, 6, 7]
    assert find_candidate(np.array([1, 2, 3, 4]), 1, 3, 3).tolist() == []
    # falls back to a shorter n-gram
    assert find_candidate(np.array([9, 4, 1, 2, 3, 4]), 1, 3, 2).tolist() == [1, 2]
    assert find_candidate(np.array([3]), 1, 3, 2).tolist() == []
