"""Logits processing, applied identically to the target and the draft side.

``probs_from_logits`` is the one place where temperature, top-k and top-p turn logits into the
distribution a token is sampled from. The verifier's exactness rests on both sides using it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # type hints only: config -> verify -> sampling must not import config back
    from .config import SamplingParams


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximum, as torch's): through numpy for float32 CPU tensors, whose
    argmax over a 151k vocabulary takes 0.1 ms where torch's takes 1-7 ms for 5 rows on 2 threads
    (docs/benchmark-log.md, the engine's time per step on the AMX build)."""
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


NO_TOKEN = (
    "no token can be sampled: the processed distribution is all zero or not finite (constraints that "
    "rule out every token, or NaN scores)"
)


def sample(probs: torch.Tensor, generator: torch.Generator | None, strict: bool = True) -> torch.Tensor:
    """One token per row of probs [..., V] (any non-negative weights) -> LongTensor [...]; a row without
    positive finite weight raises SpecDraftError (``strict`` False: gives -1 instead, so the caller reads it
    with its other results and a device is not read here).

    Inverse CDF: one uniform per row against the row's running sum. torch.multinomial takes 2.6 ms
    for one draw over Qwen's 151,936 tokens on a 2-core CPU; this takes 0.14 ms. A token of weight 0
    is never drawn: the first index whose sum exceeds u has positive weight, and u is capped below
    the total at the last positive token."""
    flat = probs.reshape(-1, probs.shape[-1]).float()
    cdf = torch.cumsum(flat, dim=-1)
    total = cdf[:, -1:].contiguous()
    drawable = (total > 0) & torch.isfinite(total)  # NaN, inf or all zero: no token to draw
    if strict and not bool(drawable.all()):  # (searchsorted would return V for NaN, 0 for all zero)
        from .errors import SpecDraftError

        raise SpecDraftError(NO_TOKEN)
    u = uniform(total.shape, generator, flat.device) * total
    idx = torch.searchsorted(cdf, u, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last token of positive weight
    idx = torch.minimum(idx, last)
    if not strict:
        idx = torch.where(drawable, idx, -1)
    return idx.squeeze(-1).reshape(probs.shape[:-1])


def uniform(shape, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Uniforms in [0, 1) of ``shape`` on ``device``, drawn from ``generator``'s stream on the generator's own
    device. A draft model on another device than the target still draws from the request's one stream, so a
    seed means the same draws wherever its distributions are computed."""
    at = device if generator is None else generator.device
    return torch.rand(shape, generator=generator, device=at).to(device)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A request's random stream on ``device`` (the target's: where verification draws). A seed gives the
    same stream on a given device type; CUDA's stream differs from the CPU's."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
