"""A draft with another tokenizer (drafters/cross_vocab.py), on tiny models with two toy vocabularies:
greedy is token-identical to plain; sampling by token-level intersection follows the exact target
distribution, and a variant whose q is not renormalized over the intersection is caught."""

import numpy as np
import pytest
import torch

from conftest import logits_of, tiny_llama
from specdraft.api import SpecDecoder
from specdraft.core.config import SamplingParams
from specdraft.core.errors import ConfigError
from specdraft.drafters.cross_vocab import CrossVocabDrafter, VocabBridge
from stat_util import fit_pvalue, sample_first_tokens

TARGET_VOCAB = list("abcdef") + ["gg", "hh"]
DRAFT_VOCAB = list("abcdefgh") + ["ab", "cd"]  # the intersection: a to f (gg and hh are two draft tokens)
PROMPT = [0, 1, 2, 0, 1]
V = len(TARGET_VOCAB)


class ToyTok:
    """Greedy longest-match tokenization over a fixed list of strings (a character no piece starts
    with is dropped: the target's cannot write a lone g, which the draft may propose)."""

    chat_template = None
    eos_token_id = None

    def __init__(self, pieces):
        self.pieces = pieces
        self.ids = {p: i for i, p in enumerate(pieces)}

    def __len__(self):
        return len(self.pieces)

    def get_vocab(self):
        return dict(self.ids)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[int(i)] for i in ids)

    def __call__(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            p = max((p for p in self.pieces if text.startswith(p, i)), key=len, default=None)
            if p is not None:
                out.append(self.ids[p])
            i += len(p) if p else 1
        return {"input_ids": out}


@pytest.fixture(scope="module")
def dec():
    t = tiny_llama(vocab=V, scale=6.0)
    t.tokenizer = ToyTok(TARGET_VOCAB)
    d = tiny_llama(vocab=len(DRAFT_VOCAB), seed=3, scale=6.0)
    d.tokenizer = ToyTok(DRAFT_VOCAB)
    return SpecDecoder(t, d)


def test_bridge_intersection(dec):
    b = dec.vocab_bridge()
    assert dec.cross_vocab and isinstance(b, VocabBridge)
    assert sorted(zip(b.draft_ids.tolist(), b.target_ids.tolist())) == [(i, i) for i in range(6)]


@pytest.mark.parametrize(
    "extra",
    [
        {"k": 1},
        {"k": 3},
        {"k": 5},
        {"k": 5, "confidence_threshold": 0.5},
        {"k": 2, "schedule": "heuristic", "max_k": 8},
    ],
)
def test_greedy_is_token_identical(dec, extra):
    """Every draft length (fixed, heuristic) and the confidence rule, which stops mid-draft after
    feeding a token it does not keep."""
    lengths = set()
    for prompt in (PROMPT, [7, 6, 7, 6], [3]):
        sp = {"max_new_tokens": 30, "ignore_eos": True}
        plain = dec.generate(prompt, sampling=sp, spec={"method": "plain"}).token_ids
        out = dec.generate(prompt, sampling=sp, spec={"method": "draft_model", **extra})
        assert out.token_ids == plain
        assert sum(s.drafted for s in out.stats.steps) > 0
        lengths |= {s.drafted for s in out.stats.steps}
    if "confidence_threshold" in extra or "schedule" in extra:
        assert len(lengths) > 1, lengths  # the rule changed the draft length
    if "schedule" in extra:
        assert max(lengths) > extra["k"]  # the heuristic schedule grows past k


def test_a_confidence_stop_proposes_a_prefix_of_the_full_draft(dec):
    """Stopping early (after feeding a token it then drops) proposes the start of the same greedy draft."""
    from specdraft.core.config import SamplingParams as SP

    full, cut = [], []
    for prompt in (PROMPT, [7, 6, 7, 6], [3], [0, 1, 2, 3, 4, 5, 6]):
        for thr, out in ((0.0, full), (0.5, cut)):
            d = dec.make_drafter(dec_spec(k=6, confidence_threshold=thr))
            d.begin(prompt, SP(), torch.Generator())
            out.append(d.propose(list(prompt), 6).tokens.tolist())
    assert any(len(c) < len(f) for f, c in zip(full, cut)), (full, cut)
    assert all(f[: len(c)] == c for f, c in zip(full, cut)), (full, cut)


def exact_first_two(target) -> np.ndarray:
    def dist(seq):
        return torch.softmax(logits_of(target, seq)[-1].double(), -1)

    p1 = dist(PROMPT)
    return np.stack([(p1[a] * dist(PROMPT + [a])).numpy() for a in range(V)])


SAMPLED = SamplingParams(temperature=1.0)


def _unnormalized(orig):
    """Broken: q is the draft's full distribution restricted to the intersection, not renormalized
    (what the draft samples from, through multinomial, is still the renormalized one)."""

    def q(self, draft_logits, history):
        full = torch.softmax(draft_logits.float(), -1)
        out = torch.zeros(self.target_vocab)
        out[self.bridge.target_ids] = full[self.bridge.draft_ids]
        return out

    return q


@pytest.mark.parametrize("broken,threshold", [(False, 0.0), (False, 0.3), (True, 0.0)])
def test_sampling_follows_the_target(dec, broken, threshold, monkeypatch):
    if broken:
        monkeypatch.setattr(CrossVocabDrafter, "_intersection_q", _unnormalized(CrossVocabDrafter._intersection_q))
    spec = dec_spec(k=3, confidence_threshold=threshold)
    counts, drafted, accepted = sample_first_tokens(
        dec.target, lambda: dec.make_drafter(spec), PROMPT, SAMPLED, 4, 2, 2000, V, 40_000
    )
    assert 0 < accepted < drafted
    p = fit_pvalue(counts, exact_first_two(dec.target))
    assert (p < 1e-3) if broken else (p > 1e-3), p


def dec_spec(**kw):
    from specdraft.core.config import SpecConfig

    return SpecConfig(method="draft_model", **kw)


def test_a_draft_that_cannot_write_the_targets_text_is_refused():
    from specdraft.core.errors import TokenizerMismatchError

    t = tiny_llama(vocab=V)
    t.tokenizer = ToyTok(TARGET_VOCAB)
    d = tiny_llama(vocab=4, seed=3)
    d.tokenizer = ToyTok(list("abcd"))
    with pytest.raises(TokenizerMismatchError, match="cannot write the target's text"):
        SpecDecoder(t, d)


def test_trees_and_cascade_are_refused(dec):
    for spec in ({"method": "draft_model", "tree": "dynamic"}, {"method": "cascade"}):
        with pytest.raises(ConfigError, match="drafts chains through text"):
            dec.generate(PROMPT, sampling={"max_new_tokens": 2}, spec=spec)
