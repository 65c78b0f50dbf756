"""Per-row fault isolation: an exception inside one row's own work (its drafter, its processing) fails
that request only; the other rows of the batch decode on, token-identical to decoding alone."""

import pytest

from conftest import tiny_llama
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.drafters.base import NoDrafter
from specdraft.drafters.draft_model import DraftModelDrafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter
from specdraft.engine import Engine, generate

V = 8
PROMPTS = [[1, 2, 3, 1, 2], [4, 5, 6, 7], [0, 1, 0, 1, 0, 1]]


class Faulty(PromptLookupDrafter):
    """Prompt lookup that raises in ``where`` on its ``at``-th call."""

    def __init__(self, where: str, at: int = 3):
        super().__init__(SpecConfig(method="prompt_lookup", k=3, min_ngram=1).validate())
        self.where, self.at, self.calls = where, at, 0

    def _tick(self, name):
        if name == self.where:
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError(f"injected fault in {name}")

    def propose(self, tokens, max_tokens):
        self._tick("propose")
        return super().propose(tokens, max_tokens)

    def observe(self, step):
        self._tick("observe")
        return super().observe(step)


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V), tiny_llama(vocab=V, noise_seed=5, noise=0.25)


@pytest.mark.parametrize("where", ["propose", "observe"])
def test_a_failing_row_leaves_the_others_exact(pair, where):
    target, draft = pair
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    alone = [generate(target, NoDrafter(), p, sp, eos_ids=set()).token_ids for p in PROMPTS]
    eng = Engine(target, eos_ids=set())
    good = [
        eng.add(PROMPTS[0], sp, DraftModelDrafter(draft, SpecConfig(method="draft_model", k=3).validate(), V)),
        eng.add(PROMPTS[2], sp, PromptLookupDrafter(SpecConfig(method="prompt_lookup", k=3, min_ngram=1).validate())),
    ]
    bad = eng.add(PROMPTS[1], sp, Faulty(where))
    finished = []
    while eng.rows:
        finished += eng.step()
    assert bad.finish == "error" and isinstance(bad.error, RuntimeError) and bad in finished
    assert bad.result.stats.finish_reason == "error"
    assert [r.result.token_ids for r in good] == [alone[0], alone[2]]
    assert all(r.error is None for r in good)
    with pytest.raises(RuntimeError, match="injected fault"):  # the library's single request still raises
        generate(target, Faulty(where), PROMPTS[1], sp, eos_ids=set())
