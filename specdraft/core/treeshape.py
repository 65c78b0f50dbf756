"""A token tree shaped for this machine (Sequoia's question, answered by a greedy search).

Input: the draft's *rank acceptance* ``p[r]`` = P(the target's next token is the draft's r-th most
likely token), measured on the target's own greedy continuations (``rank_acceptance``), and the
measured cost curves of the target (a forward scoring n tokens) and of the draft (a forward of w
tokens: a static tree drafts one level per forward).

A node whose path from the root takes ranks r1..rd is accepted with probability p[r1] times, for
each deeper level, the acceptance of rank ri *given the parent's rank* (``p_next``: a draft that
agreed once tends to keep agreeing; with independence, Sequoia's assumption, p again), and a tree of n nodes is expected
to emit 1 + the sum of those over its nodes. A node's value is at most its parent's and, for decreasing p,
at most its left sibling's, so the n most valuable nodes always form a valid tree (prefix-closed,
ranks contiguous): popping nodes from a heap in value order (pushing a popped node's first child
and next sibling) yields the best tree of every size n, the optimum of Sequoia's dynamic program
for this objective. The size is then chosen for the best expected tokens per second:
(1 + value) / (target(n + 1) + sum over levels of draft(width of the level before)).
"""

from __future__ import annotations

import heapq

import torch


@torch.inference_mode()
def rank_stats(
    draft, prompts: list[list[int]], outputs: list[list[int]], ranks: int = 8
) -> tuple[list[float], list[list[float]]]:
    """(p, p_next): p[r] = how often the target's token (``outputs``, its greedy continuation of each
    prompt) is the draft's r-th most likely next token, over every output position; p_next[b][r] the
    same at a position whose previous token had rank 0 (b = 0) or another rank (b = 1): acceptance is
    not independent of depth (a draft that agreed once tends to keep agreeing)."""
    counts = torch.zeros(ranks)
    after = torch.zeros(2, ranks)
    totals = torch.zeros(3)
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        rows = draft.new_rows()
        rows.add_rows([prompt[:-1]])
        feed = [prompt[-1]] + out[:-1]
        logits = rows.forward([feed], keep=len(feed))[0].float()  # [n, V]: position j predicts out[j]
        truth = torch.tensor(out).clamp(max=logits.shape[-1] - 1)  # same tokenizer; vocab padding may differ
        true_logit = logits[torch.arange(len(out)), truth]
        rank = (logits > true_logit[:, None]).sum(-1).clamp(max=ranks)
        counts += torch.bincount(rank, minlength=ranks + 1)[:ranks].float()
        totals[2] += len(out)
        prev = (rank[:-1] > 0).long()
        for b in (0, 1):
            nxt = rank[1:][prev == b]
            after[b] += torch.bincount(nxt, minlength=ranks + 1)[:ranks].float()
            totals[b] += nxt.numel()
        rows.remove_rows([0])
    p = (counts / max(float(totals[2]), 1.0)).tolist()
    p_next = [(after[b] / totals[b]).tolist() if totals[b] else p for b in (0, 1)]
    return p, p_next


def rank_acceptance(draft, prompts, outputs, ranks: int = 8) -> list[float]:
    """p[r] of ``rank_stats``."""
    return rank_stats(draft, prompts, outputs, ranks)[0]


def path_value(path: tuple[int, ...], p: list[float], p_next: list[list[float]] | None) -> float:
    """P(every node on ``path`` is accepted): the root level by p, deeper levels by p_next given the
    parent's rank (p again when p_next is None: independence)."""
    v = p[path[0]]
    for a, b in zip(path, path[1:]):
        v *= (p_next[min(a, 1)] if p_next else p)[b]
    return v


def best_tree(p: list[float], target_s, draft_s, max_nodes: int = 32, p_next: list[list[float]] | None = None) -> dict:
    """The tree of at most ``max_nodes`` nodes with the most expected tokens per second.
    ``target_s(n)``: seconds of a target forward of n tokens; ``draft_s(w)``: of a draft forward of w;
    ``p_next`` (optional): depth-conditional rank acceptance (``rank_stats``)."""
    p = [max(x, 1e-9) for x in p]
    if p_next is not None:
        p_next = [[max(x, 1e-9) for x in row] for row in p_next]
    value = lambda q: path_value(q, p, p_next)  # noqa: E731
    heap: list[tuple[float, tuple[int, ...]]] = [(-value((0,)), (0,))]
    nodes: list[tuple[int, ...]] = []
    total, per_size = 0.0, []
    width: dict[int, int] = {}  # nodes per depth
    while heap and len(nodes) < max_nodes:
        v, path = heapq.heappop(heap)
        nodes.append(path)
        total += -v
        width[len(path)] = width.get(len(path), 0) + 1
        heapq.heappush(heap, (-value(path + (0,)), path + (0,)))
        if path[-1] + 1 < len(p):
            sib = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (-value(sib), sib))
        depth = max(width)
        seconds = target_s(len(nodes) + 1) + sum(draft_s(1 if d == 1 else width[d - 1]) for d in range(1, depth + 1))
        per_size.append(
            {
                "nodes": len(nodes),
                "depth": depth,
                "expected_tokens": round(1 + total, 4),
                "seconds": seconds,
                "tokens_per_s": (1 + total) / seconds,
            }
        )
    best = max(per_size, key=lambda r: r["tokens_per_s"])
    choices = [list(q) for q in nodes[: best["nodes"]]]
    return {
        "choices": sorted(choices, key=lambda c: (len(c), c)),
        "expected_tokens": best["expected_tokens"],
        "tokens_per_s": best["tokens_per_s"],
        "plain_tokens_per_s": 1.0 / target_s(1),
        "per_size": per_size,
    }
