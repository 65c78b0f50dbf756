"""When to speculate, and how far: a cost-aware draft length (``SpecConfig.schedule="cost_aware"``).

Speculation pays only when the tokens a step is expected to emit outweigh what the step costs. Both
sides are measured online, on the machine at hand:

- ``cost(n)``: seconds of a step whose target forward scores n tokens (draft + pending), an EMA
  per n, interpolated between measured n (never extrapolated below the largest measured value);
- ``draft_cost``: seconds per drafted token (an EMA; ~0 for prompt lookup);
- ``acc[i]``: P(draft position i accepted | positions before it accepted), an EMA.

Each step drafts the k in 0..cap maximizing E[emitted] / E[seconds], with
E[emitted] = 1 + sum_{j=1..k} prod_{i<j} acc[i] and E[seconds] = k * draft_cost + cost(k + 1).
k = 0 is plain decoding. The costs it needs first are measured by exploration (cost(1), then
cost(cap + 1)); while speculation does not pay, one step in ``explore_every`` still drafts, so
acceptance estimates stay current. Only what is drafted changes: the output is exactly the same.
"""

from __future__ import annotations

import bisect

from .errors import ConfigError


def interpolate(curve: dict[int, float], n: float) -> float:
    """A measured cost curve {n: seconds} at any n: linear between measured points, the first point's
    value below them, the last slope extended beyond them."""
    ns = sorted(curve)
    i = bisect.bisect_left(ns, n)
    if i == 0:
        return curve[ns[0]]
    if i == len(ns):
        a, b = ns[-2:] if len(ns) > 1 else (ns[0], ns[0])
        return curve[b] + (curve[b] - curve[a]) / max(b - a, 1) * (n - b)
    a, b = ns[i - 1], ns[i]
    return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)


def chain_tokens(alpha: float, k: int) -> float:
    """Tokens a step of k chained draft tokens yields when each is accepted with probability alpha."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def best_depth(alpha: float, cap: int, step_s) -> tuple[int, float]:
    """The draft depth d in 0..cap with the most expected tokens per second, chain_tokens(alpha, d) /
    step_s(d) (d = 0: plain decoding), and that rate."""
    best = (0, 1.0 / step_s(0))
    for d in range(1, cap + 1):
        rate = chain_tokens(alpha, d) / step_s(d)
        if rate > best[1]:
            best = (d, rate)
    return best


class CostAwarePolicy:
    """``costs`` (optional): a measured cost curve {n: seconds of a forward scoring n tokens} to start
    from (``SpecDecoder.cost_curve``), so a step need not explore costs first and a curve that is not
    monotonic (llama.cpp's Q4_0: 4 tokens cost less than 3) is known at every n."""

    def __init__(
        self,
        max_k: int,
        explore_every: int = 16,
        ema: float = 0.3,
        prior_acceptance: float = 0.6,
        costs: dict[int, float] | None = None,
    ):
        self.max_k = max_k
        self.cost: dict[int, float] = dict(costs or {})
        self.draft_cost = 0.0
        self.acc: list[float] = []
        self.prior = prior_acceptance
        self.ema = ema
        self.explore_every = explore_every
        self.since_spec = 0

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    def est_cost(self, n: int) -> float:
        if n in self.cost:
            return self.cost[n]
        ns = sorted(self.cost)
        i = bisect.bisect_left(ns, n)
        if i == 0:
            return self.cost[ns[0]]
        if i == len(ns):
            return self.cost[ns[-1]]
        a, b = ns[i - 1], ns[i]
        return self.cost[a] + (self.cost[b] - self.cost[a]) * (n - a) / (b - a)

    def expected_tokens(self, k: int) -> float:
        e, run = 1.0, 1.0
        for i in range(k):
            run *= self.acc[i] if i < len(self.acc) else self.prior
            e += run
        return e

    def choose(self, cap: int) -> int:
        if cap <= 0:
            return 0
        if 1 not in self.cost:
            return 0
        if cap + 1 not in self.cost and not any(n > cap for n in self.cost):
            return cap
        best_k, best = 0, 1.0 / self.est_cost(1)
        for k in range(1, cap + 1):
            rate = self.expected_tokens(k) / (k * self.draft_cost + self.est_cost(k + 1))
            if rate > best:
                best_k, best = k, rate
        if best_k == 0 and self.since_spec >= self.explore_every:
            best_k = max(
                range(1, cap + 1), key=lambda k: self.expected_tokens(k) / (k * self.draft_cost + self.est_cost(k + 1))
            )
        return best_k

    def observe(self, drafted: int, accepted: int, draft_s: float, step_s: float, scored: int | None = None) -> None:
        """One verification step: ``drafted`` tokens, ``accepted`` of them; ``step_s`` is the
        target-side time; ``scored`` the tokens the target forward scored (None: skip the cost,
        e.g. for the prefill step)."""
        if scored is not None:
            self.cost[scored] = self._avg(self.cost.get(scored), step_s)
        if drafted:
            self.since_spec = 0
            self.draft_cost = self._avg(self.draft_cost if self.draft_cost else None, draft_s / drafted)
            while len(self.acc) < drafted:
                self.acc.append(self.prior)
            for i in range(min(accepted + 1, drafted)):  # position i was tested iff all before it passed
                self.acc[i] = self._avg(self.acc[i], 1.0 if i < accepted else 0.0)
        else:
            self.since_spec += 1


# --- the one draft-length policy, used at every batch size ----------------------------------------
class DraftLength:
    """How deep a request drafts each step. ``choose(depth, limit)``: ``depth`` is the drafter's own
    deepest draft (``Drafter.max_draft_depth()``, None = unbounded), ``limit`` the tokens the request
    may still emit minus one; ``observe`` sees every step's outcome. Base: constant (the drafter's
    depth)."""

    reproducible = True  # False: the choice reacts to timing, so a seeded sample depends on load

    def choose(self, depth: int | None, limit: int) -> int:
        return limit if depth is None else min(depth, limit)

    def observe(self, drafted: int, accepted: int, draft_s: float, step_s: float, scored: int | None) -> None:
        pass


class HeuristicLength(DraftLength):
    """transformers' assisted-generation rule: k + 2 after a fully accepted step, k - 1 otherwise,
    within 1..max_k."""

    def __init__(self, k: int, max_k: int):
        self.k, self.max_k = k, max_k

    def choose(self, depth, limit):
        return min(self.k, limit)

    def observe(self, drafted, accepted, draft_s, step_s, scored):
        if drafted:
            self.k = min(self.k + 2, self.max_k) if accepted == drafted else max(self.k - 1, 1)


class CostAwareLength(DraftLength):
    """``CostAwarePolicy`` (shared by the requests of one decoder and spec, so its measurements
    persist) choosing k in 0..k each step."""

    reproducible = False

    def __init__(self, policy: CostAwarePolicy):
        self.policy = policy

    def choose(self, depth, limit):
        return self.policy.choose(min(limit, self.policy.max_k))

    def observe(self, drafted, accepted, draft_s, step_s, scored):
        self.policy.observe(drafted, accepted, draft_s, step_s, scored)


def draft_length(spec, shared: CostAwarePolicy | None = None) -> DraftLength:
    """The DraftLength of a SpecConfig's ``schedule`` (``shared``: the cost-aware measurements)."""
    if spec.schedule == "heuristic":
        return HeuristicLength(spec.k, spec.max_k)
    if spec.schedule == "cost_aware" and shared is not None:
        return CostAwareLength(shared)
    return DraftLength()


class BatchRule:
    """Shrink speculation as the batch grows: a batched forward already uses the hardware better,
    so drafted-then-rejected tokens cost more. From ``shrink_at`` rows the draft depth is halved,
    from ``off_at`` rows nothing is drafted (plain steps). Output is unchanged; only drafting is.
    Seeded sampling rows are exempt: their draft (and so their sample) must not depend on what else
    runs."""

    def __init__(self, shrink_at: int, off_at: int):
        if shrink_at < 1 or off_at < 1:
            raise ConfigError(f"batch policy thresholds must be >= 1, got shrink_at={shrink_at}, off_at={off_at}")
        self.shrink_at, self.off_at = shrink_at, off_at

    def cap(self, batch_size: int, k: int) -> int:
        if batch_size >= self.off_at:
            return 0
        if batch_size >= self.shrink_at:
            return max(1, k // 2) if k > 0 else 0
        return k
