"""EAGLE (Li et al. 2024, EAGLE-1): autoregression on the target's features with one decoder layer.

At position t the head reads the pair (f_t, embed(x_{t+1})): f_t is the target's feature (final
norm output) at t, x_{t+1} the token after it; ``fc`` of their concatenation goes through one
decoder layer of the target's own class (with its own KV cache) and predicts f_{t+1}; the target's
LM head on the predicted feature gives the draft distribution of x_{t+2}. Drafting a chain of k
tokens: feed the verified pairs not yet in the head's cache (the last one is (f_{n-2}, x_{n-1}), the
pending token), sample or take the argmax, then feed (predicted feature, drafted token) k - 1 times.

Feature state, kept simple: ``feats`` holds the target's features of every verified position
(appended in ``observe`` from the accepted path's rows of the step's features); the head's cache
is cropped back, every step, to the positions it was fed with true features (``n_true``), so
predicted features never stay in it.

Token trees (``tree="dynamic"``, EAGLE-2's dynamic tree, or a ``"static"`` shape): the tree
building is ``tree_grower.GrowingTree``, shared with the draft-model trees; the head scores one tree
level per forward. Node i's input pair is (predicted feature of its parent, embed(token of node i));
a depth-1 node's parent feature is the one predicted at the last true position. A depth-d node sits
at position (n_true - 1 + d), where the chain's d-th draft is fed, and a 4D additive mask lets it see
the true positions of the head's cache, its fed ancestors and itself. The cache crop at the start
of every ``propose`` drops the nodes again.

Reduced draft vocabulary (``draft_ids`` in the head, from training): the draft logits are the LM
head's rows for those ids only; every other token gets -inf, so q = probs_from_logits(...) is a
proper distribution over the full vocabulary that is 0 outside the ids. Verification uses the
target's full distribution, so sampling stays exact (a token q cannot draw is simply never
drafted; the residual max(0, p - q) still covers it) and greedy stays token-identical.
"""

from __future__ import annotations

import torch

from ..core.config import SamplingParams, SpecConfig
from ..core.errors import ConfigError
from ..core.sampling import probs_from_logits, sample
from ..core.tree import DraftTree, accepted_rows
from ..models.base import TargetModel
from ..models.heads import EagleHead, needs_head_io
from .base import Drafter
from .tree_grower import GrowingTree, spec_shape


class EagleDrafter(Drafter):
    name = "eagle"
    wants_hidden = True
    reads_fed_positions = True  # feedback picks the accepted rows of the fed draft
    growing = GrowingTree  # what a tree draft grows in

    def __init__(self, target: TargetModel, head: EagleHead, spec: SpecConfig):
        needs_head_io(target, f"method {self.name!r}")
        self._check_features(target)
        self.target, self.head, self.spec = target, head, spec
        self.device = target.device  # of its features, where the head runs (models/heads.load_head)
        self.shape = spec_shape(spec)  # a chain k deep, or the tree it grows
        self.V = target.vocab_size
        self.width = head.hidden  # of the target's features per position, as this head reads them
        self.dtype = next(head.parameters()).dtype  # the head's: features and embeddings are fed in it
        self._draft_vocab(target, head)

    def _check_features(self, target: TargetModel) -> None:
        if not target.capabilities.hidden:
            raise ConfigError(
                f"method {self.name!r} reads the target's final-norm features, which {target.name} "
                f"on the {target.backend} backend does not hand over"
            )

    def _draft_vocab(self, target: TargetModel, head) -> None:
        """The draft logits' rows: the target's LM head, or its rows for the head's ``draft_ids``."""
        ids = head.draft_ids
        self.ids = ids if ids.numel() else None
        self.w_out = target.output_rows(self.ids).to(self.dtype)  # all rows, or the draft vocabulary's

    def embed(self, toks: torch.Tensor) -> torch.Tensor:
        return self.target.embed(toks).to(self.dtype)

    def begin(self, prompt_ids, sp: SamplingParams, generator, processor=None):
        self.sp, self.gen = sp, generator
        self.feats = torch.empty(0, self.width, dtype=self.dtype, device=self.device)
        self._new_cache()

    def _new_cache(self) -> None:
        self.cache = self.head.new_cache()
        self.n_true = 0
        self._weights = getattr(self.head, "version", 0)  # the online learner counts the head's weight changes

    def max_draft_depth(self) -> int:
        return self.shape.max_depth

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """Draft logits over the full vocabulary [..., V] (float32) for predicted features [..., H]."""
        sub = self._sub_logits(f).float()
        if self.ids is None:
            return sub
        out = sub.new_full((*sub.shape[:-1], self.V), float("-inf"))
        out[..., self.ids] = sub
        return out

    def _sub_logits(self, f: torch.Tensor) -> torch.Tensor:
        """[..., len(ids)] logits of the draft vocabulary (all of it without ``ids``)."""
        return torch.nn.functional.linear(f, self.w_out)

    def _step(self, feats: torch.Tensor, toks: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + feats.shape[0], device=self.device)[None]
        return self.head(feats[None], self.embed(toks[None]), cache=self.cache, position_ids=pos)[0, -1]

    @torch.inference_mode()
    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        n = len(tokens)
        k = min(self.shape.max_depth, max_tokens)
        if k <= 0 or self.feats.shape[0] == 0:
            return DraftTree.empty()
        assert self.feats.shape[0] == n - 1, (self.feats.shape, n)
        if getattr(self.head, "version", 0) != self._weights:  # keys and values of older weights: fed again
            self._new_cache()
        extra = self.cache.get_seq_length() - self.n_true
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.x: a negative count drops positions
        fed = torch.tensor(tokens[self.n_true + 1 :], dtype=torch.long, device=self.device)
        f = self._step(self.feats[self.n_true :], fed, self.n_true)
        self.n_true = n - 1
        if self.spec.tree != "chain":
            self._tree = self.growing(self.shape, self.sp, self.gen, ctx=self.n_true)
            self._pf = {-1: f}  # predicted feature of each fed node (-1: the last true position)
            return self._tree.grow(self.logits(f), k, self._score_level)
        out, probs = [], []
        for i in range(k):
            logits = self.logits(f)
            if self.sp.greedy:
                t = logits.argmax(-1)
            else:
                q = probs_from_logits(logits, self.sp)
                t = sample(q, self.gen)
                probs.append(q)
            out.append(t)
            if i + 1 < k:
                f = self._step(f[None], t.reshape(1), n - 1 + i)
        return DraftTree.chain(torch.stack(out), torch.stack(probs) if probs else None)

    def _score_level(self, nodes: list[int]) -> torch.Tensor:
        """One head forward for a tree level: node i reads (its parent's predicted feature, embed of its
        token) under the tree mask; logits [len(nodes), V] of its children."""
        tree = self._tree
        mask, pos = tree.level_mask(nodes, self.cache.get_seq_length(), self.feats.dtype)
        mask, pos = mask.to(self.device), pos.to(self.device)  # (built on the host, node by node)
        feats = torch.stack([self._pf[tree.parents[i]] for i in nodes])
        toks = torch.tensor([tree.tokens[i] for i in nodes], dtype=torch.long, device=self.device)
        out = self.head(feats[None], self.embed(toks[None]), cache=self.cache, position_ids=pos, attention_mask=mask)[0]
        for j, i in enumerate(nodes):
            self._pf[i] = out[j]
        return self.logits(out)

    def observe(self, step) -> None:
        """Keeps the target's features of the verified draft's accepted path (whoever drafted it: inside
        auto, another arm may have)."""
        rows = accepted_rows(step.draft, step.hidden.shape[0], step.accepted, step.emitted)
        self.feats = torch.cat([self.feats, self._features(step.hidden[rows]).to(self.feats.dtype)])

    def _features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The feature this head reads from the target's [n, H * blocks] (block 0: the final norm's)."""
        return hidden[:, : self.width]
