"""Medusa heads (Medusa-1): head i at answer position t is trained with cross-entropy to the token at
t + i + 2, through the target's frozen LM head; data: DIR/data.pt (data.py)."""

from __future__ import annotations

import sys

import torch
from torch import nn

from ...core.errors import SpecDraftError
from ...models.heads import MedusaHeads


def examples(seqs: list[dict], n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Answer positions: features [N, H] and targets [N, K] (token t + i + 2, -100 past the end)."""
    feats, tgts = [], []
    for s in seqs:
        T, n0 = s["tokens"].numel(), s["n_prompt"]
        t = torch.arange(max(n0 - 1, 0), T - 2)
        if t.numel() == 0:
            continue
        off = t[:, None] + 2 + torch.arange(n_heads)[None]
        y = torch.where(off < T, s["tokens"][off.clamp(max=T - 1)], torch.full_like(off, -100))
        feats.append(s["hidden"][t].float())
        tgts.append(y)
    if not feats:
        raise SpecDraftError("the training data has no answer positions to train on")
    return torch.cat(feats), torch.cat(tgts)


def setup(target, seqs: list[dict], saved: dict | None, opts):
    """-> (the heads, loss(generator) of one batch)."""
    H, V = target.facts.hidden_size, target.vocab_size
    lm_w = target.output_rows().float()
    K = saved["heads"] if saved else opts.heads
    blocks = saved.get("blocks", 1) if saved else opts.blocks
    head = MedusaHeads(H, K, blocks)
    X, Y = examples(seqs, K)
    print(f"medusa: {K} heads x {blocks} block(s), {X.shape[0]} answer positions", file=sys.stderr)

    def loss(g):
        idx = torch.randint(0, X.shape[0], (opts.batch_size,), generator=g)
        logits = nn.functional.linear(head(X[idx]), lm_w)  # [B, K, V]
        return nn.functional.cross_entropy(logits.reshape(-1, V), Y[idx].reshape(-1), ignore_index=-100)

    return head, loss
