"""EAGLE-1 heads: on whole sequences, fc(f_t, embed(x_{t+1})) -> decoder layer -> f_hat_{t+1}; loss =
smooth-L1(f_hat_{t+1}, f_{t+1}) + 0.1 x cross-entropy(LM head(f_hat_{t+1}), x_{t+2}) (EAGLE's weighting),
the cross-entropy on answer positions; with ``--draft-vocab N`` over the N most frequent answer tokens
only (tokens outside them are left out of the cross-entropy). Data: DIR/data.pt (data.py)."""

from __future__ import annotations

import sys

import torch
from torch import nn

from ...models.heads import EagleHead
from .data import draft_vocab


def batch(seqs: list[dict], idx: list[int], vocab_map: torch.Tensor | None):
    """Right-padded batch over the pairs t whose next feature is known (t + 1 < fed positions): feats f_t
    [B, L, H], next tokens x_{t+1} [B, L], feature targets f_{t+1}, token targets x_{t+2} (-100 outside
    the answer / padding / the reduced vocabulary), valid [B, L]."""
    chosen = [seqs[i] for i in idx]
    L = max(s["hidden"].shape[0] - 1 for s in chosen)
    H = chosen[0]["hidden"].shape[-1]
    B = len(chosen)
    f, f_next = torch.zeros(B, L, H), torch.zeros(B, L, H)
    x_next = torch.zeros(B, L, dtype=torch.long)
    y = torch.full((B, L), -100, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, s in enumerate(chosen):
        toks, hid, n0 = s["tokens"], s["hidden"].float(), s["n_prompt"]
        n = hid.shape[0] - 1
        f[b, :n], f_next[b, :n] = hid[:-1], hid[1:]
        x_next[b, :n] = toks[1 : n + 1]
        valid[b, :n] = True
        t = torch.arange(max(n0 - 1, 0), n)  # x_{t+2} is an answer token
        tt = toks[t + 2]
        y[b, t] = tt if vocab_map is None else vocab_map[tt]
    return f, x_next, f_next, y, valid


def setup(target, seqs: list[dict], saved: dict | None, opts):
    """-> (the head, loss(generator) of one batch)."""
    V = target.vocab_size
    n_vocab = saved.get("draft_vocab") if saved else opts.draft_vocab
    ids = draft_vocab([s["tokens"] for s in seqs], [s["n_prompt"] for s in seqs], n_vocab, V)[0] if n_vocab else None
    head = EagleHead(target.facts, ids)
    vocab_map = None
    w_cls = target.output_rows(ids).float()
    if ids is not None:
        vocab_map = torch.full((V,), -100, dtype=torch.long)
        vocab_map[ids] = torch.arange(ids.numel())
    print(
        f"eagle: 1 decoder layer, {len(seqs)} sequences, draft vocabulary {ids.numel() if ids is not None else V}",
        file=sys.stderr,
    )

    def loss(g):
        idx = torch.randint(0, len(seqs), (opts.batch_size,), generator=g).tolist()
        f, x_next, f_next, y, valid = batch(seqs, idx, vocab_map)
        with torch.no_grad():
            e = target.embed(x_next).float()
        pred = head(f, e)
        reg = nn.functional.smooth_l1_loss(pred[valid], f_next[valid])
        logits = nn.functional.linear(pred, w_cls)
        ce = (
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
            if (y >= 0).any()
            else pred.sum() * 0
        )
        return reg + 0.1 * ce

    return head, loss
