"""Logits processing, applied identically to the target and the draft side.

``probs_from_logits`` is the one place where temperature, top-k and top-p turn logits into the
distribution a token is sampled from. The verifier's exactness rests on both sides using it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import numpy as np
import torch

if TYPE_CHECKING:  # type hints only: config -> verify -> sampling must not import config back
    from .config import SamplingParams


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximum, as torch's): through numpy for float32 CPU tensors, whose
    argmax over a 151k vocabulary takes 0.1 ms where torch's takes 1-7 ms for 5 rows on 2 threads
    (docs/benchmarks.md, the engine's time per step on the AMX build)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.asarray(x.numpy().argmax(-1)))
    return x.argmax(-1)


def probs_from_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Rows of logits [..., V] -> rows of probabilities (float32), vectorized, no Python loops.

    Order as in transformers: temperature, then top-k, then top-p, then min-p (each on the
    temperature-scaled distribution). Sampling rows only: ``sp.greedy`` is False (temperature >=
    config.GREEDY_BELOW).
    """
    x = logits.float() / sp.temperature
    if sp.top_k > 0 and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        sp_sorted = torch.softmax(sorted_x, dim=-1)
        # mass strictly before each token; drop tokens once top_p is already covered (keeps >= 1)
        before = torch.cumsum(sp_sorted, dim=-1) - sp_sorted
        drop_sorted = before >= sp.top_p
        drop_sorted[..., 0] = False  # the top token always stays (a top_p below float32's range rounds to 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if sp.min_p > 0:  # keep tokens at least min_p times as likely as the most likely one (keeps >= 1)
        keep_from = x.max(dim=-1, keepdim=True).values + math.log(sp.min_p)
        x = x.masked_fill(x < keep_from, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V] (any non-negative weights) -> LongTensor [...]; a row without
    positive finite weight raises SpecDraftError.

    Inverse CDF: one uniform per row against the row's running sum. torch.multinomial takes 2.6 ms
    for one draw over Qwen's 151,936 tokens on a 2-core CPU; this takes 0.14 ms. A token of weight 0
    is never drawn: the first index whose sum exceeds u has positive weight, and u is capped below
    the total at the last positive token."""
    flat = probs.reshape(-1, probs.shape[-1]).float()
    cdf = torch.cumsum(flat, dim=-1)
    total = cdf[:, -1:].contiguous()
    if not bool(((total > 0) & torch.isfinite(total)).all()):  # NaN, inf or all zero: no token to draw
        from .errors import SpecDraftError  # (searchsorted would return V for NaN, 0 for all zero)

        raise SpecDraftError("no token can be sampled: the processed distribution is all zero or not finite "
                             "(constraints that rule out every token, or NaN scores)")
    u = torch.rand(total.shape, generator=generator) * total
    idx = torch.searchsorted(cdf, u, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last token of positive weight
    return torch.minimum(idx, last).squeeze(-1).reshape(probs.shape[:-1])


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
