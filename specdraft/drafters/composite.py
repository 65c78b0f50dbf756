"""Drafters made of other drafters (hybrid, auto): each step one *plan* says what drafts, and every
part sees every step, so a part that sat out stays current (a suffix automaton extends itself from
the tokens, Token Recycling's table learns from every target forward, a draft model catches up on
the tokens its cache lacks when it drafts next).

A plan is ``(own, model_cap)``: a draft made without the model part (or None), and how deep the
model part drafts this step (0: not at all). The model part is the one part that drafts through
the engine's ``DraftGroup`` (a draft model batches its forwards across rows); a composite takes
that part's ``group_key``, and its ``CompositeGroup`` asks each row's plan, lets the inner group
draft the rows whose plan wants the model, and ``combine``s. Without a grouped part the composite
drafts per row through ``propose``, the same plan and combine.
"""

from __future__ import annotations

import dataclasses

from ..core.errors import ConfigError
from ..core.tree import DraftTree
from .base import Drafter


class Composite(Drafter):
    """``parts``: every distinct drafter this composite may draft with (at most one grouped)."""

    def __init__(self, parts: list[Drafter]):
        self.parts = list({id(p): p for p in parts}.values())
        grouped = [p for p in self.parts if p.group_key is not None]
        if len({_model_key(p) for p in grouped}) > 1:
            raise ConfigError("a composite drafter can hold one draft model only")
        self.model = grouped[0] if grouped else None  # a grouped leaf, or a composite holding one
        self.group_key = None if self.model is None else ("composite", _model_key(self.model))
        self.wants_hidden = any(p.wants_hidden for p in self.parts)
        self.reproducible = all(p.reproducible for p in self.parts)
        self.reads_fed_positions = any(p.reads_fed_positions for p in self.parts)
        self.arm: str | None = None  # the name of what drafted this step (reported per step)

    @property
    def spec(self):  # the draft model's group reads its row's drafter's spec (confidence threshold, cascade)
        return self.model.spec

    def plan(self, tokens: list[int], cap: int) -> tuple[DraftTree | None, int]:
        raise NotImplementedError

    def combine(self, own: DraftTree | None, model: DraftTree | None) -> DraftTree:
        """The step's draft from the plan's own draft and the model part's (default: whichever exists)."""
        if own is not None and own.size:
            return own
        return model if model is not None else DraftTree.empty()

    # --- the protocol, forwarded to every part ----------------------------------------------------
    def begin(self, prompt_ids, sp, generator, processor=None):
        for p in self.parts:
            p.begin(prompt_ids, sp, generator, processor)

    def propose(self, tokens, max_tokens):  # no grouped part (rows with one draft through CompositeGroup)
        return self.combine(self.plan(tokens, max_tokens)[0], None)

    def observe(self, step):
        bare = dataclasses.replace(step, hidden=None)
        for p in self.parts:
            p.observe(step if p.wants_hidden else bare)

    def max_draft_depth(self):
        depths = [p.max_draft_depth() for p in self.parts]
        return None if None in depths else max(depths, default=0)

    def new_group(self) -> "CompositeGroup":
        return CompositeGroup(self.model.new_group())


def _model_key(d: Drafter):
    """The group key of the draft model a grouped drafter (leaf or composite) drafts with."""
    return _model_key(d.model) if isinstance(d, Composite) else d.group_key


def plan_of(d: Drafter, tokens: list[int], cap: int) -> tuple[DraftTree | None, int]:
    """Any drafter's plan: a composite's own; a grouped drafter drafts through the group; others
    propose now."""
    if isinstance(d, Composite):
        return d.plan(tokens, cap)
    if d.group_key is not None:
        depth = d.max_draft_depth()
        return None, cap if depth is None else min(depth, cap)
    return d.propose(tokens, cap), 0


class CompositeGroup:
    """The engine's group for composites sharing one draft model: the inner group (the draft model's)
    drafts only for the rows whose plan asks for it."""

    def __init__(self, inner):
        self.inner = inner

    def join(self, rows, prefix_from=None) -> None:
        self.inner.join(rows, prefix_from)

    def leave(self, rows) -> None:
        self.inner.leave(rows)

    def propose(self, rows, caps: list[int]) -> list[DraftTree]:
        plans = [r.drafter.plan(r.tokens, c) for r, c in zip(rows, caps)]
        model = self.inner.propose(rows, [m for _, m in plans])
        return [r.drafter.combine(own, mt if m > 0 else None) for r, (own, m), mt in zip(rows, plans, model)]

    def feedback(self, rows, n_acc: list[int]) -> None:
        self.inner.feedback(rows, n_acc)
