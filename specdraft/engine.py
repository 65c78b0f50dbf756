"""The decode loop. One loop for every method: the plain baseline is the drafter that drafts nothing.

Invariant: the target's KV cache holds every token of ``tokens`` except the last one(s), which are
"pending"; each step feeds pending + draft in one forward and keeps logits for the last k + 1
positions (row i predicts the token after pending + the first i drafts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .config import SamplingParams
from .drafters.base import Drafter
from .errors import ContextLengthError, ConfigError
from .metrics import GenerationStats, StepRecord
from .models.adapter import HFModel
from .policy import CostAwarePolicy
from .sampling import make_generator
from .verify import greedy_verify, lossy_label, sample_verify, verify_tree


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: GenerationStats

    def to_dict(self, per_step: bool = False) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict(per_step)}


def check_fits(target: HFModel, n_prompt: int, sp: SamplingParams) -> None:
    if n_prompt == 0:
        raise ConfigError("the prompt is empty: need at least one token")
    ctx = target.max_context
    if n_prompt >= ctx:
        raise ContextLengthError(f"the prompt has {n_prompt} tokens; the model's context is {ctx} tokens")
    if n_prompt + sp.max_new_tokens > ctx:
        raise ContextLengthError(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({sp.max_new_tokens}) = {n_prompt + sp.max_new_tokens} "
            f"exceeds the model's context of {ctx} tokens; lower max_new_tokens to at most {ctx - n_prompt}"
        )


def generate(
    target: HFModel,
    drafter: Drafter,
    prompt_ids: list[int],
    sp: SamplingParams,
    eos_ids: set[int] | None = None,
    tokenizer=None,
    policy: CostAwarePolicy | None = None,
    on_emit=None,
) -> GenerationResult:
    """Decode ``prompt_ids`` with ``drafter`` proposing and ``target`` verifying.

    ``on_emit(new_tokens)`` (optional) is called after every step with the tokens appended (for
    streaming); returning True cancels the request (finish_reason "cancelled"). A drafter may define
    ``observe_target(row_tokens, logits)``: after each target forward it receives the rows' logits
    [n + 1, V] and, per row, the token whose successor the row predicts (Token Recycling uses it).
    A drafter with ``wants_hidden = True`` (Medusa, EAGLE) gets a third argument: the target's
    final-norm features [n_fed, H] of every position that forward fed (pending tokens, then drafts).
    A drafter whose ``lossy`` is set (``SpecConfig.lossy``; SpecDecoder.make_drafter sets it) is
    verified by that opt-in lossy rule when sampling, and its stats say so.
    """
    sp.validate()
    prompt_ids = [int(t) for t in prompt_ids]
    n_prompt = len(prompt_ids)
    check_fits(target, n_prompt, sp)
    if sp.stop and tokenizer is None:
        raise ConfigError("stop strings need a tokenizer")
    eos = set() if sp.ignore_eos else set(eos_ids if eos_ids is not None else target.eos_token_ids())
    stopper = _StopChecker(sp.stop, tokenizer) if sp.stop else None
    gen = make_generator(sp.seed)
    lossy = getattr(drafter, "lossy", None)
    stats = GenerationStats(prompt_tokens=n_prompt, lossy=lossy_label(lossy, sp))

    t_start = time.perf_counter()
    target.reset()
    drafter.begin(prompt_ids, sp, gen)
    tokens = list(prompt_ids)
    policy_cap = getattr(policy, "max_k", 0)
    observe = getattr(drafter, "observe_target", None)
    target.capture_hidden = bool(getattr(drafter, "wants_hidden", False))
    if target.capture_hidden:
        target.enable_hidden_capture()
        observe = _with_hidden(drafter.observe_target, target)
    finish = None
    while finish is None:
        remaining = sp.max_new_tokens - (len(tokens) - n_prompt)
        t0 = time.perf_counter()
        cap = remaining - 1 if policy is None else policy.choose(min(remaining - 1, policy_cap))
        draft = drafter.propose(tokens, cap)
        t1 = time.perf_counter()
        k = draft.size
        pending = torch.tensor(tokens[target.cached_len :], dtype=torch.long)
        chain = draft.is_chain()
        if chain:
            logits = target.forward(torch.cat([pending, draft.tokens]), keep=k + 1)
            if observe is not None:
                observe(torch.cat([pending[-1:], draft.tokens]), logits)
            d = draft.tokens[None]
            if sp.greedy:
                n_acc, nxt = greedy_verify(d, logits[None])
            else:
                q = None if draft.draft_probs is None else draft.draft_probs[None]
                n_acc, nxt = sample_verify(d, q, logits[None], sp, gen, lossy)
            n_acc, nxt = int(n_acc[0]), int(nxt[0])
            target.crop(len(tokens) + n_acc)  # keep accepted drafts; nxt becomes the pending token
            accepted = draft.tokens[:n_acc].tolist()
        else:
            accepted, nxt = _verify_tree(target, draft, pending, sp, gen, observe, lossy)
            n_acc = len(accepted)
        new = accepted + [nxt]
        drafter.feedback(n_acc, new)
        t2 = time.perf_counter()

        if policy is not None:
            n_pending = pending.shape[0]
            policy.observe(k, n_acc, t1 - t0, t2 - t1, scored=n_pending + k if n_pending == 1 else None)
        new, finish = _cut_at_stop(new, eos, remaining)
        if stopper is not None and finish is None:
            new, finish = stopper.check(tokens[n_prompt:], new)
        tokens.extend(new)
        stats.steps.append(StepRecord(k, n_acc, len(new), t1 - t0, t2 - t1, None if chain else int(draft.depths().max())))
        if on_emit is not None and on_emit(new) and finish is None:
            finish = "cancelled"
    stats.wall_s = time.perf_counter() - t_start
    out = tokens[n_prompt:]
    stats.new_tokens = len(out)
    stats.finish_reason = finish
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(out, skip_special_tokens=True)
        if stopper is not None:
            text = stopper.trim(text)
    return GenerationResult(out, text, stats)


def _with_hidden(observe, target: HFModel):
    return lambda rows, logits: observe(rows, logits, target.last_hidden)


def _verify_tree(target: HFModel, tree, pending: torch.Tensor, sp: SamplingParams, gen=None,
                 observe=None, lossy=None) -> tuple[list[int], int]:
    """Score a whole token tree in one forward (tree attention mask + depth positions), keep the
    accepted path in the cache, return (accepted tokens, next token)."""
    past, n_pend = target.cached_len, pending.shape[0]
    logits = target.forward(torch.cat([pending, tree.tokens]), keep=tree.size + 1,
                            attention_mask=tree.attention_mask(past, n_pend), position_ids=tree.position_ids(past, n_pend))
    if observe is not None:
        observe(torch.cat([pending[-1:], tree.tokens]), logits)
    path, nxt = verify_tree(tree, logits, sp, gen, lossy)
    keep = torch.cat([torch.arange(past + n_pend), past + n_pend + torch.tensor(path, dtype=torch.long)])
    target.keep_positions(keep)
    return tree.tokens[path].tolist(), nxt


def _cut_at_stop(new: list[int], eos: set[int], remaining: int) -> tuple[list[int], str | None]:
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1], "stop"
    if len(new) >= remaining:
        return new[:remaining], "length"
    return new, None


class _StopChecker:
    """Stop strings: emit no token past the one that completes a stop string."""

    def __init__(self, stops: list[str], tokenizer):
        self.stops = stops
        self.tok = tokenizer
        self.window = max(len(s) for s in stops)

    def _hit(self, ids: list[int]) -> bool:
        text = self.tok.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def check(self, before: list[int], new: list[int]) -> tuple[list[int], str | None]:
        ctx = before[-self.window :]  # a stop string spans at most `window` earlier tokens
        if not self._hit(ctx + new):
            return new, None
        for i in range(1, len(new) + 1):
            if self._hit(ctx + new[:i]):
                return new[:i], "stop"
        return new, "stop"

    def trim(self, text: str) -> str:
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        return text if cut < 0 else text[:cut]
