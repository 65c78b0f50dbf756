"""Model-free drafters: suffix automaton + datastore (suffix), Token Recycling, lookahead.

Known answers and properties on the data structures, exactness through the engine on a tiny
random model; greedy exactness on SmolLM2 is in test_model_free_real.py (slow).
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import logits_of, tiny_llama
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ConfigError, DatastoreError
from specdraft.drafters import datastore as ds
from specdraft.drafters.base import NoDrafter, StepOutcome
from specdraft.drafters.lookahead import LookaheadDrafter
from specdraft.drafters.suffix import (
    SuffixAutomaton,
    SuffixDrafter,
    brute_force_match_len,
    continuation_paths,
    count_tree,
)
from specdraft.drafters.token_recycling import AdjacencyTable, TokenRecyclingDrafter, expand, static_tree
from specdraft.engine import generate

V = 8
PROMPT = [1, 2, 3, 1, 2]


def brute_end_positions(tokens, m):
    suf = tokens[len(tokens) - m :]
    return [e for e in range(m - 1, len(tokens) - 1) if tokens[e - m + 1 : e + 1] == suf]


# --- suffix automaton ---------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=80), st.integers(1, 4))
def test_suffix_automaton_matches_brute_force(tokens, vocab):
    tokens = [t % vocab for t in tokens]
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.extend(t)
        prefix = tokens[: i + 1]
        m = sam.match_len()
        assert m == brute_force_match_len(prefix)
        if m:
            assert sorted(sam.end_positions(sam.match_state(), 10**6)) == brute_end_positions(prefix, m)


def test_suffix_automaton_known_answers():
    sam = SuffixAutomaton()
    sam.extend_many([5, 6, 7, 5, 6])
    assert sam.match_len() == 2 and sam.end_positions(sam.match_state(), 10) == [1]
    sam.extend(9)
    assert sam.match_len() == 0
    sam.extend_many([5, 6, 7])
    assert sam.match_len() == 3 and sam.end_positions(sam.match_state(), 10) == [2]
    # the most recent occurrences are kept when there are more than the limit
    sam = SuffixAutomaton()
    sam.extend_many([1, 2] * 6 + [1])
    assert sam.end_positions(sam.state_of_len(1), 3) == [10, 8, 6]


def test_suffix_automaton_is_linear():
    """Amortized O(1) per token: states <= 2n and total transitions <= 3n on a repetitive text."""
    sam = SuffixAutomaton()
    toks = ([1, 2, 3] * 300 + [4, 1, 2] * 300 + list(range(50))) * 3
    sam.extend_many(toks)
    n = len(toks)
    assert len(sam.length) <= 2 * n and sum(len(d) for d in sam.next) <= 3 * n


# --- count trie -------------------------------------------------------------------------------
def test_count_tree_known_answer():
    paths = np.array([[1, 2, 3], [1, 2, 4], [1, 5, -1], [2, 2, 2]])
    tok, par, score = count_tree(paths, budget=10, min_prob=0.0)
    assert tok.tolist() == [1, 2, 2, 5, 2, 3, 4, 2]
    assert par.tolist() == [-1, 0, -1, 0, 2, 1, 1, 4]
    assert score.tolist() == [0.75, 0.5, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25]
    tok, par, score = count_tree(paths, budget=3, min_prob=0.0)
    assert tok.tolist() == [1, 2, 2] and par.tolist() == [-1, 0, -1]
    tok, par, score = count_tree(paths, budget=10, min_prob=0.5)
    assert tok.tolist() == [1, 2] and par.tolist() == [-1, 0]


def test_continuation_paths_stop_at_separator_and_end():
    t = np.array([3, 4, 5, -1, 6, 7])
    assert continuation_paths(t, np.array([0, 4]), 3).tolist() == [[4, 5, -1], [7, -1, -1]]


# --- datastore --------------------------------------------------------------------------------
def brute_lookup(flat, ctx, depth):
    m = 0
    for L in range(1, min(len(ctx), depth) + 1):
        pat = ctx[len(ctx) - L :]
        if any(flat[s : s + L] == pat for s in range(len(flat))):
            m = L
        else:
            break
    ends = [] if m == 0 else [s + m - 1 for s in range(len(flat)) if flat[s : s + m] == ctx[len(ctx) - m :]]
    return m, sorted(ends)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=25), min_size=1, max_size=8),
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=5),
)
def test_datastore_lookup_matches_brute_force(tmp_path_factory, docs, contexts):
    store = ds.build(docs, tmp_path_factory.mktemp("store"), sort_depth=8)
    flat = ds.concat_docs(docs).tolist()
    for ctx in contexts:
        m, ends = store.lookup(ctx, 10**6)
        assert (m, sorted(ends.tolist())) == brute_lookup(flat, ctx, 8)


def test_suffix_array_sorted():
    rng = np.random.default_rng(1)
    t = ds.concat_docs([rng.integers(0, 5, 200) for _ in range(5)])
    sa = ds.suffix_array(t, sort_depth=1000)
    suffixes = [t[s:].tolist() for s in sa]
    assert suffixes == sorted(suffixes)


def test_datastore_round_trip_and_sampling(tmp_path):
    docs = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 1, 2, 3, 4, 4]]
    store = ds.build(docs, tmp_path / "s", meta={"target": "toy", "vocab_size": 8}, sort_depth=16)
    again = ds.Datastore(tmp_path / "s", vocab_size=8)
    assert again.tokens.tolist() == [1, 2, 3, 4, -1, 1, 2, 3, 5, -1, 7, 1, 2, 3, 4, 4, -1]
    assert np.array_equal(again.sa, store.sa) and again.meta["n_docs"] == 3 and again.sort_depth == 16
    m, ends = again.lookup([9, 1, 2, 3], 10)
    assert m == 3 and sorted(ends.tolist()) == [2, 7, 13]
    m, ends = again.lookup([9, 1, 2, 3], 2)  # evenly sampled from the suffix array range
    assert m == 3 and ends.shape == (2,)
    with pytest.raises(DatastoreError, match="vocabulary of 8 tokens; the target has 6"):
        ds.Datastore(tmp_path / "s", vocab_size=6)
    with pytest.raises(DatastoreError, match="another tokenizer"):
        ds.build(docs, tmp_path / "h", meta={"tokenizer_sha256": "abc"})
        ds.Datastore(tmp_path / "h", tokenizer_hash="def")


def test_datastore_errors(tmp_path):
    with pytest.raises(DatastoreError, match="not found"):
        ds.Datastore(tmp_path / "missing")
    ds.build([[1, 2, 3]], tmp_path / "s")
    (tmp_path / "s" / "sa.npy").write_bytes(b"junk")
    with pytest.raises(DatastoreError, match="missing a file or corrupt"):
        ds.Datastore(tmp_path / "s")
    ds.build([[1, 2, 3]], tmp_path / "t")
    np.save(tmp_path / "t" / "tokens.npy", np.array([1, 2], dtype=np.int32))
    with pytest.raises(DatastoreError, match="corrupt"):
        ds.Datastore(tmp_path / "t")
    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n{"foo": 1}\n')
    with pytest.raises(DatastoreError, match=r"c.jsonl:2: no text"):
        ds.read_corpus(tmp_path / "c.jsonl")
    (tmp_path / "d.jsonl").write_text('{"turns": ["a", "b"]}\n{"prompt": "c"}\n')
    assert ds.read_corpus(tmp_path / "d.jsonl") == ["a", "b", "c"]


@pytest.mark.parametrize(
    "args,msg",
    [
        (["generate", "--datastore", "{tmp}/missing", "hi"], "error: datastore {tmp}/missing not found"),
        (["generate", "--datastore", "{tmp}/bad", "hi"], "error: datastore {tmp}/bad is missing a file or corrupt"),
        (["datastore", "build", "{tmp}/none.jsonl", "--target", "x", "-o", "{tmp}/o"], "error: cannot read corpus"),
        (
            ["generate", "--method", "prompt_lookup", "--datastore", "{tmp}/bad", "hi"],
            "error: datastore is used by method 'suffix' only",
        ),
    ],
)
def test_datastore_cli_errors_are_one_line(tmp_path, args, msg):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "meta.json").write_text("{not json")
    args = [a.format(tmp=tmp_path) for a in args]
    r = subprocess.run([sys.executable, "-m", "specdraft.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().startswith(msg.format(tmp=tmp_path)) and len(r.stderr.strip().splitlines()) == 1


# --- suffix drafter ---------------------------------------------------------------------------
def test_suffix_drafter_proposals(tmp_path):
    sp = SamplingParams()
    spec = SpecConfig(method="suffix", k=8, tree_nodes=8, min_token_prob=0.0).validate()
    text = [9, 1, 2, 3, 4, 8, 1, 2, 3, 4, 7, 1, 2, 3, 5, 6, 1, 2, 3]
    a, b = SuffixDrafter(spec), SuffixDrafter(spec)
    a.begin(text, sp, None)
    b.begin(text[:3], sp, None)
    ta, tb = a.propose(text, 8), b.propose(text, 8)  # b extends incrementally: same state, same draft
    assert ta.tokens.tolist() == tb.tokens.tolist() and ta.parents.tolist() == tb.parents.tolist()
    assert ta.draft_probs is None
    # longest earlier suffix "1 2 3" (m = 3), 3 occurrences: continuations 4 8 1, 4 7 1, 5 6 1; depth 3;
    # best 8 of the 9 trie nodes by count (4 twice), then depth, then order
    assert ta.tokens.tolist() == [4, 5, 7, 8, 6, 1, 1, 1] and ta.parents.tolist() == [-1, -1, 0, 0, 1, 2, 3, 4]
    assert a.propose(text, 2).tokens.tolist() == [4, 5, 7, 8, 6]  # depth capped by max_tokens
    half = SuffixDrafter(SpecConfig(method="suffix", k=8, max_spec_factor=0.5, min_token_prob=0.5).validate())
    half.begin(text, sp, None)
    assert half.propose(text, 8).tokens.tolist() == [4]  # ceil(0.5 x 3) = 2 deep, but only p >= 0.5
    # the global store wins when its tree is better
    store = ds.build([[7, 7, 1, 2, 6, 6, 6]] * 5, tmp_path / "s")
    g = SuffixDrafter(spec, store)
    ctx = [7, 7, 1, 2]
    g.begin(ctx, sp, None)
    assert g.propose(ctx, 8).tokens.tolist() == [6, 6, 6] and g.last_source == "global"
    assert SuffixDrafter(spec).propose([5], 4).size == 0


# --- token recycling --------------------------------------------------------------------------
def test_adjacency_table_update_known_answer():
    t = AdjacencyTable(6, 2)
    assert t.nbytes == 6 * 2 * 4 and t.table.dtype == torch.int32
    logits = torch.tensor([[0.0, 5, 4, 0, 0, 0], [1, 0, 0, 3, 2, 0], [9, 8, 0, 0, 0, 0]])
    t.update(torch.tensor([0, 1, 0]), logits)  # token 0 appears twice: the later row wins
    assert t.table.tolist() == [[0, 1], [3, 4], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]
    t.update(torch.tensor([2]), torch.tensor([[0.0, 0, 0, 0, 1, 2, 7, 7]]))  # padded head: ids >= V dropped
    assert t.table[2].tolist() == [5, 4]


def test_static_tree_and_expansion():
    parents, ranks, levels = static_tree([2, 2, 1])
    assert parents.tolist() == [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    assert ranks.tolist() == [0, 1, 0, 1, 0, 1, 0, 0, 0, 0] and levels == [(0, 2), (2, 6), (6, 10)]
    table = torch.tensor([[1, 2], [3, 4], [5, 0], [0, 1], [-1, -1], [2, 3]], dtype=torch.int32)
    tree = expand(table, 0, [2, 2, 1])
    # root 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 0; 3 -> 0; 4 -> unknown (dropped); 5 -> 2; 0 -> 1
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5, 0, 0, 2, 1]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 1, 2, 4, 5]
    d = TokenRecyclingDrafter(SpecConfig.from_dict(dict(method="token_recycling", recycle_branching=[2, 2, 1])), 6)
    d.adj.table.copy_(table)
    assert d.propose([4, 0], 2).tokens.tolist() == [1, 2, 3, 4, 5, 0]  # depth capped by max_tokens
    assert d.propose([4], 3).size == 0  # nothing known after token 4


def test_token_recycling_table_refreshed_by_engine():
    target = tiny_llama(vocab=V)
    d = TokenRecyclingDrafter(SpecConfig.from_dict({"method": "token_recycling"}), V)
    generate(target, d, PROMPT, SamplingParams(max_new_tokens=1), eos_ids=set())
    logits = logits_of(target, PROMPT)
    assert d.adj.table[PROMPT[-1]].tolist() == torch.topk(logits[-1], 4).indices.tolist()


# --- lookahead -------------------------------------------------------------------------------
def test_lookahead_tree_shape_and_pool():
    d = LookaheadDrafter(
        SpecConfig.from_dict(dict(method="lookahead", lookahead_window=3, lookahead_ngram=3, lookahead_max_ngrams=2))
    )
    d.begin([1, 2, 3], SamplingParams(), None)
    d.levels = [[10, 11, 12], [20, 21, 22]]
    t = d.propose([1, 2, 3], 8)
    assert t.tokens.tolist() == [10, 11, 12, 20, 21, 22] and t.parents.tolist() == [-1, 0, 1, 0, 1, 2]
    assert t.position_ids(0)[0, 1:].tolist() == [1, 2, 3, 2, 3, 4]  # level l, column c at last + 1 + c + l
    logits = torch.zeros(7, 40)
    logits[4, 30] = logits[5, 31] = logits[6, 32] = 1.0  # argmax after each column's top node
    d.observe(StepOutcome(torch.tensor([3] + t.tokens.tolist()), logits))
    assert d.levels == [[20, 21, 22], [30, 31, 32]]
    assert d.pool == {10: [(20, 30)], 11: [(21, 31)], 12: [(22, 32)]}
    t = d.propose([1, 10], 8)  # verification branch first: the pooled n-gram starting with 10
    assert t.tokens.tolist()[:2] == [20, 30] and t.parents.tolist()[:3] == [-1, 0, -1]


# --- through the engine -----------------------------------------------------------------------
def drafters(store=None):
    return {
        "suffix": SuffixDrafter(SpecConfig(method="suffix", k=6).validate()),
        "suffix+store": SuffixDrafter(SpecConfig(method="suffix", k=6, min_token_prob=0.0).validate(), store),
        "token_recycling": TokenRecyclingDrafter(SpecConfig.from_dict({"method": "token_recycling"}), V),
        "lookahead": LookaheadDrafter(SpecConfig.from_dict({"method": "lookahead"})),
    }


def test_greedy_exact_on_tiny_model(tmp_path):
    target = tiny_llama(vocab=V, seed=3, scale=4.0)
    ref = generate(target, NoDrafter(), PROMPT, SamplingParams(max_new_tokens=32), eos_ids=set())
    rng = np.random.default_rng(0)
    store = ds.build([ref.token_ids[:16], rng.integers(0, V, 50)], tmp_path / "s")
    for name, d in drafters(store).items():
        out = generate(target, d, PROMPT, SamplingParams(max_new_tokens=32), eos_ids=set())
        assert out.token_ids == ref.token_ids, name
        assert out.stats.accepted > 0, name
        out = generate(target, d, PROMPT, SamplingParams(max_new_tokens=5), eos_ids=set())  # max_tokens caps
        assert out.token_ids == ref.token_ids[:5], name


def test_spec_config_validation():
    for d, msg in [
        ({"method": "suffix", "max_spec_factor": 0}, r"max_spec_factor must be in \(0, 1000\]"),
        ({"method": "suffix", "min_token_prob": 1.5}, r"min_token_prob must be in \[0, 1\]"),
        ({"method": "suffix", "tree_nodes": 0}, "tree_nodes"),
        ({"method": "prompt_lookup", "datastore": "x"}, "datastore is used by method 'suffix' only"),
        ({"method": "token_recycling", "recycle_branching": [4, 0]}, "recycle_branching must be"),
        ({"method": "token_recycling", "recycle_branching": [16, 16, 16]}, "at most 256"),
        ({"method": "lookahead", "lookahead_ngram": 1}, "lookahead_ngram"),
        ({"method": "lookahead", "lookahead_window": 0}, "lookahead_window"),
        (
            {"method": "suffix", "recycle_branching": [3, 1]},
            "recycle_branching is used by method 'token_recycling' only",
        ),
    ]:
        with pytest.raises(ConfigError, match=msg):
            SpecConfig.from_dict(d)
    for c in (
        SpecConfig(method="suffix", datastore="/tmp/s", max_spec_factor=2).validate(),
        SpecConfig.from_dict(dict(method="token_recycling", recycle_branching=[3, 1])),
    ):  # (each method's own fields)
        assert SpecConfig.from_json(json.dumps(c.to_dict())) == c


# --- sampling exactness through the engine's tree rejection sampling ------------------------
N_SAMPLES = 1500


@pytest.mark.slow  # 1,500 generations each (~2 min here)
@pytest.mark.parametrize("method", ["suffix", "token_recycling", "token_recycling_chain", "lookahead"])
def test_sampling_first_two_tokens_match_target(method):
    from stat_util import fit_pvalue
    from test_engine_tiny import exact_first_two

    target = tiny_llama(vocab=6)
    sp = SamplingParams(temperature=0.9, top_k=5)
    if method == "suffix":
        d = SuffixDrafter(SpecConfig(method="suffix", k=3, min_token_prob=0.0).validate())
    elif method == "lookahead":
        d = LookaheadDrafter(
            SpecConfig.from_dict(
                dict(method="lookahead", lookahead_window=2, lookahead_ngram=2, lookahead_max_ngrams=2)
            )
        )
    else:  # the chain case (branching 1) is verified by the chain rejection sampler
        branching = [1, 1, 1] if method.endswith("chain") else [3, 2]
        d = TokenRecyclingDrafter(SpecConfig.from_dict(dict(method="token_recycling", recycle_branching=branching)), 6)
    counts = np.zeros((6, 6))
    trees = 0
    for i in range(N_SAMPLES):
        s = SamplingParams(**{**sp.to_dict(), "seed": 20_000 + i, "max_new_tokens": 3})
        out = generate(target, d, PROMPT, s, eos_ids=set())
        a, b = out.token_ids[:2]
        counts[a, b] += 1
        trees += out.stats.drafted > 0
    assert trees > N_SAMPLES // 2  # trees were drafted (and verified by sampling) in most runs
    assert fit_pvalue(counts, exact_first_two(target, sp)) > 1e-3


def test_suffix_incremental_equals_fresh(tmp_path):
    """The draft depends only on the tokens: a drafter extended step by step (automaton and the
    global match bound) proposes what a fresh one built on the same tokens proposes."""
    rng = np.random.default_rng(5)
    corpus = [rng.integers(0, 4, 60) for _ in range(10)]
    store = ds.build(corpus, tmp_path / "s", sort_depth=16)
    spec = SpecConfig(method="suffix", k=6, min_token_prob=0.0, tree_nodes=10).validate()
    tokens = rng.integers(0, 4, 5).tolist()
    inc = SuffixDrafter(spec, store)
    inc.begin(tokens, SamplingParams(), None)
    for _ in range(40):
        tokens += rng.integers(0, 4, int(rng.integers(1, 4))).tolist()
        fresh = SuffixDrafter(spec, store)
        fresh.begin(tokens, SamplingParams(), None)
        a, b = inc.propose(tokens, 6), fresh.propose(tokens, 6)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        assert inc.last_source == fresh.last_source
