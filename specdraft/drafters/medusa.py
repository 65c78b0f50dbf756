"""Medusa (Cai et al. 2024, Medusa-1): K heads on the target's last feature draft a token tree.

The target's feature f_t at the last verified position t (the final norm's output that produced the
pending token x_{t+1}) goes through head i (residual blocks) and the target's own LM head; head i
predicts x_{t+i+2}, so head d-1 drafts depth d of the tree. The tree's shape is a Medusa "choices"
list (``tree_choices``, or ``tree_branching`` per depth, or a chain with ``tree="chain"``): path
(r_1, ..., r_d) is the rank-r_d candidate of head d-1 under the node (r_1, ..., r_{d-1}).

Verification stays lossless with the engine's verifiers:
- greedy: the children of a node are head d-1's top-m tokens, deterministic (``draft_probs`` None,
  i.e. one-hot); the engine keeps the deepest path the target's argmax agrees with;
- sampling: each node's children are drawn *without replacement* from q = ``probs_from_logits`` of
  its head's logits under the request's SamplingParams, a fresh draw per parent, and each node
  records the distribution it was drawn from (q with its earlier siblings removed, renormalized), as
  ``drafters/draft_tree.py`` does; ``verify.rejection_sample_tree`` is exact for such trees
  (docs/design.md, token trees). The tree shape never depends on the drawn values.

The feature comes from the engine: the drafter sets ``wants_hidden`` and its ``observe``
receives the target's features of every fed position; ``feedback`` keeps the one of the last
accepted position. The first step (prefill) has no feature yet and drafts nothing.
"""

from __future__ import annotations

import torch

from ..core.config import SamplingParams, SpecConfig
from ..core.errors import ConfigError
from ..core.sampling import probs_from_logits
from ..core.tree import DraftTree, TreeShape, accepted_rows, child_counts
from ..models.base import TargetModel
from ..models.heads import MedusaHeads, needs_head_io
from .base import Drafter
from .tree_grower import spec_shape


def tree_plan(spec: SpecConfig, n_heads: int, method: str) -> TreeShape:
    """The tree shape as a static one (Medusa's choices): a chain is the path of top ranks."""
    if spec.tree == "dynamic":
        raise ConfigError(
            f"method {method!r} drafts a chain or a static tree (tree_choices / tree_branching), not tree='dynamic'"
        )
    if spec.tree == "chain":
        shape = TreeShape.of("static", spec.k, choices=[[0] * d for d in range(1, min(spec.k, n_heads) + 1)])
    else:
        shape = spec_shape(spec)
    if shape.max_depth > n_heads:
        raise ConfigError(
            f"the tree is {shape.max_depth} deep but the Medusa head has {n_heads} heads (one per "
            f"depth); use a tree at most {n_heads} deep"
        )
    return shape


def children_without_replacement(q: torch.Tensor, m: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw m distinct tokens from q [V] in order (successive sampling without replacement) and the
    distribution each was drawn from: [m] tokens, [m, V] (q without the earlier draws, renormalized)."""
    m = min(m, int((q > 0).sum()))
    if m <= 0:
        return torch.empty(0, dtype=torch.long, device=q.device), q.new_zeros(0, q.shape[-1])
    x = torch.multinomial(q, m, replacement=False, generator=gen)
    qs = q.expand(m, -1).clone()
    r, c = torch.tril_indices(m, m, -1, device=q.device)
    qs[r, x[c]] = 0.0
    return x, qs / qs.sum(-1, keepdim=True)


class MedusaDrafter(Drafter):
    name = "medusa"
    wants_hidden = True
    reads_fed_positions = True  # feedback picks the accepted rows of the fed draft
    draw_children = staticmethod(children_without_replacement)  # (q, m, generator) -> tokens, their q_j

    def __init__(self, target: TargetModel, heads: MedusaHeads, spec: SpecConfig):
        needs_head_io(target, "method 'medusa'")
        if not target.capabilities.hidden:
            raise ConfigError(
                f"method 'medusa' reads the target's final-norm features, which {target.name} on the "
                f"{target.backend} backend does not hand over"
            )
        self.target = target
        self.heads = heads
        self.spec = spec
        self.w_out = target.output_rows().to(next(heads.parameters()).dtype)  # the target's LM head
        self.shape = tree_plan(spec, heads.n_heads, "medusa")

    def max_draft_depth(self) -> int:
        return self.shape.max_depth

    def begin(self, prompt_ids, sp: SamplingParams, generator, processor=None):
        self.sp, self.gen = sp, generator
        self.feat: torch.Tensor | None = None

    @torch.inference_mode()
    def head_logits(self, feat: torch.Tensor, depth: int) -> torch.Tensor:
        """[depth, V] float32: head d's logits for the token d + 2 after the feature's position."""
        h = torch.stack([self.heads.heads[d](feat) for d in range(depth)])
        return torch.nn.functional.linear(h, self.w_out).float()

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        if self.feat is None or max_tokens <= 0:
            return DraftTree.empty()
        plan = [c for c in self.shape.choices if len(c) <= max_tokens]
        depth = max(len(c) for c in plan)
        logits = self.head_logits(self.feat, depth)
        greedy = self.sp.greedy
        n_kids = child_counts(plan)
        node: dict[tuple[int, ...], int] = {}
        draws: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}
        toks, pars, qs = [], [], []
        if greedy:
            width = max(n_kids.values())
            top = torch.topk(logits, min(width, logits.shape[-1]), dim=-1).indices.tolist()  # [depth][width], one read
        else:
            q_all = probs_from_logits(logits, self.sp)
        for c in plan:  # level order: a node's parent is placed before it
            parent = c[:-1]
            if parent and parent not in node:
                continue  # its parent was not drawn (fewer candidates than planned)
            d = len(c) - 1
            if greedy:
                if c[-1] >= len(top[d]):
                    continue
                tok, q = top[d][c[-1]], None
            else:
                if parent not in draws:  # one draw per parent, fresh for each parent
                    xs, dists = self.draw_children(q_all[d], n_kids[parent], self.gen)
                    draws[parent] = (xs.tolist(), dists)
                xs, dists = draws[parent]
                if c[-1] >= len(xs):
                    continue
                tok, q = xs[c[-1]], dists[c[-1]]
            node[c] = len(toks)
            toks.append(tok)
            pars.append(node[parent] if parent else -1)
            qs.append(q)
        probs = None if greedy or not toks else torch.stack(qs)
        return DraftTree.of(toks, pars, probs)

    def observe(self, step) -> None:
        rows = accepted_rows(step.draft, step.hidden.shape[0], step.accepted, step.emitted)
        self.feat = step.hidden[rows[-1], : self.heads.hidden].clone()  # the final norm's block (models/base.py)
