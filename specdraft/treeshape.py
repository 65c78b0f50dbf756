"""A token tree shaped for this machine (Sequoia's question, answered by a greedy search).

Input: the draft's *rank acceptance* ``p[r]`` = P(the target's next token is the draft's r-th most
likely token), measured on the target's own greedy continuations (``rank_acceptance``), and the
measured cost curves of the target (a forward scoring n tokens) and of the draft (a forward of w
tokens: a static tree drafts one level per forward).

With acceptance independent of depth (Sequoia's assumption), a node whose path from the root takes
ranks r1..rd is accepted with probability prod p[ri], and a tree of n nodes is expected to emit
1 + the sum of those over its nodes. A node's value is at most its parent's and, for decreasing p,
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
def rank_acceptance(draft, prompts: list[list[int]], outputs: list[list[int]], ranks: int = 8) -> list[float]:
    """p[r], r < ``ranks``: how often the target's token (``outputs``, its greedy continuation of each
    prompt) is the draft's r-th most likely next token, over every output position."""
    counts = torch.zeros(ranks)
    total = 0
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        rows = draft.new_rows()
        rows.add_rows([prompt[:-1]])
        feed = [prompt[-1]] + out[:-1]
        logits = rows.forward([feed], keep=len(feed))[0].float()  # [n, V]: position j predicts out[j]
        truth = torch.tensor(out).clamp(max=logits.shape[-1] - 1)  # same tokenizer; vocab padding may differ
        true_logit = logits[torch.arange(len(out)), truth]
        rank = (logits > true_logit[:, None]).sum(-1)
        counts += torch.bincount(rank.clamp(max=ranks), minlength=ranks + 1)[:ranks].float()
        total += len(out)
        rows.remove_rows([0])
    return (counts / max(total, 1)).tolist()


def best_tree(p: list[float], target_s, draft_s, max_nodes: int = 32) -> dict:
    """The tree of at most ``max_nodes`` nodes with the most expected tokens per second.
    ``target_s(n)``: seconds of a target forward of n tokens; ``draft_s(w)``: of a draft forward of w."""
    p = [max(x, 1e-9) for x in p]
    heap = [(-p[0], (0,))]
    nodes, value, per_size = [], 0.0, []
    while heap and len(nodes) < max_nodes:
        v, path = heapq.heappop(heap)
        v = -v
        nodes.append(path)
        value += v
        heapq.heappush(heap, (-v * p[0], path + (0,)))
        if path[-1] + 1 < len(p):
            heapq.heappush(heap, (-v / p[path[-1]] * p[path[-1] + 1], path[:-1] + (path[-1] + 1,)))
        width = {}
        for q in nodes:
            width[len(q)] = width.get(len(q), 0) + 1
        depth = max(width)
        seconds = target_s(len(nodes) + 1) + sum(draft_s(1 if d == 1 else width[d - 1]) for d in range(1, depth + 1))
        per_size.append({"nodes": len(nodes), "depth": depth, "expected_tokens": round(1 + value, 4),
                         "seconds": seconds, "tokens_per_s": (1 + value) / seconds})
    best = max(per_size, key=lambda r: r["tokens_per_s"])
    choices = [list(q) for q in nodes[: best["nodes"]]]
    return {"choices": sorted(choices, key=lambda c: (len(c), c)), "expected_tokens": best["expected_tokens"],
            "tokens_per_s": best["tokens_per_s"], "plain_tokens_per_s": 1.0 / target_s(1), "per_size": per_size}
