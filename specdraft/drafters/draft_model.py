"""An independent draft model with the target's tokenizer, drafting chains or token trees.

Every request's drafter is a member of a ``DraftModelGroup`` (one per draft model per engine), which
drafts through the model interface only (``TargetModel.new_rows()``: any backend): each drafting
iteration is one batched forward of the draft model over the rows still drafting, whatever the batch
size; a single request is the one-row case. A row's draft cache holds a prefix of its tokens.

Chains: ragged catch-up feeds first, then one token per row; the last draft is never fed, and after
verification the cache is cut back to the context + accepted drafts.

Token trees (a row whose spec's ``tree`` is not "chain"; ``drafters/draft_tree.py``): the catch-up
forward gives each root's logits, then one forward per tree level scores every row's nodes to expand
(``tree_grower.GrowingTree``: static shapes, dynamic trees): a row feeds those nodes with their
ancestors as a token tree (``SequenceRows.forward(trees=...)``) and keeps none of it, so its cache
holds exactly the context; the accepted tokens are fed with the next catch-up.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.config import SpecConfig
from ..core.sampling import argmax_last, probs_from_logits, sample, uniform
from ..core.tree import DraftTree
from .base import Drafter, common_prefix, confident
from .prompt_lookup import find_candidate
from .tree_grower import GrowingTree, spec_shape


def fit_vocab(logits: torch.Tensor, target_vocab: int) -> torch.Tensor:
    """Put draft logits on the target's vocabulary rows (rows beyond either side are impossible)."""
    v = logits.shape[-1]
    if v == target_vocab:
        return logits
    if v > target_vocab:
        return logits[..., :target_vocab]
    pad = logits.new_full((*logits.shape[:-1], target_vocab - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class DraftModelDrafter(Drafter):
    """A request's member of its engine's DraftModelGroup (the group drafts; see the module doc)."""

    name = "draft_model"

    def __init__(self, model, spec: SpecConfig, target_vocab: int, prefix_cache=None):
        """``prefix_cache`` (core/prefix_cache.py, the decoder's): the draft's rows start from what earlier
        requests' draft rows computed, and leave theirs there."""
        self.model = model  # a TargetModel (models/base.py) of the draft
        self.spec = spec
        self.target_vocab = target_vocab
        self.prefix_cache = prefix_cache
        self.group_key = ("draft_model", id(getattr(model, "model", model)))

    def new_group(self) -> "DraftModelGroup":
        return DraftModelGroup(self.model, self.target_vocab, self.prefix_cache)

    def max_draft_depth(self) -> int:
        return self.spec.k


class DraftModelGroup:
    def __init__(self, draft, target_vocab: int, prefix_cache=None):
        self.target_vocab = target_vocab
        self.draft = draft
        self.kv = draft.new_rows()
        self.cache = prefix_cache if draft.capabilities.prefixes else None
        self.members: list = []  # engine Requests, in kv row order
        self._base: dict[int, int] = {}  # id(row) -> context length at the last propose
        self._drafted: dict[int, list[int]] = {}  # id(row) -> its last draft

    def join(self, rows, prefix_from=None) -> None:
        """``prefix_from``: (the target's rows, each row's index there) just after its prefill. A draft
        whose prefill computes what the target's did (``prefill_twin``: a self-draft whose prefills run
        through the target's dense layers, or a low-bit copy of a transformers target on llama.cpp)
        starts from a copy of that cache instead of prefilling the prompt again."""
        src = prefix_from[0] if prefix_from is not None else None
        if src is not None and self.draft.prefill_twin is src.model:
            self.kv.adopt_rows(src, prefix_from[1])
        else:  # empty rows (they catch up at their first propose), or starting from a cached prefix
            start = [self._cached(r) for r in rows]
            held = [list(r.tokens[: s[1]]) if s is not None else [] for r, s in zip(rows, start)]
            self.kv.add_rows(held, **({"start": start} if any(s is not None for s in start) else {}))
        self.members.extend(rows)

    def _partition(self, row):
        return (row.partition, "draft", self.draft)  # (the draft's own entries, apart from the target's)

    def _cached(self, row):
        """(saved, m): the longest prefix of the row's prompt this draft computed for an earlier request of the
        row's tenant; None for a seeded sampling row (its draft's numerics must be those of decoding alone)."""
        if self.cache is None or row.seeded_sampling:
            return None
        return self.cache.lookup(row.tokens[:-1], self._partition(row), counted=False)

    def leave(self, rows) -> None:
        for r in rows:  # what their draft rows computed stays for the tenant's next request (not a failed row's)
            if self.cache is not None and r in self.members and r.error is None and r.finish != "error":
                saved = self.kv.save_prefix(self.members.index(r))
                self.cache.insert(r.tokens[: saved.n], saved, self._partition(r))
        idx = [self.members.index(r) for r in rows if r in self.members]
        self.kv.remove_rows(idx)
        drop = set(idx)
        self.members = [m for i, m in enumerate(self.members) if i not in drop]
        for r in rows:
            self._base.pop(id(r), None)
            self._drafted.pop(id(r), None)

    def propose(self, rows, caps: list[int]) -> list[DraftTree]:
        cap_of = {id(r): c for r, c in zip(rows, caps)}
        c = [cap_of.get(id(m), 0) for m in self.members]
        tree = [c[i] > 0 and m.drafter.spec.tree != "chain" for i, m in enumerate(self.members)]
        for m in self.members:
            self._base[id(m)] = len(m.tokens)
        out, probs = self._chains([0 if t else x for x, t in zip(c, tree)])
        trees = self._trees([x if t else 0 for x, t in zip(c, tree)])
        chains = {
            i: DraftTree.chain(torch.stack(out[i]), torch.stack(probs[i]) if probs[i] else None)
            for i in range(len(self.members))
            if out[i]
        }  # (each chain's tokens read once, to the host)
        for i, m in enumerate(self.members):
            self._drafted[id(m)] = chains[i].tokens.tolist() if i in chains else []  # (a tree row's cache keeps none)
        by_row = {id(m): i for i, m in enumerate(self.members)}
        return [trees.get(i) or chains.get(i) or DraftTree.empty() for i in (by_row[id(r)] for r in rows)]

    def _chains(self, c: list[int]) -> tuple[list[list], list[list]]:
        """Chains of at most c[i] tokens for the rows with c[i] > 0: (draft tokens, their q) per row."""
        kv, R = self.kv, len(self.members)
        out: list[list] = [[] for _ in range(R)]
        probs: list[list] = [[] for _ in range(R)]
        active = [c[i] > 0 for i in range(R)]
        step = 0
        while any(active):
            if step == 0:  # catch up on what the row's cache lacks; its last position predicts the first draft
                feeds = [m.tokens[kv.lens[i] :] if active[i] else [] for i, m in enumerate(self.members)]
            else:
                feeds = [[int(out[i][-1])] if active[i] else [] for i in range(R)]
            # a cascade row appends what prompt lookup proposes; the draft model checks it in the same forward
            props = [self._proposal(m, out[i], c[i]) if active[i] else [] for i, m in enumerate(self.members)]
            seqs = [f + p for f, p in zip(feeds, props)]
            last = [max(len(f) - 1, 0) for f in feeds]
            # LM-head logits only from the first position a drafting row reads (Qwen's head is 151,936 rows)
            N = max(len(q) for q in seqs)
            keep = N - min(last[i] for i in range(R) if active[i])
            logits = kv.forward(seqs, keep=keep)
            kept = [len(q) for q in seqs]
            for i, m in enumerate(self.members):
                if active[i]:
                    for j in range(len(props[i]) + 1):
                        lg = fit_vocab(logits[i, last[i] + j - (N - keep)], self.target_vocab)
                        prop = props[i][j] if j < len(props[i]) else None
                        active[i] = self._draw(m, lg, step + j, out[i], probs[i], c[i], prop)
                        if prop is None or int(out[i][-1]) != prop or not active[i]:
                            break  # the proposal is rejected here: fed tokens past it are not kept
                    kept[i] = len(feeds[i]) + j
            kv.commit(kept)
            step += 1
        return out, probs

    def _trees(self, c: list[int]) -> dict[int, DraftTree]:
        """Token trees at most c[i] deep for the rows with c[i] > 0 (row index -> tree): one catch-up
        forward for the roots, then one forward per level for every row still growing."""
        kv, R = self.kv, len(self.members)
        grow = {i: _row_tree(self.members[i]) for i in range(R) if c[i] > 0}
        if not grow:
            return {}
        feeds = [m.tokens[kv.lens[i] :] if i in grow else [] for i, m in enumerate(self.members)]
        N = max(len(f) for f in feeds)
        keep = N - min(len(feeds[i]) - 1 for i in grow)
        logits = kv.forward(feeds, keep=keep)
        kv.commit([len(f) for f in feeds])  # every row's cache now holds its context
        live: dict = {}
        done: dict[int, DraftTree] = {}
        for i, g in grow.items():
            root = fit_vocab(logits[i, len(feeds[i]) - 1 - (N - keep)], self.target_vocab)
            _resume(i, g.growth(root, min(g.shape.max_depth, c[i])), None, live, done)
        while live:  # live: row -> (its growth, the nodes it expands now)
            level = {i: grow[i].level_feed(nodes) for i, (_, nodes) in live.items()}
            seqs = [level[i][0] if i in level else [] for i in range(R)]
            N = max(len(q) for q in seqs)
            keep = N - min(len(level[i][0]) - len(level[i][2]) for i in level)  # the nodes are fed last
            logits = kv.forward(seqs, keep=keep, trees=[level[i][1] if i in level else None for i in range(R)])
            kv.commit([0] * R)
            for i, (_, _, at) in level.items():
                lg = fit_vocab(logits[i, [a - (N - keep) for a in at]], self.target_vocab)
                _resume(i, live[i][0], lg, live, done)
        return done

    @staticmethod
    def _proposal(m, out: list, cap: int) -> list[int]:
        """Vertical cascade (``cascade_k`` > 0): prompt lookup's continuation of the row's context + the
        draft so far, for the draft model to check; room is left for the draft's own next token."""
        spec = m.drafter.spec
        n = min(spec.params.cascade_k, cap - len(out) - 1) if spec.method == "cascade" else 0
        if n <= 0:
            return []
        ctx = np.asarray(m.tokens + [int(t) for t in out], dtype=np.int64)
        return find_candidate(ctx, spec.params.min_ngram, spec.params.max_ngram, n).tolist()

    @staticmethod
    def _draw(
        m, logits: torch.Tensor, step: int, out: list, probs: list, cap: int, proposal: int | None = None
    ) -> bool:
        """Append row m's next draft token from its draft logits; False when the row stops drafting
        (cap reached, or its top probability fell below the confidence threshold). A cascade's
        ``proposal`` is taken as the draft token when the draft model agrees: greedy, when it is the
        argmax; sampling, with probability q(proposal), else a draw from q without it, which leaves
        the token distributed exactly as q (the q reported to the verifier)."""
        thr = m.drafter.spec.params.confidence_threshold
        if m.processor is not None:  # the history of this draft position: the context + the draft so far
            logits = m.processor.process(logits[None], m.tokens + [int(t) for t in out])[0]
        if m.sp.greedy:
            if not confident(thr, step, lambda: torch.softmax(logits, -1).max()):
                return False
            t = argmax_last(logits)
        else:
            q = probs_from_logits(logits, m.sp)
            if not confident(thr, step, q.max):
                return False
            t = sample(q, m.gen) if proposal is None else _draw_given(q, proposal, m.gen)
            probs.append(q)
        out.append(t)
        return len(out) < cap

    def feedback(self, rows, n_acc: list[int]) -> None:
        """After the rows' tokens were extended: a row's cache keeps its context at the last propose and
        the drafted tokens (all fed but the last) that the emitted tokens begin with. Reading the
        tokens, not ``n_acc``, keeps the cache right whatever chose the draft (a composite's merged tree,
        a stop string's cut)."""
        for r in rows:
            i, base = self.members.index(r), self._base[id(r)]
            fed = self._drafted[id(r)][:-1]
            emitted = r.tokens[base : base + len(fed)]
            self.kv.truncate(i, base + common_prefix(fed, emitted))
        self.kv.trim()


def _row_tree(row) -> GrowingTree:
    """A row's token tree to draft this step: the shape of its drafter's spec (a DraftTreeDrafter's, or a
    composite's whose model part drafts here), its sampling, and its processor reading the row's tokens."""
    return GrowingTree(spec_shape(row.drafter.spec), row.sp, row.gen, row.processor, len(row.tokens), row.tokens)


def _resume(i: int, growth, logits, live: dict, done: dict) -> None:
    """Send row i's growth its level's logits (None: start it); it yields the next nodes to expand
    (``live[i]``) or returns its tree (``done[i]``)."""
    try:
        live[i] = (growth, next(growth) if logits is None else growth.send(logits))
    except StopIteration as end:
        live.pop(i, None)
        done[i] = end.value


def _draw_given(q: torch.Tensor, proposal: int, gen: torch.Generator) -> torch.Tensor:
    """One token from q given a deterministic proposal: the proposal with probability q(proposal),
    else a draw from q with the proposal removed, renormalized (marginally exactly q)."""
    qp = float(q[proposal])
    if float(uniform((), gen, q.device)) < qp:
        return torch.tensor(proposal, device=q.device)
    rest = q.clone()
    rest[proposal] = 0.0
    return sample(rest / rest.sum(), gen)
