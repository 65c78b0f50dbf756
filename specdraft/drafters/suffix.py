"""Suffix drafting (SuffixDecoding, SAM-Decoding, REST): find the longest suffix of the context that
occurred before, and draft a tree of the most frequent continuations of its occurrences.

Two sources, one tree builder:

- per request, a suffix automaton over prompt + output (``SuffixAutomaton``), extended by the new
  tokens only (amortized O(1) per token); the longest earlier-occurring suffix of the text is the
  suffix link of the automaton's last state, and its occurrences are the end positions in that
  state's subtree of the suffix-link tree;
- optionally, global stores: a datastore, a suffix array over a tokenized corpus
  (``specdraft.drafters.datastore``), searched by binary search; and, on a decoder that learns online,
  the outputs it served lately (``datastore.ServedOutputs``), searched the same way.

The continuations of (up to ``max_occurrences``) occurrences are merged into a count trie
(``count_tree``, vectorized over occurrences with numpy); node score = count / occurrences, the
empirical probability that the text continues along that path. The ``tree_nodes`` best nodes with
score >= ``min_token_prob`` form the draft; depth <= min(k, max_tokens, ceil(max_spec_factor x
match length)). Deterministic, so ``draft_probs`` is None.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..core.config import SpecConfig
from ..core.tree import DraftTree
from .base import Drafter


class SuffixAutomaton:
    """The suffix automaton (DAWG) of a growing token sequence (Blumer et al. 1985).

    ``extend(t)`` appends one token in amortized O(1) (dict transitions). States keep their
    ``firstpos`` (end position of the first occurrence) and the suffix-link tree's children, so the
    end positions of a state's strings are the ``firstpos`` of the non-clone states in its subtree.
    """

    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.firstpos: list[int] = [-1]
        self.is_clone: list[bool] = [False]
        self.children: list[set[int]] = [set()]
        self.last = 0
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def _new(self, length: int, firstpos: int, clone: bool, nxt: dict[int, int]) -> int:
        self.next.append(nxt)
        self.link.append(-1)
        self.length.append(length)
        self.firstpos.append(firstpos)
        self.is_clone.append(clone)
        self.children.append(set())
        return len(self.length) - 1

    def _set_link(self, s: int, target: int) -> None:
        old = self.link[s]
        if old >= 0:
            self.children[old].discard(s)
        self.link[s] = target
        self.children[target].add(s)

    def extend(self, t: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(t)
        nxt, length = self.next, self.length
        cur = self._new(length[self.last] + 1, pos, False, {})
        p = self.last
        while p != -1 and t not in nxt[p]:
            nxt[p][t] = cur
            p = self.link[p]
        if p == -1:
            self._set_link(cur, 0)
        else:
            q = nxt[p][t]
            if length[p] + 1 == length[q]:
                self._set_link(cur, q)
            else:
                clone = self._new(length[p] + 1, self.firstpos[q], True, dict(nxt[q]))
                self._set_link(clone, self.link[q])
                while p != -1 and nxt[p].get(t) == q:
                    nxt[p][t] = clone
                    p = self.link[p]
                self._set_link(q, clone)
                self._set_link(cur, clone)
        self.last = cur

    def extend_many(self, tokens) -> None:
        for t in tokens:
            self.extend(int(t))

    def match_state(self) -> int:
        """The state of the longest suffix of the text that also ends at an earlier position (the
        suffix link of the last state); 0 (the root, length 0) if none."""
        return max(self.link[self.last], 0)

    def match_len(self) -> int:
        return self.length[self.match_state()]

    def state_of_len(self, m: int) -> int:
        """The state holding the text's suffix of length ``m``."""
        s = self.last
        while self.link[s] >= 0 and self.length[self.link[s]] >= m:
            s = self.link[s]
        return s

    def end_positions(self, state: int, limit: int) -> list[int]:
        """End positions of ``state``'s strings, excluding the text's last position, at most
        ``limit`` of them (the most recent among the first ``4 * limit`` states visited)."""
        last = len(self.tokens) - 1
        out, stack, budget = [], [state], 4 * limit
        while stack and budget > 0:
            s = stack.pop()
            budget -= 1
            if not self.is_clone[s] and s != 0 and self.firstpos[s] != last:
                out.append(self.firstpos[s])
            stack.extend(self.children[s])
        out.sort(reverse=True)
        return out[:limit]


def brute_force_match_len(tokens: list[int]) -> int:
    """The length of the longest suffix of ``tokens`` that also ends at an earlier position."""
    n = len(tokens)
    best = 0
    for m in range(1, n):
        suf = tokens[n - m :]
        if any(tokens[e - m + 1 : e + 1] == suf for e in range(m - 1, n - 1)):
            best = m
        else:
            break
    return best


def count_tree(
    paths: np.ndarray, budget: int, min_prob: float, denom: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge continuation paths (int64 [occ, D], -1 padded after a path ends) into a count trie and
    keep the best ``budget`` nodes with count / denom >= ``min_prob``.

    Returns (tokens, parents, scores), topologically ordered, scores descending (a node never
    scores above its parent, ties go to the shallower node, so the kept set is a tree). Vectorized:
    one pass of numpy over the lexicographically sorted paths per depth.
    """
    occ, D = paths.shape
    empty = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))
    if occ == 0 or D == 0 or budget <= 0:
        return empty
    denom = occ if denom is None else denom
    min_count = max(1, math.ceil(min_prob * denom - 1e-9))
    paths = paths[np.lexsort(paths.T[::-1])]
    boundary = np.zeros(occ, dtype=bool)
    boundary[0] = True
    counts_l, depth_l, start_l, tok_l, par_l = [], [], [], [], []
    prev_starts, prev_ids, n_nodes = None, None, 0
    for d in range(D):
        col = paths[:, d]
        boundary[1:] |= col[1:] != col[:-1]
        starts = np.flatnonzero(boundary)
        counts = np.diff(np.append(starts, occ))
        tok = col[starts]
        keep = (tok >= 0) & (counts >= min_count)
        if not keep.any():
            break
        if prev_starts is None:
            par = np.full(starts.shape, -1, dtype=np.int64)
        else:
            par = prev_ids[np.searchsorted(prev_starts, starts, side="right") - 1]
            keep &= par >= 0
            if not keep.any():
                break
        ids = np.full(starts.shape, -1, dtype=np.int64)
        ids[keep] = n_nodes + np.arange(int(keep.sum()))
        n_nodes += int(keep.sum())
        counts_l.append(counts[keep])
        depth_l.append(np.full(int(keep.sum()), d))
        start_l.append(starts[keep])
        tok_l.append(tok[keep])
        par_l.append(par[keep])
        prev_starts, prev_ids = starts, ids
    if not counts_l:
        return empty
    counts, depth, start = np.concatenate(counts_l), np.concatenate(depth_l), np.concatenate(start_l)
    tok, par = np.concatenate(tok_l), np.concatenate(par_l)
    order = np.lexsort((start, depth, -counts))[:budget]  # parents strictly precede their children
    new_id = np.full(n_nodes, -1, dtype=np.int64)
    new_id[order] = np.arange(order.shape[0])
    parents = np.where(par[order] >= 0, new_id[np.maximum(par[order], 0)], -1)
    return tok[order], parents, counts[order] / denom


def continuation_paths(tokens: np.ndarray, ends: np.ndarray, depth: int) -> np.ndarray:
    """Rows tokens[e + 1 : e + 1 + depth] for each end position e, -1 padded past the end and past
    any negative (separator) token."""
    n = tokens.shape[0]
    idx = ends[:, None] + 1 + np.arange(depth)[None, :]
    P = np.where(idx < n, tokens[np.minimum(idx, n - 1)], -1).astype(np.int64)
    return np.where(np.cumsum(P < 0, axis=1) > 0, -1, P)


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, spec: SpecConfig, datastore=None, served=None):
        """``datastore``: a Datastore or None; ``served``: a snapshot of the outputs served lately
        (``ServedOutputs.snapshot()``) or None. Both are global stores."""
        self.spec = spec
        self.stores = [s for s in (datastore, served) if s is not None]
        self.sam = SuffixAutomaton()
        self._buf = np.empty(0, dtype=np.int64)
        self._begin_global()
        self.last_source = None  # "local" | "global" | None: which tree the last proposal used
        if served is not None:
            self.reproducible = False  # what it drafts depends on what else the decoder served

    def max_draft_depth(self) -> int:
        return self.spec.k

    def _begin_global(self) -> None:
        self._g = [(0, None)] * len(self.stores)  # per store: the last match length and the text length then
        self._g_m = 0  # the match length of the global tree drafted last

    def begin(self, prompt_ids, sp, generator, processor=None):
        self.sam = SuffixAutomaton()
        self._begin_global()
        self._buf = np.empty(max(64, 2 * len(prompt_ids)), dtype=np.int64)
        self._sync([int(t) for t in prompt_ids])

    def _sync(self, tokens: list[int]) -> None:
        n = len(self.sam)
        if len(tokens) < n or (n and tokens[n - 1] != self.sam.tokens[n - 1]):
            self.sam = SuffixAutomaton()  # not a continuation of what we saw: rebuild
            self._begin_global()
            n = 0
        new = tokens[n:]
        self.sam.extend_many(new)
        end = len(self.sam)
        if end > self._buf.shape[0]:  # amortized O(1) append: grow by doubling
            buf = np.empty(max(64, 2 * end), dtype=np.int64)
            buf[:n] = self._buf[:n]
            self._buf = buf
        self._buf[n:end] = new

    def _depth(self, match_len: int, max_tokens: int) -> int:
        return min(self.spec.k, max_tokens, math.ceil(self.spec.params.max_spec_factor * match_len))

    def local_tree(self, max_tokens: int):
        m = self.sam.match_len()
        depth = self._depth(m, max_tokens)
        if m == 0 or depth <= 0:
            return None
        ends = np.asarray(
            self.sam.end_positions(self.sam.match_state(), self.spec.params.max_occurrences), dtype=np.int64
        )
        if ends.size == 0:
            return None
        paths = continuation_paths(self._buf[: len(self.sam)], ends, depth)
        return count_tree(paths, self.spec.params.tree_nodes, self.spec.params.min_token_prob)

    def global_tree(self, tokens: list[int], max_tokens: int, i: int = 0):
        """(the match length in global store i, its tree or None)."""
        store = self.stores[i]
        m0, at = self._g[i]  # the match can grow by at most the tokens appended since the last lookup
        m, ends = store.lookup(tokens, self.spec.params.max_occurrences, None if at is None else m0 + len(tokens) - at)
        self._g[i] = (m, len(tokens))
        depth = self._depth(m, max_tokens)
        if m == 0 or depth <= 0 or ends.size == 0:
            return m, None
        paths = continuation_paths(store.tokens, ends, depth)
        return m, count_tree(paths, self.spec.params.tree_nodes, self.spec.params.min_token_prob)

    def propose(self, tokens: list[int], max_tokens: int) -> DraftTree:
        self._sync(tokens)
        self.last_source = None
        if min(self.spec.k, max_tokens) <= 0:
            return DraftTree.empty()
        trees = [("local", self.sam.match_len(), self.local_tree(max_tokens))]
        trees += [("global", *self.global_tree(tokens, max_tokens, i)) for i in range(len(self.stores))]
        best, best_score = None, 0.0
        for source, m, tree in trees:
            if tree is not None and tree[0].size and float(tree[2].sum()) > best_score:
                best, best_score, self.last_source = tree, float(tree[2].sum()), source
                self._g_m = m if source == "global" else self._g_m
        if best is None:
            return DraftTree.empty()
        return DraftTree(torch.from_numpy(best[0].copy()), torch.from_numpy(best[1].copy()))

    def last_match_len(self) -> int:
        """The length of the match the last proposal drafted from (the automaton's, or a global store's)."""
        return self._g_m if self.last_source == "global" else self.sam.match_len()
