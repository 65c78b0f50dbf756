"""Checks shared by the backend test files (llama.cpp, OpenVINO): plain decoding through the rows, the
near-tie rule for greedy divergences, and the exact two-token distribution for sampling tests."""

import torch

from specdraft.config import SamplingParams
from specdraft.engine import generate_batch

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


def exact_two_token_probs(target, prompt, top_k):
    """P(first two tokens) of top-k sampling at T=1, from single-step logits -> {(a, b): p}."""
    def dist(logits):
        v, i = torch.topk(logits, top_k)
        return dict(zip(i.tolist(), torch.softmax(v, -1).tolist()))

    first = dist(single_steps(target, prompt, [])[-1])
    return {(a, b): pa * pb for a, pa in first.items()
            for b, pb in dist(single_steps(target, prompt, [a])[-1]).items()}


def sample_pairs(target, make_drafter, prompt, sp, n, rows=50):
    """The first two tokens of ``n`` seeded requests, ``rows`` at a time through the batched loop, each with
    its own drafter from ``make_drafter()`` -> {(a, b): count}."""
    counts = {}
    for start in range(0, n, rows):
        jobs = [(prompt, SamplingParams(**{**sp.to_dict(), "seed": 1000 + i}), make_drafter())
                for i in range(start, min(start + rows, n))]
        for out in generate_batch(target, jobs, eos_ids=set()):
            key = tuple(out.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
    return counts


def pvalue(counts, probs):
    import numpy as np

    from stat_util import fit_pvalue

    keys = sorted(set(probs) | set(counts))
    return fit_pvalue(np.array([counts.get(k, 0) for k in keys]), np.array([probs.get(k, 0.0) for k in keys]))
