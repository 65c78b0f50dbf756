"""Verification: pure, batched functions on tensors. Names follow vLLM's rejection sampler:

- accepted: draft tokens the target keeps (a prefix of the chain),
- recovered: the token sampled from the residual distribution at the first rejection,
- bonus: the token sampled from the target after every draft token was accepted.

Shapes, for B rows each with a chain of up to k draft tokens over a vocabulary of V:

- ``draft_tokens`` [B, k] (LongTensor); ``num_draft`` [B] optional, the real length of each row's
  chain (ragged batches; positions past it are padding and never accepted);
- ``target_*`` [B, k + 1, V]: row i predicts the token after the context plus the first i drafts;
- ``draft_probs`` [B, k, V]: the distribution each draft token was sampled from, or None for a
  deterministic drafter (one-hot at the drafted token).

Each function returns ``(num_accepted [B], next_token [B])``; row b emits
``draft_tokens[b, :num_accepted[b]]`` followed by ``next_token[b]`` (recovered or bonus).
No Python loop over rows, positions or the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .device import HOST
from .sampling import argmax_last, probs_from_logits, sample, uniform


def _valid(draft_tokens: torch.Tensor, num_draft: torch.Tensor | None) -> torch.Tensor:
    B, k = draft_tokens.shape
    if num_draft is None:
        return torch.ones(B, k, dtype=torch.bool, device=draft_tokens.device)
    return torch.arange(k, device=draft_tokens.device)[None, :] < num_draft[:, None]


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row."""
    return torch.cumprod(ok.to(torch.int64), dim=-1).sum(dim=-1)


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix equal to the target's argmax, then the target's argmax after it."""
    k = draft_tokens.shape[1]
    argmax = argmax_last(target_logits)  # [B, k+1]
    ok = (argmax[:, :k] == draft_tokens) & _valid(draft_tokens, num_draft)
    n = _prefix_len(ok)
    return n, argmax.gather(1, n[:, None]).squeeze(1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row-wise, unnormalized (sampling normalizes)."""
    return torch.clamp(p - q, min=0.0)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    num_draft: torch.Tensor | None = None,
    strict: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for chains (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    sample the recovered token from norm(max(0, p_i - q_i)); if the whole chain is accepted sample
    the bonus token from p_k. The emitted tokens are then distributed exactly as the target's.
    ``strict`` False: a row with no token to sample gets next token -1 (``sampling.sample``).
    """
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    rows = torch.arange(B, device=target_probs.device)
    valid = _valid(draft_tokens, num_draft)
    nd = valid.sum(dim=1)
    if k > 0:
        p_x = target_probs[:, :k].gather(2, draft_tokens[:, :, None]).squeeze(2)
        q_x = (
            torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, draft_tokens[:, :, None]).squeeze(2)
        )
        u = uniform((B, k), generator, target_probs.device)
        n = _prefix_len((u * q_x < p_x) & valid)  # u < p/q without dividing; q_x > 0 for drafted tokens
    else:
        n = torch.zeros(B, dtype=torch.long, device=target_probs.device)
    p_n = target_probs[rows, n]  # [B, V]
    if k > 0:
        at = torch.clamp(n, max=k - 1)
        if draft_probs is None:
            q_n = torch.nn.functional.one_hot(draft_tokens[rows, at], V).to(p_n.dtype)
        else:
            q_n = draft_probs[rows, at]
        rejected = (n < nd)[:, None]
        dist = torch.where(rejected, residual_distribution(p_n, q_n), p_n)
        # p == q up to rounding: the rejection had probability ~0, and p itself is then exact
        dist = torch.where(dist.sum(dim=1, keepdim=True) > 0, dist, p_n)
    else:
        dist = p_n
    return n, sample(dist, generator, strict)


def greedy_verify_tree(tree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification of a token tree scored in one forward.

    ``target_logits`` [n + 1, V]: row 0 predicts the root's children, row 1 + i node i's children.
    Node i is correct when its token is the target's argmax at its parent; the accepted path is the
    deepest node whose whole path is correct (the first such node on ties). Returns the path's node
    indices (root to leaf) and the target's argmax after it.
    """
    return greedy_tree_path(tree, argmax_last(target_logits).to(HOST))


def greedy_tree_path(tree, argmax: torch.Tensor) -> tuple[list[int], int]:
    """``greedy_verify_tree`` from the target's argmax [n + 1] at the fed positions, on the host."""
    if tree.size == 0:
        return [], int(argmax[0])
    path = _deepest_path(tree, tree.tokens == argmax[tree.parents + 1])
    return path, int(argmax[path[-1] + 1 if path else 0])


def _deepest_path(tree, correct: torch.Tensor) -> list[int]:
    """The deepest node whose whole path is ``correct`` (bool [n], per node; the first such node on
    ties), as node indices root to leaf; [] when no child of the root is correct."""
    correct = correct.to(HOST)
    ok = ~(tree.ancestors() & ~correct[None, :]).any(dim=1)
    score = torch.where(ok, tree.depths(), torch.zeros_like(tree.tokens))
    best = int(score.argmax())
    return tree.path_to(best) if int(score[best]) > 0 else []


def rejection_sample_tree(tree, target_probs: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """Lossless sampling verification of a token tree: multi-draft recursive rejection sampling
    (SpecInfer's multi-step speculative sampling; SpecTr / Recursive Speculative Decoding).

    ``target_probs`` [n + 1, V]: row 0 is the target's processed distribution at the root (after
    the context), row 1 + i after node i. ``tree.draft_probs[i]`` is the distribution node i was
    drawn from *given its earlier siblings* (for siblings drawn without replacement: the parent's
    draft distribution with the earlier siblings' tokens removed and renormalized; for i.i.d.
    siblings: the same distribution for each), or None for a deterministic drafter (one-hot).

    Starting at the root with p = target distribution, try the children of the current node in
    index order: accept child x with probability min(1, p(x) / q(x)); on acceptance descend into it
    (p = the target's distribution after it); on rejection replace p by the residual
    norm(max(0, p - q)) and try the next child. When no child is accepted (or there is none),
    sample the next token from p: the recovered token (p is a residual) or the bonus token (p is
    the target's own distribution). Each child is a standard speculative-sampling step against the
    current p, whose rejection branch is realized by the rest of the siblings, so every emitted
    token is distributed exactly as the target's (docs/design.md has the argument).

    Returns (accepted node indices root to leaf, next token). The loop is sequential over the
    tried nodes by nature; tree sizes are small (<= 64 nodes).
    """
    n = tree.size
    children: list[list[int]] = [[] for _ in range(n + 1)]  # slot 0 = root, slot 1 + i = node i
    for i, par in enumerate(tree.parents.tolist()):
        children[par + 1].append(i)
    tokens = tree.tokens.tolist()
    u = uniform(n, generator, HOST).tolist() if n else []
    q_all = None if tree.draft_probs is None else tree.draft_probs.to(target_probs.device)
    path: list[int] = []
    p = target_probs[0]
    slot = 0
    while True:
        nxt_node = None
        for c in children[slot]:
            x = tokens[c]
            if q_all is None:  # deterministic child: q = one-hot(x)
                if u[c] < float(p[x]):
                    nxt_node = c
                    break
                r = p.clone()  # residual of a point mass: p without x (norm(max(0, p - onehot(x))))
                r[x] = 0
            else:
                q = q_all[c]
                if u[c] * float(q[x]) < float(p[x]):  # accept w.p. min(1, p(x) / q(x)); q(x) > 0 for drawn x
                    nxt_node = c
                    break
                r = residual_distribution(p, q)
            s = r.sum()
            if s > 0:  # s == 0 only when p == q up to rounding: p itself is then exact
                p = r / s
        if nxt_node is None:
            return path, int(sample(p, generator))
        path.append(nxt_node)
        slot = nxt_node + 1
        p = target_probs[slot]


# --- opt-in lossy rules (SpecConfig.lossy); never used unless a request asks for them ----------------
@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance (Cai et al. 2024, Medusa-2 section): LOSSY.

    A draft token x is accepted when the target's processed probability of it exceeds
    ``min(epsilon, delta * exp(-H(p)))``, H the entropy of that distribution: confident target
    positions demand a likely token, flat ones accept almost anything the target could say. The
    longest accepted prefix (the deepest accepted path of a tree) is kept, then the next token is
    sampled from the target's distribution after it. The output is *not* distributed as the
    target's (a plausible draft token is kept with probability 1 instead of p(x)); it only applies
    when sampling (at temperature 0 the rule is greedy verification). Defaults are Medusa's
    (posterior_threshold 0.09, posterior_alpha 0.3)."""

    epsilon: float = 0.09
    delta: float = 0.3
    name = "typical"

    def threshold(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., V] -> [...]: min(epsilon, delta * exp(-entropy))."""
        ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(dim=-1)
        return torch.clamp(self.delta * torch.exp(-ent), max=self.epsilon)

    def accepts(self, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """probs [..., V], tokens [...] -> bool [...]: is each token accepted under its distribution."""
        return probs.gather(-1, tokens[..., None]).squeeze(-1) > self.threshold(probs)


def typical_verify(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    rule: TypicalAcceptance,
    generator: torch.Generator | None,
    num_draft: torch.Tensor | None = None,
    strict: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains, batched: the longest prefix the rule accepts, then a token sampled from the target's
    distribution after it. Same shapes and return as ``rejection_sample`` (draft probabilities are
    not needed: the rule looks at the target only)."""
    B, k = draft_tokens.shape
    ok = rule.accepts(target_probs[:, :k], draft_tokens) & _valid(draft_tokens, num_draft)
    n = _prefix_len(ok)
    rows = torch.arange(B, device=target_probs.device)
    return n, sample(target_probs[rows, n], generator, strict)


def typical_verify_tree(
    tree, target_probs: torch.Tensor, rule: TypicalAcceptance, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Trees: the deepest path whose every node the rule accepts under its parent's target
    distribution, then a token sampled from the target after it. Returns (path, next token)."""
    if tree.size == 0:
        return [], int(sample(target_probs[0], generator))
    dev = target_probs.device
    path = _deepest_path(tree, rule.accepts(target_probs[(tree.parents + 1).to(dev)], tree.tokens.to(dev)))
    return path, int(sample(target_probs[path[-1] + 1 if path else 0], generator))


# --- the one dispatch both engines use ---------------------------------------------------------------
def lossy_label(rule: TypicalAcceptance | None, sp) -> str | None:
    """What a result's stats say about its verification: the lossy rule's name when it acted
    (sampling with a rule set), else None (lossless)."""
    return None if rule is None or sp.greedy else rule.name


def sample_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sp,
    generator: torch.Generator | None,
    lossy: TypicalAcceptance | None = None,
    num_draft: torch.Tensor | None = None,
    strict: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling verification of chains from the target's raw logits [B, k + 1, V] (processed here with
    the request's SamplingParams ``sp``): lossless rejection sampling, or the opt-in lossy rule. Draft
    probabilities made on another device (a draft model's) are moved to the target's."""
    p = probs_from_logits(target_logits, sp)
    if lossy is not None:
        return typical_verify(draft_tokens, p, lossy, generator, num_draft, strict)
    q = None if draft_probs is None else draft_probs.to(p.device)
    return rejection_sample(draft_tokens, q, p, generator, num_draft, strict)


def verify_tree(
    tree, target_logits: torch.Tensor, sp, generator: torch.Generator | None, lossy: TypicalAcceptance | None = None
) -> tuple[list[int], int]:
    """A token tree scored in one forward (raw logits [n + 1, V]): greedy, lossless rejection
    sampling, or the opt-in lossy rule. Returns (accepted path, next token)."""
    if sp.greedy:
        return greedy_verify_tree(tree, target_logits)
    p = probs_from_logits(target_logits, sp)
    if lossy is not None:
        return typical_verify_tree(tree, p, lossy, generator)
    return rejection_sample_tree(tree, p, generator)
