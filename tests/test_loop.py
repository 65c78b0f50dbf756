"""The one decode loop: stop conditions that complete in the same step, seeded reproducibility
under load, the model interface's guards."""

import pytest
import torch

from conftest import tiny_llama
from specdraft.core.config import SamplingParams
from specdraft.core.tree import DraftTree
from specdraft.drafters.base import Drafter, NoDrafter
from specdraft.engine import Engine, Job, generate, generate_batch

V = 16
PROMPT = [1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=V, layers=2, seed=5)  # greedy: 14 6 8 7 12 11 10 ... (varied letters)


class CharTok:
    """Token i decodes to the letter 'a' + i: enough to test stop strings."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(i)) for i in ids)


class Oracle(Drafter):
    """Drafts the reference continuation (so a step emits several tokens at once); as a tree, a wrong
    first sibling precedes the right chain."""

    name = "oracle"

    def __init__(self, ref: list[int], tree: bool = False, depth: int = 4):
        self.ref, self.tree, self.depth = ref, tree, depth

    def max_draft_depth(self):
        return self.depth

    def propose(self, tokens, max_tokens):
        i = len(tokens) - len(PROMPT)
        chain = self.ref[i : i + max_tokens]
        if not chain:
            return DraftTree.empty()
        if not self.tree:
            return DraftTree.chain(torch.tensor(chain))
        toks = [(chain[0] + 1) % V] + chain
        parents = [-1, -1] + list(range(1, len(chain)))
        return DraftTree(torch.tensor(toks), torch.tensor(parents))


def _reference(target, n=24):
    return generate(target, NoDrafter(), PROMPT, SamplingParams(max_new_tokens=n), eos_ids=set(), tokenizer=CharTok())


def _stop_cases(ref):
    """(sampling, eos ids, expected tokens): a stop string completing at output token j (0-based)
    exactly on the last allowed token, one token before the length limit, and in the same step as an
    EOS token right after it."""
    text, j = ref.text, 4
    stop = text[j - 1 : j + 1]
    assert text.find(stop) == j - 1 and ref.token_ids[j + 1] not in ref.token_ids[: j + 1]
    want = ref.token_ids[: j + 1]
    return [
        (SamplingParams(max_new_tokens=j + 1, stop=[stop]), set(), want),
        (SamplingParams(max_new_tokens=j + 2, stop=[stop]), set(), want),
        (SamplingParams(max_new_tokens=j + 4, stop=[stop]), {ref.token_ids[j + 1]}, want),
    ]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_stop_string_wins_when_the_step_also_ends_by_length_or_eos(target, tree):
    """Defect: a step that completes a stop string and also reaches max_new_tokens (or EOS) returned
    the tokens past the stop with finish "length". Now speculative output == plain decoding's, at
    batch size 1 and inside a batch."""
    ref = _reference(target)
    for sp, eos, want in _stop_cases(ref):
        plain = generate(target, NoDrafter(), PROMPT, sp, eos_ids=eos, tokenizer=CharTok())
        assert plain.token_ids == want and plain.stats.finish_reason == "stop"
        one = generate(target, Oracle(ref.token_ids, tree, depth=6), PROMPT, sp, eos_ids=eos, tokenizer=CharTok())
        assert max(s.emitted for s in one.stats.steps) > 2  # the stop really came inside a multi-token step
        assert (one.token_ids, one.stats.finish_reason, one.text) == (want, "stop", plain.text)
        assert one.stats.new_tokens == len(want)
        jobs = [
            Job(PROMPT, sp, Oracle(ref.token_ids, tree, depth=6)),
            Job([4, 5], SamplingParams(max_new_tokens=9), NoDrafter()),
        ]
        batch = generate_batch(target, jobs, eos_ids=eos, tokenizer=CharTok())
        assert (batch[0].token_ids, batch[0].stats.finish_reason) == (want, "stop")


def test_stream_never_emits_past_a_stop(target):
    ref = _reference(target)
    sp, eos, want = _stop_cases(ref)[1]
    seen = []
    generate(
        target,
        Oracle(ref.token_ids, depth=6),
        PROMPT,
        sp,
        eos_ids=eos,
        tokenizer=CharTok(),
        on_emit=lambda new: seen.extend(new),
    )
    assert seen == want


def test_seeded_sample_does_not_depend_on_other_requests(target):
    """A seeded sampling request gives the same tokens alone and next to 3 other requests, even with a
    batch rule that would shrink drafting at that batch size (seeded rows are exempt)."""
    from specdraft.core.config import SpecConfig
    from specdraft.core.policy import BatchRule
    from specdraft.drafters.prompt_lookup import PromptLookupDrafter

    def drafter():
        return PromptLookupDrafter(SpecConfig(method="prompt_lookup", k=4, max_ngram=2).validate())

    sp = SamplingParams(temperature=1.0, seed=11, max_new_tokens=24)
    alone = generate_batch(target, [Job(PROMPT * 3, sp, drafter())], eos_ids=set(), rule=BatchRule(2, 3))[0]
    others = [Job([3, 4, 3, 4, 3], SamplingParams(max_new_tokens=30), drafter()) for _ in range(3)]
    crowded = generate_batch(
        target, others[:1] + [Job(PROMPT * 3, sp, drafter())] + others[1:], eos_ids=set(), rule=BatchRule(2, 3)
    )
    assert crowded[1].token_ids == alone.token_ids and alone.stats.drafted > 0
    assert all(r.stats.drafted == 0 for i, r in enumerate(crowded) if i != 1)  # the rule did act on the others
    assert alone.stats.reproducible is True


def test_reproducible_flag_names_what_cannot_promise_it(target):
    from specdraft.api import SpecDecoder

    dec = SpecDecoder(target, None)
    sp = {"temperature": 0.7, "seed": 1, "max_new_tokens": 4}
    assert dec.generate(PROMPT, sampling=sp, spec={"method": "token_recycling"}).stats.reproducible is False
    assert (
        dec.generate(PROMPT, sampling=sp, spec={"method": "prompt_lookup", "schedule": "cost_aware"}).stats.reproducible
        is False
    )
    assert dec.generate(PROMPT, sampling=sp, spec={"method": "suffix"}).stats.to_dict()["reproducible"] is True
    assert (
        "reproducible"
        not in dec.generate(PROMPT, sampling={"max_new_tokens": 4}, spec={"method": "suffix"}).stats.to_dict()
    )


def test_engine_rows_are_any_target_model(target):
    """The loop reaches the model only through the model interface (models/base.py)."""
    eng = Engine(target, eos_ids=set())
    row = eng.add(PROMPT, SamplingParams(max_new_tokens=3), NoDrafter())
    while eng.rows:
        eng.step()
    assert row.result.token_ids == _reference(target, 3).token_ids and eng.kv.B == 0


def test_sliding_window_models_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    from specdraft.core.errors import ConfigError
    from specdraft.models.hf import HFModel

    cfg = MistralConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    with pytest.raises(ConfigError, match="sliding-window or hybrid"):
        HFModel(MistralForCausalLM(cfg))
