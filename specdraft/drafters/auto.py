"""``method="auto"``: the engine chooses how to draft, per request, online.

The candidate drafting configurations are *arms* (plain decoding is one; so are prompt lookup,
the suffix automaton, the draft model at its k, the hybrid). Each step drafts with one arm and is
scored by what it bought: (accepted + 1) tokens for the seconds the step costs *on this machine's
cost curve* (``SpecDecoder.cost_curve``: a target forward scoring n tokens, plus the draft model's
measured seconds per drafted token), not the step's wall clock, which is noisy and would make a
seeded sample depend on load. The start-up curve is corrected by what the decoder's steps of a batch
of one cost (``ObservedCosts``, averaged over many steps), except for a seeded sampling request. The
arm with the best rate drafts (plain's rate, 1 / cost(1), is known without trying it, so nothing runs
slower than plain for long):

- every arm is priced on the curve: from its evidence, each draft token's acceptance (accepted tokens
  over accepted tokens plus the steps that stopped at a rejection: a truncated geometric), then the
  draft depth with the most expected tokens per second (``policy.best_depth``). Exploiting, an arm drafts
  as deep as its mean acceptance pays for, and one whose mean pays for no depth is not chosen. Its
  optimistic acceptance (two more successes, at most ``ALPHA_MAX``, the best plausible) says whether it
  can still beat the best rate: where the curve says no acceptance can pay (scoring n tokens costs n plain
  steps) or the evidence says the arm loses, it is never tried, so auto decodes plainly at no exploration
  cost. A try drafts shallow (its mean acceptance's depth, at least one token) and goes ahead when its
  expected loss (its seconds less what the best rate takes for the tokens its mean acceptance expects)
  is at most what it may teach: the share of the budget's time (below) the arm would save at its
  optimistic rate, divided by one plus its steps of evidence;
- exploring (probing an arm without ``probe`` steps of evidence, its own or a prior, or trying
  another arm than the best, least tried first) happens only while the time it *loses* stays within
  ``explore_frac`` (5%) of the time on the cost curve. A step's loss is its seconds less what the best
  arm known when it was chosen would have taken for the tokens it emitted: a lookup that finds nothing
  loses nothing, a draft model that keeps 6 tokens gains, a rejected draft loses its cost. A probe may
  go ahead if its worst case (its draft at the try's depth, one token emitted, plus the draft model's catch-up)
  fits. The time is what the decoder spent so far plus what this request's remaining tokens (at most
  ``AHEAD``) cost at plain speed (so one long request can afford to probe a costly arm once). The
  budget is the decoder's (its requests explore for each other), or the request's own when it is
  isolated (below). An arm never probed comes first: while one cannot be afforded yet, the budget is
  saved for it rather than spent re-trying known arms (else cheap re-tries of retrieval arms would
  keep a draft model, whose first try pays a prompt's prefill, untried forever). Before the budget
  counted whole seconds of exploring steps: on a bf16 target the first two requests then never
  tried the draft model (docs/benchmark-log.md);
- otherwise the arm with the best rate drafts;
- estimates decay (``decay`` per step of the arm), so they follow the request as it changes;
- evidence is kept per context, repeating (the suffix automaton's match is at least ``min_match``
  tokens) or novel, since retrieval pays in the one and seldom in the other (an arm without evidence
  in one borrows the other's);
- exploring a draft-model arm also pays what the draft's cache must catch up on (a long prompt's
  prefill, the first time), priced on the draft's cost curve.

Priors: ``specdraft autotune``'s file (the arms' measured MAT and step sizes on sample prompts), or,
for requests whose output cannot depend on the draft (greedy, unseeded sampling), what earlier
requests of the same decoder measured (``ArmMemory``). A seeded sampling request uses the file's
priors only, so its arms, and so its sample, depend on nothing else that runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.policy import best_depth, chain_tokens, interpolate
from .base import Drafter, NoDrafter
from .composite import Composite, plan_of
from .suffix import SuffixAutomaton


class ObservedCosts:
    """What the steps of a batch of one cost, as the engine measured them (one per decoder, learned by
    its ``auto`` requests): per n tokens scored, a moving average of the target side's seconds. The
    start-up curve measures a few forwards after a short context, and a noisy VM moves those points by
    30%; the steps that decode the requests themselves are many and include what the step around the
    forward costs."""

    def __init__(self, weight: float = 0.1, min_seen: int = 3):
        self.weight, self.min_seen = weight, min_seen
        self.seconds: dict[int, float] = {}
        self.seen: dict[int, int] = {}
        self._ratios: tuple | None = None  # (the curve they divide by, {n: ratio}), until the next observe
        self.version = 0  # counts the observations (prices computed from them are kept until the next)

    def observe(self, scored: int, seconds: float) -> None:
        old = self.seconds.get(scored)
        self.seconds[scored] = seconds if old is None else old + self.weight * (seconds - old)
        self.seen[scored] = self.seen.get(scored, 0) + 1
        self._ratios = None
        self.version += 1

    def factor(self, curve: dict[int, float], n: float) -> float:
        """observed / start-up seconds at n: interpolated between the n seen ``min_seen`` times,
        the nearest one's beyond them, 1 with none."""
        if self._ratios is None or self._ratios[0] is not curve:
            self._ratios = (
                curve,
                {m: s / interpolate(curve, m) for m, s in self.seconds.items() if self.seen[m] >= self.min_seen},
            )
        ratios = self._ratios[1]
        if not ratios:
            return 1.0
        lo, hi = min(ratios), max(ratios)
        return interpolate(ratios, min(max(n, lo), hi))


class StepCosts:
    """Seconds of one step on this machine: the target scoring n tokens plus the draft model's
    drafted tokens (measured curves, linear in between and beyond), the target's corrected by
    ``observed`` (ObservedCosts, optional) where steps were seen."""

    def __init__(
        self,
        target_curve: dict[int, float],
        draft_curve: dict[int, float] | None = None,
        observed: ObservedCosts | None = None,
    ):
        self.target_curve = target_curve
        self.draft_curve = draft_curve or {1: 0.0}
        self.draft_token_s = self.draft_curve[min(self.draft_curve)]
        self.observed = observed
        self._prices: tuple[int, dict] = (0, {})  # (observed's version, {n: seconds}): auto prices many depths a step

    def as_measured(self) -> "StepCosts":
        """The start-up curves alone (a seeded request's prices may depend on nothing else that runs)."""
        return StepCosts(self.target_curve, self.draft_curve)

    def target(self, n: float) -> float:
        version = self.observed.version if self.observed is not None else 0
        if self._prices[0] != version:
            self._prices = (version, {})
        s = self._prices[1].get(n)
        if s is None:
            s = interpolate(self.target_curve, n)
            if self.observed is not None:
                s *= self.observed.factor(self.target_curve, n)
            self._prices[1][n] = s
        return s

    def draft(self, n: float) -> float:
        """A draft forward of n tokens (its catch-up on tokens its cache lacks)."""
        return interpolate(self.draft_curve, n) if n > 0 else 0.0

    def step(self, scored: float, model_tokens: float = 0.0) -> float:
        return self.target(scored) + self.draft_token_s * model_tokens


@dataclass
class Draw:
    """What one step of an arm drafted and kept: tree nodes, deepest path, accepted tokens."""

    nodes: int = 0
    depth: int = 0
    accepted: int = 0


@dataclass
class Evidence:
    """Decayed sums over an arm's steps: how many, tokens emitted (accepted + 1), seconds (cost curve); and
    over the steps that drafted: tokens accepted, steps that stopped at a rejection (accepted < depth),
    tree nodes and depths drafted (what the acceptance and the step's price are estimated from)."""

    steps: float = 0.0
    emitted: float = 0.0
    seconds: float = 0.0
    accepted: float = 0.0
    rejected: float = 0.0
    nodes: float = 0.0
    depth: float = 0.0

    def add(self, emitted: float, seconds: float, decay: float = 1.0, draw: Draw | None = None) -> None:
        d = draw or Draw()
        new = (1, emitted, seconds, d.accepted, float(d.accepted < d.depth), d.nodes, d.depth)
        for f, x in zip(EVIDENCE_FIELDS, new):
            setattr(self, f, getattr(self, f) * decay + x)

    def scaled(self, max_steps: float) -> "Evidence":
        f = min(1.0, max_steps / self.steps) if self.steps else 0.0
        return Evidence(*(getattr(self, k) * f for k in EVIDENCE_FIELDS))

    def plus(self, o: "Evidence") -> "Evidence":
        return Evidence(*(getattr(self, k) + getattr(o, k) for k in EVIDENCE_FIELDS))

    def acceptance(self, optimistic: bool = False) -> float:
        """Per draft token, the truncated-geometric estimate accepted / (accepted + rejections): the mean
        with one success and one failure as a prior (0.5 with no evidence), or, optimistic, with one more
        success (the best the evidence still allows), at most ALPHA_MAX."""
        a, r = self.accepted, self.rejected
        return min(ALPHA_MAX, (a + 2) / (a + r + 2)) if optimistic else (a + 1) / (a + r + 2)

    def nodes_per_depth(self) -> float:
        """A tree's nodes per level of depth (1: chains): what a draft of some depth costs to score."""
        return self.nodes / self.depth if self.depth else 1.0


EVIDENCE_FIELDS = ("steps", "emitted", "seconds", "accepted", "rejected", "nodes", "depth")


@dataclass
class ExploreBudget:
    elapsed: float = 0.0
    explored: float = 0.0


class ArmMemory:
    """What earlier requests of one decoder and spec measured per arm (decayed, so it follows the
    workload), and their exploration budget."""

    def __init__(self, decay: float = 0.98):
        self.arms: dict[tuple[str, str], Evidence] = {}
        self.decay = decay
        self.budget = ExploreBudget()

    def add(self, key: tuple[str, str], emitted: float, seconds: float, draw: "Draw | None" = None) -> None:
        """``key``: (context, arm name)."""
        self.arms.setdefault(key, Evidence()).add(emitted, seconds, self.decay, draw)


@dataclass
class Arm:
    name: str
    drafter: Drafter
    prior: Evidence | None = None  # from the autotune file
    uses_draft: bool = False  # drafts with the draft model, whose cache catches up when it drafts


class AutoDrafter(Composite):
    """Evidence is kept per *context*: whether the text is repeating itself at this step (the suffix
    automaton over prompt + output finds an earlier occurrence of at least ``min_match`` tokens,
    SAM-Decoding's signal). Retrieval pays in the one and rarely in the other, so an arm's rate is
    learned separately for each, and a request that starts copying its prompt switches at once."""

    name = "auto"

    def __init__(
        self,
        arms: list[Arm],
        costs: StepCosts,
        memory: ArmMemory | None = None,
        probe: int = 2,
        explore_frac: float = 0.05,
        decay: float = 0.9,
        prior_steps: float = 8.0,
        min_match: int = 4,
        draft_adopts_prompt: bool = False,
    ):
        super().__init__([a.drafter for a in arms])
        self.arms, self.costs, self.memory = arms, costs, memory
        self.probe, self.explore_frac, self.decay, self.prior_steps = probe, explore_frac, decay, prior_steps
        self.min_match = min_match
        self.draft_adopts_prompt = draft_adopts_prompt  # the draft's cache starts from the target's prefill
        self.pricing = costs  # begin: costs, or its start-up curves alone for an isolated request

    def begin(self, prompt_ids, sp, generator, processor=None):
        super().begin(prompt_ids, sp, generator, processor)
        isolated = sp.seed is not None and not sp.greedy  # its arms may depend on nothing else that runs
        self.pricing = self.costs.as_measured() if isolated else self.costs
        self.ev = {}
        for ctx in CONTEXTS:
            self.ev[ctx] = []
            for a in self.arms:
                prior = a.prior.scaled(self.prior_steps) if a.prior else Evidence()
                if not isolated and self.memory is not None and (ctx, a.name) in self.memory.arms:
                    prior = self.memory.arms[ctx, a.name].scaled(self.prior_steps)
                self.ev[ctx].append(prior)
        # seconds (cost curve) of all steps and of exploring ones: the decoder's (its requests explore for
        # each other: a short request cannot afford to try a costly arm) or, isolated, the request's own
        self.budget = ExploreBudget() if isolated or self.memory is None else self.memory.budget
        self.exploring = False
        self.best_rate = 1.0 / self.pricing.step(1)  # the best arm's rate at the last choice (plain's first)
        self.sam = SuffixAutomaton()
        self.sam.extend_many(int(t) for t in prompt_ids)
        self.ctx, self.current, self._size, self._depth, self._model = CONTEXTS[0], None, 0, 0, 0
        self.depth = 0  # the chosen arm's draft depth (choose)
        self.credits = [0] * len(self.arms)  # steps credited per arm (priced's results keep until the next)
        self._priced: dict = {}
        # the tokens the draft model's cache holds: empty, or the prefilled prompt[:-1] it adopts
        self.model_seen = len(prompt_ids) - 1 if self.draft_adopts_prompt else 0
        # where the request ends at the latest, counting at most AHEAD tokens: many stop long before max_new_tokens
        self.last_token = len(prompt_ids) + min(sp.max_new_tokens, AHEAD)

    def context(self, tokens: list[int]) -> str:
        self.sam.extend_many(int(t) for t in tokens[len(self.sam) :])
        return CONTEXTS[self.sam.match_len() >= self.min_match]

    def evidence(self, i: int, ctx: str) -> Evidence:
        """Arm i's evidence in ctx; while it has less than ``probe`` steps there, the other context's
        evidence fills in (scaled to ``probe`` steps), so an arm need not be probed twice."""
        e = self.ev[ctx][i]
        if e.steps >= self.probe:
            return e
        other = self.ev[CONTEXTS[1 - CONTEXTS.index(ctx)]][i]
        return e.plus(other.scaled(self.probe - e.steps))

    def rate(self, i: int, ctx: str) -> float | None:
        """Tokens per second of arm i in context ctx so far (None: no evidence); plain's is known."""
        if isinstance(self.arms[i].drafter, NoDrafter):
            return 1.0 / self.pricing.step(1)
        e = self.evidence(i, ctx)
        return e.emitted / e.seconds if e.steps else None

    def priced(self, i: int, ctx: str, optimistic: bool) -> tuple[int, float]:
        """Arm i's draft depth with the most expected tokens per second on the cost curve, at its acceptance
        in ctx (the mean, or optimistic: the best the evidence still allows), and that rate. Depth 0: no
        draft of this arm beats plain decoding there."""
        observed = self.pricing.observed
        stamp = (self.credits[i], observed.version // REPRICE if observed is not None else 0)
        hit = self._priced.get((i, ctx, optimistic))
        if hit is not None and hit[0] == stamp:  # most steps change neither the arm's evidence nor the prices
            return hit[1]
        e = self.evidence(i, ctx)
        cap = self.arms[i].drafter.max_draft_depth() or MAX_PRICED
        found = best_depth(e.acceptance(optimistic), cap, lambda d: self.step_at(i, e, d))
        self._priced[i, ctx, optimistic] = (stamp, found)
        return found

    def step_at(self, i: int, e: Evidence, depth: int) -> float:
        """Seconds of a step of arm i drafting ``depth`` deep: the target scoring its tree (nodes per depth as
        in its evidence ``e``; 1 for chains), plus the draft model's tokens when it drafts with one."""
        return self.pricing.step(1 + e.nodes_per_depth() * depth, depth if self.arms[i].uses_draft else 0)

    def catch_up(self, i: int, n_tokens: int) -> float:
        """Seconds the draft model needs to catch up on the tokens since it last drafted, if arm i
        drafts with it (a long prompt's prefill, the first time): a one-off that exploring must pay."""
        return self.pricing.draft(n_tokens - self.model_seen) if self.arms[i].uses_draft else 0.0

    def choose(self, ctx: str, n_tokens: int) -> int:
        """The arm that drafts this step (its depth in ``self.depth``): the best rate, or an exploratory try."""
        n = len(self.arms)
        ev = [self.evidence(i, ctx) for i in range(n)]
        plain = [isinstance(a.drafter, NoDrafter) for a in self.arms]
        rates = [self.rate(i, ctx) or 0.0 for i in range(n)]
        mean = [(0, rates[i]) if plain[i] else self.priced(i, ctx, False) for i in range(n)]
        for i in range(n):  # drafting cannot pay at its mean acceptance: it would draft nothing
            if mean[i][0] == 0:
                rates[i] = min(rates[i], 1.0 / self.pricing.step(1))
        # ties go to plain: an arm that found nothing to draft has exactly plain's rate
        best = max(range(n), key=lambda i: (rates[i], plain[i]))
        self.best_rate = rates[best]
        # an arm whose optimistic rate does not beat the best is not tried: the curve says it cannot pay,
        # or its evidence says it loses
        hope = {i: self.priced(i, ctx, True) for i in range(n) if not plain[i]}
        hope = {i: h for i, h in hope.items() if h[0] and h[1] > self.best_rate}
        self.exploring = True
        # a try drafts as deep as its mean acceptance pays for (at least one token, at most its optimistic
        # depth): shallow while little is known, so a try that fails on a steep curve costs little
        tries = {i: min(h[0], max(1, mean[i][0])) for i, h in hope.items()}
        unknown = [i for i in hope if ev[i].steps < self.probe - 1e-9]
        for i in unknown:  # probing is exploring too
            if self.worth(i, ctx, tries[i], hope[i][1], n_tokens) and (
                self.affords(self.probe_regret(i, ctx, n_tokens, tries[i]), n_tokens) or not self.budget.elapsed
            ):
                self.depth = tries[i]
                return i
        others = [i for i in hope if i != best and ev[i].steps]
        if others and not unknown:  # try another arm (the budget is saved while an arm is still unprobed)
            cand = min(others, key=lambda i: ev[i].steps)
            per_step = (ev[cand].seconds - ev[cand].emitted / self.best_rate) / ev[cand].steps
            if self.worth(cand, ctx, tries[cand], hope[cand][1], n_tokens) and self.affords(
                max(0.0, per_step) + self.catch_up(cand, n_tokens), n_tokens
            ):
                self.depth = tries[cand]
                return cand
        self.exploring = False
        self.depth = mean[best][0]
        return best

    def worth(self, i: int, ctx: str, depth: int, hope_rate: float, n_tokens: int) -> bool:
        """Whether a try of arm i drafting ``depth`` deep is worth its expected loss (its seconds, plus any
        catch-up, less what the best rate takes for the tokens its mean acceptance expects): at most what it
        may teach, the share of the exploration budget's time (affords) the arm would save at its optimistic
        rate ``hope_rate``, divided by 1 + its steps of evidence (each teaches less)."""
        e = self.evidence(i, ctx)
        loss = (
            self.step_at(i, e, depth)
            + self.catch_up(i, n_tokens)
            - chain_tokens(e.acceptance(), depth) / self.best_rate
        )
        if loss <= 0:
            return True
        horizon = self.budget.elapsed + self.ahead(n_tokens)
        return loss <= horizon * (1.0 - self.best_rate / hope_rate) / (1.0 + e.steps)

    def probe_regret(self, i: int, ctx: str, n_tokens: int, depth: int) -> float:
        """The most a first try of arm i can lose against the best known rate: a draft ``depth`` deep priced,
        one token emitted, plus the draft model's catch-up."""
        return max(0.0, self.step_at(i, self.evidence(i, ctx), depth) - 1.0 / self.best_rate) + self.catch_up(
            i, n_tokens
        )

    def ahead(self, n_tokens: int) -> float:
        """This request's remaining tokens (at most AHEAD) at plain speed."""
        return self.pricing.step(1) * max(0, self.last_token - n_tokens)

    def affords(self, regret: float, n_tokens: int) -> bool:
        """Whether exploring at the risk of losing ``regret`` seconds (against the best known arm) keeps
        the time lost to exploring within its share of the time: the budget's so far plus this request's
        remaining tokens at plain speed."""
        b = self.budget
        return b.explored + regret <= self.explore_frac * (b.elapsed + regret + self.ahead(n_tokens))

    @property
    def spec(self):  # the draft model's group reads the drafting arm's config
        return self.arms[self.current].drafter.spec

    def plan(self, tokens, cap):
        self.ctx = self.context(tokens)
        self.current = self.choose(self.ctx, len(tokens))
        if not isinstance(self.arms[self.current].drafter, NoDrafter):
            cap = min(cap, self.depth)  # the depth the cost curve pays for at the arm's acceptance
        self.cap = cap
        self._catch_up = self.catch_up(self.current, len(tokens))
        if self.arms[self.current].uses_draft and cap > 0:
            self.model_seen = len(tokens)
        d = self.arms[self.current].drafter
        own, model_cap = plan_of(d, tokens, cap)
        self.arm = self.arms[self.current].name
        if isinstance(d, Composite) and d.arm:
            self.arm += "/" + d.arm
        return own, model_cap

    def combine(self, own, model):
        d = self.arms[self.current].drafter
        tree = d.combine(own, model) if isinstance(d, Composite) else Composite.combine(self, own, model)
        self._size = tree.size
        self._depth = tree.size if not tree.size or tree.is_chain() else int(tree.depths().max())
        self._model = model.size if model is not None else 0
        return tree

    def observe(self, step):
        super().observe(step)  # every part (a head's drafter keeps the features of the path, whoever drafted)
        if self.current is not None and self.cap > 0:  # a step that could not draft says nothing of its arm
            self._credit(step.accepted)
        if step.batch == 1 and self.costs.observed is not None:  # the start-up curve is for a batch of one
            self.costs.observed.observe(step.scored, step.seconds)

    def _credit(self, num_accepted: int) -> None:
        """The chosen arm's step: its tokens and its priced seconds, into the context's estimates."""
        seconds = self.pricing.step(1 + self._size, self._model)
        self.budget.elapsed += seconds + self._catch_up
        if self.exploring:  # what the step lost against the best arm known when it was chosen
            self.budget.explored += max(0.0, seconds + self._catch_up - (num_accepted + 1) / self.best_rate)
        draw = Draw(self._size, self._depth, num_accepted) if self._size else None
        self.ev[self.ctx][self.current].add(num_accepted + 1, seconds, self.decay, draw)
        self.credits[self.current] += 1
        if self.memory is not None:
            self.memory.add((self.ctx, self.arms[self.current].name), num_accepted + 1, seconds, draw)
        self.current, self._size, self._depth, self._model = None, 0, 0, 0


AHEAD = 128  # the most tokens ahead that exploration's budget counts on
ALPHA_MAX = 0.95  # the best plausible acceptance per draft token (retrieval while the text copies itself)
MAX_PRICED = 32  # the deepest draft priced for an arm without a depth of its own (the curve's last point)
REPRICE = 8  # the arms' best depths follow the observed step costs every REPRICE observations
CONTEXTS = ("novel", "repeating")  # the suffix match is shorter / not shorter than min_match
