"""Checks shared by the backend test files (llama.cpp, OpenVINO): plain decoding through the rows, the
near-tie rule for greedy divergences, and the exact two-token distribution for sampling tests."""

import torch

from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.tree import DraftTree, feed_mask
from specdraft.engine import Job, generate, generate_batch

NEAR_TIE = 2.0  # logits; the kernel noise measured on these backends stays under 1.7


def single_steps(target, prompt, tokens):
    """Plain decoding's logits for feeding ``tokens`` after ``prompt``, one token per forward."""
    rows = target.new_rows()
    rows.add_rows([prompt[:-1]])
    out = []
    for t in [prompt[-1]] + tokens:
        out.append(rows.forward([[t]])[0, -1])
        rows.commit([1])
    return out


def plain_tokens(target, prompt, n):
    rows = target.new_rows()
    rows.add_rows([prompt[:-1]])
    pend, out = prompt[-1], []
    for _ in range(n):
        pend = int(rows.forward([[pend]])[0, -1].argmax())
        rows.commit([1])
        out.append(pend)
    return out


def plain_outputs(dec, prompts, n=40):
    """Each prompt's plain greedy output (``n`` tokens, EOS ignored): a backend file's greedy reference,
    computed once (a shorter run is compared with its prefix)."""
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return [generate(dec.target, dec.make_drafter(SpecConfig(method="plain")), p, sp).token_ids for p in prompts]


def check_greedy(target, prompt, ref, got, label):
    """Token-identical, or the first divergence is a near-tie of plain decoding (reported)."""
    if got == ref:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    assert pos < len(ref), f"{label}: output is a prefix of plain's ({len(got)} of {len(ref)} tokens)"
    top = torch.topk(single_steps(target, prompt, ref[:pos])[-1], 2).values
    gap = float(top[0] - top[1])
    print(f"{label}: diverges at {pos}, plain's top-2 gap there {gap:.4f}")
    assert gap < NEAR_TIE, f"{label}: diverges at {pos} where plain's top-2 gap is {gap:.3f}: not a near-tie"
    return gap


def check_tree_nodes_and_accepted_path(t, p):
    """A token tree fed in one forward: each node's logits are those of its own path (no sibling, no
    other branch visible); after committing a path the cache continues exactly that path."""
    ref = plain_tokens(t, p, 6)
    parents = [-1, -1, 0, 0, 2, 1, 4]  # the true path is nodes 0 -> 2 -> 4 -> 6; others are wrong guesses
    tokens = [ref[0], 7, ref[1], 9, ref[2], 11, ref[3]]
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    rows = t.new_rows()
    rows.add_rows([p[:-1]])
    lg = rows.forward([[p[-1]] + tokens], trees=[feed_mask(tree)])[0]
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parents[j]
        want = single_steps(t, p, path)[-1]
        assert (lg[i + 1] - want).abs().max() < NEAR_TIE, f"node {i} sees more than its path"
    rows.commit([[0, 1, 3, 5]])  # pending + nodes 0, 2, 4
    assert rows.lens == [len(p) + 3]
    after = rows.forward([[ref[3]]])[0, -1]
    want = single_steps(t, p, ref[:4])[-1]
    assert (after - want).abs().max() < NEAR_TIE
    assert int(after.argmax()) == int(want.argmax())


def check_wrong_attention_is_caught(t, p):
    """The tolerance above has power: a node that sees the wrong branch (the sibling of its parent
    instead of its parent) is off by far more than the kernel noise."""
    ref = plain_tokens(t, p, 3)
    tree = DraftTree(torch.tensor([ref[0], 7, ref[1]]), torch.tensor([-1, -1, 0]))
    allow, off = feed_mask(tree)
    allow[3, 1], allow[3, 2] = False, True  # node 2 attends to node 1 instead of its parent node 0
    rows = t.new_rows()
    rows.add_rows([p[:-1]])
    lg = rows.forward([[p[-1], ref[0], 7, ref[1]]], trees=[(allow, off)])[0]
    want = single_steps(t, p, ref[:2])[-1]
    assert (lg[3] - want).abs().max() > 3 * NEAR_TIE


def exact_two_token_probs(target, prompt, top_k):
    """P(first two tokens) of top-k sampling at T=1, from single-step logits -> {(a, b): p}."""

    def dist(logits):
        v, i = torch.topk(logits, top_k)
        return dict(zip(i.tolist(), torch.softmax(v, -1).tolist()))

    first = dist(single_steps(target, prompt, [])[-1])
    return {(a, b): pa * pb for a, pa in first.items() for b, pb in dist(single_steps(target, prompt, [a])[-1]).items()}


def sample_pairs(target, make_drafter, prompt, sp, n, rows=50):
    """The first two tokens of ``n`` seeded requests, ``rows`` at a time through the batched loop, each with
    its own drafter from ``make_drafter()`` -> {(a, b): count}."""
    counts = {}
    for start in range(0, n, rows):
        jobs = [
            Job(prompt, SamplingParams(**{**sp.to_dict(), "seed": 1000 + i}), make_drafter())
            for i in range(start, min(start + rows, n))
        ]
        for out in generate_batch(target, jobs, eos_ids=set(), isolate_seeded=False):  # seeds only pin the samples
            key = tuple(out.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
    return counts


def pvalue(counts, probs):
    import numpy as np

    from stat_util import fit_pvalue

    keys = sorted(set(probs) | set(counts))
    return fit_pvalue(np.array([counts.get(k, 0) for k in keys]), np.array([probs.get(k, 0.0) for k in keys]))


def check_conversation_after_hits(target, spec, label, turns=3, n=24):
    """A chat replayed as clients send it (each turn the whole history + a new message) on a decoder with
    the prefix cache: later turns start from cached prefixes, and every turn's greedy output is a cold
    run's, or parts from it at a near-tie (reported). -> the gaps of the divergences."""
    from specdraft.api import SpecDecoder

    warm, cold = SpecDecoder(target), SpecDecoder(target, prefix_cache_mb=0)
    sp = SamplingParams(max_new_tokens=n, ignore_eos=True)
    history = warm.encode("Write a Python function that reverses a list, then explain it.", chat=True)
    gaps = []
    for turn in range(turns):
        got = warm.generate(history, sp, spec)
        assert (got.stats.cached_tokens > 0) == (turn > 0), (turn, got.stats.cached_tokens)
        ref = cold.generate(history, sp, spec).token_ids
        gap = check_greedy(target, history, ref, got.token_ids, f"{label} turn {turn}")
        if gap is not None:
            gaps.append(gap)
        history = history + got.token_ids + warm.encode(" Now make it shorter.", chat=False)
    return gaps
