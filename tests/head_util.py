"""Tiny Medusa / EAGLE heads for tests: trained a few steps on a tiny target's own greedy
continuations (self-distillation, as `specdraft train` does) and saved as head directories."""

from __future__ import annotations

import torch


def head_spec(method: str, **keys):
    """A validated spec of head method ``method`` for a drafter made here with its head object (so the spec's
    ``head`` names no directory)."""
    from specdraft.core.config import SpecConfig

    return SpecConfig(method=method, head="(in memory)", **keys).validate()


def greedy_continuations(target, prompts, n=20):
    seqs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor(p)[None]
            for _ in range(n):
                ids = torch.cat([ids, target.model(ids).logits[:, -1:].argmax(-1)], dim=1)
            seqs.append(ids[0])
    return seqs


def train_tiny_heads(target, out, prompts, steps=25, n_heads=3) -> dict:
    """{"medusa": DIR, "eagle": DIR}: a Medusa head (``n_heads`` heads) and an EAGLE head for
    ``target`` (an HFModel), usable as SpecConfig.head."""
    from torch.nn.functional import cross_entropy, linear, smooth_l1_loss

    from specdraft.models.heads import EagleHead, MedusaHeads, save_head, target_signature

    torch.manual_seed(0)
    seqs = greedy_continuations(target, prompts)
    W = target.model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        feats = [target.model.model(s[None]).last_hidden_state[0] for s in seqs]
        embs = [target.model.get_input_embeddings()(s) for s in seqs]
    extra = {"target": target.name, "target_signature": target_signature(target)}
    dirs = {}
    medusa, eagle = MedusaHeads(target.facts.hidden_size, n_heads), EagleHead(target.facts)
    for name, head, lr in (("medusa", medusa, 1e-2), ("eagle", eagle, 3e-3)):
        opt = torch.optim.AdamW(head.parameters(), lr=lr)
        for step in range(steps):
            i = step % len(seqs)
            s, f, e = seqs[i], feats[i], embs[i]
            if name == "medusa":  # head d at position t predicts x_{t+d+2}
                loss = sum(cross_entropy(linear(head.heads[d](f[: -d - 2]), W), s[d + 2 :]) for d in range(n_heads))
            else:  # pred[t] ~ f_{t+1}; the LM head on it ~ x_{t+2}
                pred = head(f[None, :-1], e[None, 1:])[0]
                loss = smooth_l1_loss(pred[:-1], f[1:-1]) + 0.1 * cross_entropy(linear(pred[:-1], W), s[2:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        dirs[name] = out / name
        save_head(head, dirs[name], extra)
    return dirs


def random_eagle3_head(target, draft_ids, intermediate=48, seed=5):
    """An untrained EAGLE-3 head (reference layout) for a tiny ``target`` (weights perturbed from their
    initialization, so that its drafts are neither all alike nor all right): lossless decoding must not
    depend on it."""
    from specdraft.models.eagle3 import Eagle3Head, Eagle3Shape, eagle3_layers

    torch.manual_seed(seed)
    f = target.facts
    h = Eagle3Head(Eagle3Shape.for_target(f, eagle3_layers(f.num_layers), draft_ids.numel(), intermediate))
    h.set_draft_ids(draft_ids)
    with torch.no_grad():
        for p in h.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return h.eval()


def save_eagle3_head(target, out, draft_ids=None):
    """``random_eagle3_head`` (over the whole vocabulary of ``target`` unless ``draft_ids``), saved in ``out``
    as `specdraft train eagle3` saves one (the reference layout, float32); -> ``out``."""
    from specdraft.models import head_formats
    from specdraft.models.heads import target_signature

    ids = torch.arange(target.vocab_size) if draft_ids is None else draft_ids
    head = random_eagle3_head(target, ids)
    meta = {"type": "eagle3", "target": target.name, "target_signature": target_signature(target)}
    head_formats.write(out, head.shape, head.state_dict(), meta, dtype=torch.float32)
    return out


def break_sibling_residuals(monkeypatch):
    """Broken on purpose, for the sampling tests: tree siblings drawn without replacement, but each records
    the parent's full q (patched into the tree each draft grows)."""
    from specdraft.drafters.tree_grower import GrowingTree

    real = GrowingTree._children

    def broken(self, logits, m, parent=-1):
        kids = real(self, logits, m, parent)
        return [(t, kids[0][1], lp) for t, _, lp in kids]

    monkeypatch.setattr(GrowingTree, "_children", broken)
