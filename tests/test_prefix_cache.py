"""The prefix cache (core/prefix_cache.py): a conversation's next turn prefills only what is new, its output
is what a cold run gives (token for token in float32; near-ties only on quantized backends), speculation
never changes what is cached, tenants never share an entry, and the memory budget holds."""

import httpx
import numpy as np
import pytest

from conftest import tiny_llama
from specdraft.api import SpecDecoder
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.prefix_cache import PrefixCache
from specdraft.engine import Job, generate_batch
from stat_util import fit_pvalue

V = 16
METHODS = [
    {"method": "plain"},
    {"method": "prompt_lookup", "k": 4, "min_ngram": 1, "max_ngram": 2},
    {"method": "prompt_lookup", "k": 3, "min_ngram": 1, "max_ngram": 2, "branches": 3},  # a token tree
    {"method": "draft_model", "k": 3},
    {"method": "suffix"},
    {"method": "layer_skip", "skip_layers": [0], "k": 3},  # a view of the target's layers drafts: its own entries
]


class Saved:
    def __init__(self, n, nbytes=10):
        self.n, self.nbytes = n, nbytes


# --- the cache alone ----------------------------------------------------------------------------------
def test_longest_prefix_wins_and_partitions_are_apart():
    c = PrefixCache(1000)
    a, b = Saved(5), Saved(8)
    c.insert([1, 2, 3, 4, 5], a)
    c.insert([1, 2, 9, 9, 9, 9, 9, 9], b)
    assert c.lookup([1, 2, 3, 4, 7, 7]) == (a, 4)
    assert c.lookup([1, 2, 9, 9, 1]) == (b, 4)
    assert c.lookup([5, 5]) is None
    assert c.lookup([1, 2, 3, 4, 5], partition=("other key", None)) is None  # another tenant: nothing
    c.insert([1, 2, 3, 4, 5], Saved(5), partition=("k", "salt"))
    assert c.lookup([1, 2, 3], partition=("k", "other salt")) is None
    assert c.lookup([1, 2, 3], partition=("k", "salt"))[1] == 3
    assert c.stats.hits == 3 and c.stats.hit_tokens == 4 + 4 + 3


def test_an_entry_covered_by_a_longer_one_is_dropped_and_the_budget_holds():
    c = PrefixCache(100)
    c.insert([1, 2, 3], Saved(3))
    c.insert([1, 2, 3, 4, 5], Saved(5))  # the next turn covers the first
    assert c.entries() == [[1, 2, 3, 4, 5]] and c.stats.bytes == 10
    c.insert([1, 2], Saved(2))  # held already
    assert c.entries() == [[1, 2, 3, 4, 5]]
    rng = np.random.default_rng(0)
    for i in range(50):  # many distinct prompts: least recently used leave, the bytes stay within budget
        c.insert([100 + i] + rng.integers(0, 50, 6).tolist(), Saved(7, nbytes=30))
        assert c.stats.bytes <= 100
    assert c.stats.entries == 3 and c.stats.evictions > 0
    c.insert(list(range(9)), Saved(9, nbytes=101))  # larger than the whole budget: not kept
    assert c.stats.entries == 3


# --- the engine with it (transformers, float32) ---------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V, layers=2), tiny_llama(vocab=V, layers=2, noise_seed=5, noise=0.25)


def conversation(dec, spec, turns=3, n=24):
    """A chat replayed as clients send it: each turn the whole history + a new message -> per turn (prompt,
    output, cached tokens)."""
    history, out = [1, 2, 3, 4, 5, 6, 7, 3, 4, 5], []
    for turn in range(turns):
        res = dec.generate(history, SamplingParams(max_new_tokens=n, ignore_eos=True), spec)
        out.append((list(history), res.token_ids, res.stats.cached_tokens))
        history = history + res.token_ids + [9, 10 + turn, 3]
    return out


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: s["method"] + ("_tree" if "branches" in s else ""))
def test_later_turns_hit_and_decode_exactly_as_cold(pair, spec):
    target, draft = pair
    warm = SpecDecoder(target, draft)
    cold = SpecDecoder(target, draft, prefix_cache_mb=0)
    assert cold.prefix_cache is None
    for turn, (prompt, output, cached) in enumerate(conversation(warm, spec)):
        ref = cold.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True), spec)
        assert output == ref.token_ids, f"turn {turn}"
        assert ref.stats.cached_tokens == 0
        # every earlier token was cached: the last turn's prompt, its output but the last token (pending then)
        assert cached == (0 if turn == 0 else len(prompt) - 4), (turn, cached, len(prompt))


def test_speculation_caches_exactly_what_plain_decoding_caches(pair):
    """Only committed tokens enter the cache: after decoding with a drafter that has rejections, the cache holds
    the request's tokens and nothing of its rejected drafts; replaying a conversation with speculation on
    and off gives the same hit tokens."""
    target, draft = pair
    hits, held = {}, {}
    for name, spec in [("plain", METHODS[0]), ("draft_model", METHODS[3]), ("tree", METHODS[2])]:
        dec = SpecDecoder(target, draft)
        turns = conversation(dec, spec)
        hits[name] = dec.prefix_cache.stats.hit_tokens  # the prompts' (a draft model's rows look up uncounted)
        assert hits[name] == sum(cached for _, _, cached in turns)
        steps = dec.generate(turns[-1][0], SamplingParams(max_new_tokens=8, ignore_eos=True), spec).stats.steps
        if name != "plain":
            assert any(s.accepted < s.drafted for s in steps)  # not vacuous: drafts were rejected
        held[name] = dec.prefix_cache.entries()
        prompt, output, _ = turns[-1]
        full = prompt + output
        assert any(e == full[: len(e)] and len(e) >= len(full) - 1 for e in held[name]), held[name]
    assert hits["draft_model"] == hits["plain"] == hits["tree"]
    assert held["draft_model"] == held["plain"] == held["tree"]


def test_an_evicted_prefix_is_never_read_by_the_row_that_started_from_it(pair):
    """Rows keep copies: a budget so small that every new entry evicts the last one, while requests sharing a
    prefix decode together, gives the outputs of cold runs."""
    target, draft = pair
    dec = SpecDecoder(target, draft)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    dec.generate(base, sp, {"method": "plain"})
    one = dec.prefix_cache.stats.bytes
    dec.prefix_cache.budget = int(one * 1.5)  # room for one such entry
    prompts = [base + [t] for t in (3, 4, 5, 6)]
    jobs = [dec.prepare(p, sp, {"method": "plain"}) for p in prompts]
    assert all(j.start is not None and j.start[1] == len(base) for j in jobs)
    eng = dec.new_engine()
    got = []
    for j in jobs:  # each admitted row leaves a longer entry, which evicts the one the others started from
        got.append(generate_batch_on(eng, [j])[0])
        assert dec.prefix_cache.stats.bytes <= dec.prefix_cache.budget
    cold = SpecDecoder(target, draft, prefix_cache_mb=0)
    for p, out in zip(prompts, got):
        assert out.token_ids == cold.generate(p, sp, {"method": "plain"}).token_ids
    assert dec.prefix_cache.stats.evictions > 0


def generate_batch_on(eng, jobs):
    from specdraft.engine import run_one

    return [run_one(eng, j) for j in jobs]


def test_concurrent_requests_sharing_a_prefix(pair):
    target, draft = pair
    dec = SpecDecoder(target, draft)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    base = [2, 3, 4, 5, 6, 7, 8, 9]
    dec.generate(base, sp, {"method": "plain"})
    prompts = [base + [t, t + 1] for t in range(4)]
    jobs = [dec.prepare(p, sp, METHODS[i % 3]) for i, p in enumerate(prompts)]
    assert all(j.start is not None for j in jobs)
    eng = dec.new_engine()
    rows = eng.add_many(jobs)  # admitted together: one prefill of their new tokens
    while eng.rows:
        eng.step()
    cold = SpecDecoder(target, draft, prefix_cache_mb=0)
    for p, row in zip(prompts, rows):
        assert row.outcome().token_ids == cold.generate(p, sp, {"method": "plain"}).token_ids


def exact_first_two(target, prompt, sp):
    from conftest import logits_of
    from specdraft.core.sampling import probs_from_logits

    p1 = probs_from_logits(logits_of(target, prompt)[-1], sp).double()
    joint = np.zeros((V, V))
    for a in range(V):
        joint[a] = (p1[a] * probs_from_logits(logits_of(target, prompt + [a])[-1], sp).double()).numpy()
    return joint


@pytest.mark.parametrize("broken", [False, True], ids=["cached", "wrong_prefix"])
def test_sampling_after_a_hit_matches_the_target(pair, broken):
    """Rows that start from a cached prefix sample the target's exact distribution (draft model, T=1); a row
    started from another prompt's keys and values (a cache bug) fails the same test."""
    target, draft = pair
    prompt = [1, 2, 3, 1, 2, 5, 6]
    rows = target.new_rows()
    rows.add_rows([([4, 4, 4, 4, 4, 4] if broken else prompt[:-1]) + [7, 8]])  # an entry longer than the prompt
    start = (rows.save_prefix(0), len(prompt) - 1)
    dec = SpecDecoder(target, draft)
    sp = SamplingParams(temperature=1.0, max_new_tokens=2)
    spec = SpecConfig(method="draft_model", k=3)
    counts = np.zeros((V, V))
    for first in range(0, 2000, 250):
        jobs = [
            Job(prompt, SamplingParams(**{**sp.to_dict(), "seed": 7000 + i}), dec.make_drafter(spec), start=start)
            for i in range(first, first + 250)
        ]
        for out in generate_batch(target, jobs, eos_ids=set(), isolate_seeded=False):
            assert out.stats.cached_tokens == len(prompt) - 1
            counts[tuple(out.token_ids[:2])] += 1
    p = fit_pvalue(counts, exact_first_two(target, prompt, sp))
    assert (p < 1e-6) if broken else (p > 1e-3), p


# --- the server: tenants, usage, metrics --------------------------------------------------------------
class StubTok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_server_reports_cached_tokens_and_keeps_tenants_apart(pair):
    from server_util import running_server

    t = tiny_llama(vocab=V)
    t.tokenizer = StubTok()
    with running_server(SpecDecoder(t, None), api_key=("alice", "bob")) as (url, app):

        def ask(key, prompt, **extra):
            r = httpx.post(
                url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True, **extra},
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            return r.json()

        first = list(range(1, 15))
        a1 = ask("alice", first)
        assert a1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        follow = first + [int(x) for x in a1["choices"][0]["text"].split()] + [3, 4]
        assert ask("alice", follow)["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first) + 5
        assert ask("bob", follow)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # another key
        assert ask("alice", follow, cache_salt="s1")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert ask("alice", follow + [5], cache_salt="s1")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": first, "cache_salt": 3},
            headers={"Authorization": "Bearer alice"},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        m = httpx.get(url + "/metrics", headers={"Authorization": "Bearer alice"}, timeout=60).text
        assert "specdraft_prefix_cache_hit_tokens_total" in m and "specdraft_prefix_cache_bytes" in m


@pytest.mark.slow
def test_a_real_model_in_float32_decodes_exactly_as_cold(smol_f32):
    """SmolLM2-135M in float32 (transformers): every turn token-identical to a cold run, with speculation."""
    from backend_util import check_conversation_after_hits

    assert check_conversation_after_hits(smol_f32, METHODS[1], "hf float32", n=32) == []


def test_a_draft_models_rows_start_from_their_own_cached_prefix(pair):
    """The draft model's rows leave what they computed under the draft's own partition and a later turn's
    draft rows start from it (the draft model prefills only what is new too); outputs stay a cold run's."""
    target, draft = pair
    dec = SpecDecoder(target, draft)
    turns = conversation(dec, METHODS[3])
    held = dec.prefix_cache.entries((None, "draft", draft))
    assert held and max(map(len, held)) >= len(turns[-1][0])
    looked = []
    real = dec.prefix_cache.lookup

    def spy(tokens, partition=None, counted=True):
        out = real(tokens, partition, counted)
        looked.append((partition, None if out is None else out[1]))
        return out

    dec.prefix_cache.lookup = spy
    prompt = turns[-1][0] + turns[-1][1] + [4, 4]
    dec.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True), METHODS[3])
    draft_hits = [m for p, m in looked if p == (None, "draft", draft)]
    assert draft_hits and draft_hits[0] >= len(turns[-1][0])


def test_a_layer_view_skipping_a_middle_layer_starts_from_its_own_prefix():
    """A view of layers 0 and 2 of a 3-layer target (layer_skip) caches and loads exactly the layers it has."""
    target = tiny_llama(vocab=V, layers=3)
    spec = {"method": "layer_skip", "skip_layers": [1], "k": 3}
    warm, cold = SpecDecoder(target), SpecDecoder(target, prefix_cache_mb=0)
    for turn, (prompt, output, cached) in enumerate(conversation(warm, spec)):
        assert (cached > 0) == (turn > 0)
        assert output == cold.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True), spec).token_ids
