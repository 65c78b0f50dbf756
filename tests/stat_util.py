"""Goodness of fit of sampled sequences against an exact distribution."""

import numpy as np
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
