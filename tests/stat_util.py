"""Goodness of fit of sampled sequences against an exact distribution."""

import numpy as np
import torch
from scipy import stats


def fit_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value; cells with expected < min_expected are pooled into one. A sample in a
    cell of probability 0 (e.g. a token that top-k/top-p removed) gives p = 0."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    if (counts[probs <= 0] > 0).any():
        return 0.0
    exp = probs * n
    big = exp >= min_expected
    obs_c = np.append(counts[big], counts[~big].sum())
    exp_c = np.append(exp[big], exp[~big].sum())
    keep = exp_c > 0
    obs_c, exp_c = obs_c[keep], exp_c[keep]
    exp_c *= obs_c.sum() / exp_c.sum()
    return float(stats.chisquare(obs_c, exp_c).pvalue)


def emitted_counts(d: torch.Tensor, n: torch.Tensor, nxt: torch.Tensor, P: torch.Tensor, g) -> np.ndarray:
    """Rows of a chain verification emit ``d[:n]`` then ``nxt``; complete each row to k + 1 tokens with
    plain samples from the target's table ``P`` [V, V] (next-token distribution given the previous
    token) and count the sequences: -> counts over V^(k + 1), the first token most significant."""
    N, k = d.shape
    V = P.shape[0]
    seq = torch.zeros(N, k + 1, dtype=torch.long)
    pos = torch.arange(k + 1)[None]
    seq[:, :k] = torch.where(pos[:, :k] < n[:, None], d, 0)
    seq.scatter_(1, n[:, None], nxt[:, None])
    last = nxt
    for j in range(1, k + 1):
        fill = n + j
        m = fill <= k
        if not m.any():
            break
        t = torch.multinomial(P[last], 1, generator=g).squeeze(1)
        seq[m, fill[m]] = t[m]
        last = torch.where(m, t, last)
    codes = (seq * (V ** torch.arange(k, -1, -1))[None]).sum(1)
    return np.bincount(codes.numpy(), minlength=V ** (k + 1))


def _pooled(obs: np.ndarray, exp: np.ndarray, min_expected: float) -> tuple[np.ndarray, np.ndarray]:
    """Merge the cells of smallest expectation into one until that merged cell expects >= min_expected
    (when the whole row expects less, it becomes a single cell)."""
    order = np.argsort(exp, kind="stable")
    cum = np.cumsum(exp[order])
    m = int(np.searchsorted(cum, min_expected)) + 1  # the m smallest cells are merged
    if m <= 1:
        return obs, exp
    small, big = order[:m], order[m:]
    return np.append(obs[big], obs[small].sum()), np.append(exp[big], exp[small].sum())


def conditional_fit(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Goodness of fit of a token's distribution within each of C contexts, all contexts together.

    ``counts`` [C, V]: how often each token followed each context; ``probs`` [C, V]: its exact
    distribution there. -> (chi-square statistic, degrees of freedom), summed over the contexts, each
    context's cells of smallest expectation merged until they expect >= min_expected. A sample in a
    cell of probability 0 gives an infinite statistic."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    stat, df = 0.0, 0
    for obs, p in zip(counts, probs):
        n = obs.sum()
        if n == 0:
            continue
        if (obs[p <= 0] > 0).any():
            return float("inf"), 1
        obs_c, exp_c = _pooled(obs, p / p.sum() * n, min_expected)
        stat += float(((obs_c - exp_c) ** 2 / exp_c).sum())
        df += len(obs_c) - 1
    return stat, df


def chi2_pvalue(stat: float, df: int) -> float:
    return 1.0 if df <= 0 else float(stats.chi2.sf(stat, df))


def sample_first_tokens(
    target, make_drafter, prompt, sp, max_new, n_tokens, n_samples, vocab, seed0, rows=250, hook=None
):
    """Decode ``n_samples`` seeded requests end to end, ``rows`` at a time through the batched loop, each
    with its own drafter from ``make_drafter()`` (``hook``: the loop's engine.StepHook) -> (counts [vocab] *
    n_tokens of their first ``n_tokens`` tokens, draft tokens drafted / accepted in the steps that made those
    tokens)."""
    from specdraft.core.config import SamplingParams
    from specdraft.engine import Job, generate_batch

    counts = np.zeros((vocab,) * n_tokens)
    drafted = accepted = 0
    for start in range(0, n_samples, rows):
        jobs = [
            Job(
                prompt, SamplingParams(**{**sp.to_dict(), "seed": seed0 + i, "max_new_tokens": max_new}), make_drafter()
            )
            for i in range(start, min(start + rows, n_samples))
        ]
        # seeds only pin the samples
        for out in generate_batch(target, jobs, eos_ids=set(), isolate_seeded=False, hook=hook):
            counts[tuple(out.token_ids[:n_tokens])] += 1
            made = 0
            for st in out.stats.steps:  # the steps that started before the last counted token
                if made >= n_tokens:
                    break
                drafted, accepted, made = drafted + st.drafted, accepted + st.accepted, made + st.emitted
    return counts, drafted, accepted
