"""Metrics, defined once. Everything that reports MAT, acceptance rate, tokens/s or speedup uses
these functions: the engine's per-request stats, the CLI, the benchmark report and the server.

- MAT (mean accepted tokens) = mean over verification steps of (accepted drafts + 1).
- acceptance rate = total accepted draft tokens / total drafted tokens.
- per-position acceptance[i] = P(draft position i accepted | position i was drafted); for a token
  tree, position i is depth i + 1 (drafted there = the tree reaches that depth).
- tokens/s = new tokens / wall seconds.
- time to first token = seconds from the call to the first new token reaching the caller (a streaming
  callback); the decode phase = the tokens after the first over the seconds after the first
  (``decode_phase``): what speculation changes, without the prompt's prefill.
- speedup = (tokens / wall of the method) / (tokens / wall of the baseline), on totals.
- fidelity Z (sampling) = sum over sampled tokens of (log p(x) + H(p)) / sqrt(sum of Var log p), p the
  target's distribution: about N(0, 1) for a lossless sampler (fidelity.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StepRecord:
    drafted: int  # draft tokens the target scored this step
    accepted: int  # of which the verifier accepted (a prefix)
    emitted: int  # tokens appended to the output (accepted + 1, less any cut by a stop condition)
    draft_s: float = 0.0
    verify_s: float = 0.0
    depth: int | None = None  # longest root-to-leaf path of a token tree; None = a chain (= drafted)
    arm: str | None = None  # what drafted this step, when a composite drafter (hybrid, auto) chose

    @property
    def positions(self) -> int:
        return self.drafted if self.depth is None else self.depth


def mean_accepted_tokens(steps: list[StepRecord]) -> float | None:
    if not steps:
        return None
    return sum(s.accepted + 1 for s in steps) / len(steps)


def mean_accepted_tokens_from_totals(accepted: int, steps: int) -> float | None:
    """MAT from aggregate counts (sum of accepted drafts over ``steps`` steps): the same quantity
    as mean_accepted_tokens(steps), for callers that only have totals (server usage, loadtest)."""
    if steps <= 0:
        return None
    return (accepted + steps) / steps


def acceptance_rate(steps: list[StepRecord]) -> float | None:
    drafted = sum(s.drafted for s in steps)
    if drafted == 0:
        return None
    return sum(s.accepted for s in steps) / drafted


def per_position_acceptance(steps: list[StepRecord]) -> list[float]:
    if not steps:
        return []
    kmax = max(s.positions for s in steps)
    out = []
    for i in range(kmax):
        tried = [s for s in steps if s.positions > i]
        out.append(sum(1 for s in tried if s.accepted > i) / len(tried))
    return out


def tokens_per_second(tokens: int, wall_s: float) -> float | None:
    return tokens / wall_s if wall_s > 0 else None


def decode_phase(new_tokens: int, wall_s: float, first_token_s: float) -> tuple[int, float]:
    """One generation's decode phase: (the tokens after the first, the seconds after the first arrived)."""
    return max(new_tokens - 1, 0), max(wall_s - first_token_s, 0.0)


class FirstToken:
    """When a call's first new token reached the caller: ``token()`` from the method's streaming callback,
    ``seconds(wall_s)`` right after the call returns."""

    def __init__(self):
        self.at: float | None = None

    def token(self) -> None:
        if self.at is None:
            self.at = time.perf_counter()

    def on_emit(self, new, *_) -> None:
        """As the engine's ``on_emit`` (returning None: the request goes on)."""
        if new:
            self.token()

    def seconds(self, wall_s: float) -> float:
        """The seconds of ``wall_s`` before the first token: wall_s less the time from it to now (the call's
        end), so a method that times itself (the engine's wall_s) keeps its own start. No token: wall_s."""
        if self.at is None:
            return wall_s
        return min(wall_s, max(0.0, wall_s - (time.perf_counter() - self.at)))


def speedup(tokens: int, wall_s: float, base_tokens: int, base_wall_s: float) -> float | None:
    a = tokens_per_second(tokens, wall_s)
    b = tokens_per_second(base_tokens, base_wall_s)
    if a is None or not b:
        return None
    return a / b


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0  # of wall_s, the prompt's prefill (the first step's verify_s includes it)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed (core/prefix_cache.py)
    steps: list[StepRecord] = field(default_factory=list)
    finish_reason: str = "length"
    lossy: str | None = None  # the opt-in lossy verification rule that made this output (SpecConfig.lossy)
    # seeded sampling only: whether the same request gives the same tokens whatever else the server runs
    reproducible: bool | None = None

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def mat(self) -> float | None:
        return mean_accepted_tokens(self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        return acceptance_rate(self.steps)

    @property
    def tokens_per_s(self) -> float | None:
        return tokens_per_second(self.new_tokens, self.wall_s)

    @property
    def draft_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def arms(self) -> dict[str, int] | None:
        """Steps per arm, for a composite drafter's request (None otherwise)."""
        out: dict[str, int] = {}
        for s in self.steps:
            if s.arm is not None:
                out[s.arm] = out.get(s.arm, 0) + 1
        return out or None

    @property
    def verify_s(self) -> float:
        return sum(s.verify_s for s in self.steps)

    def to_dict(self, per_step: bool = False) -> dict:
        d: dict[str, object] = {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "steps": len(self.steps),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mat": self.mat,
            "acceptance_rate": self.acceptance_rate,
            "per_position_acceptance": per_position_acceptance(self.steps),
            "tokens_per_s": self.tokens_per_s,
            "wall_s": self.wall_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "finish_reason": self.finish_reason,
        }
        if self.lossy is not None:
            d["lossy"] = self.lossy
        if self.reproducible is not None:
            d["reproducible"] = self.reproducible
        if self.arms:
            d["arms"] = self.arms
        if per_step:
            d["step_records"] = [[s.drafted, s.accepted, s.emitted, s.positions] for s in self.steps]
        return d


def fidelity_z(terms: list[dict]) -> float | None:
    """Z of sampled outputs under the target (fidelity.py: about N(0, 1) when the sampler draws from the
    target's distribution; |Z| > 5 means it does not), pooled over ``fidelity.output_terms`` dicts."""
    terms = [t for t in terms if t.get("fid_tokens")]
    var = sum(t["fid_var"] for t in terms)
    return sum(t["fid_sum"] for t in terms) / var**0.5 if var > 0 else None


def near_tie_bound(target) -> float:
    """The largest top-2 logit gap that scoring several tokens at once can flip on ``target`` (a model):
    a greedy divergence from plain decoding at a smaller gap is numerics, at a larger one a bug.
    bf16 logits of magnitude ~20 are spaced 0.125 apart; llama.cpp's batched kernels moved logits by
    up to 1.7 (tests/test_llama_backend.py); float32 differs only in summation order, but int8
    activations (w8a8) turn a last-bit difference into a rounding step (0.46 at most on SmolLM2,
    tests/test_lowbit.py)."""
    if getattr(target, "backend", "hf") == "llama":
        return 2.0
    if (getattr(target, "quantization", None) or {}).get("dynamic"):
        return 1.0
    return 0.25 if str(target.dtype) in ("torch.bfloat16", "torch.float16") else 1e-3
