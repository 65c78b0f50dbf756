"""The draft model in a process of its own (a Ray actor, scale/remote.py) that drafts the next block while
the target verifies this one: PEARL's post-verify, SwiftSpec, DSI (docs/scale.md).

Each step the group hands the engine k drafts per row and, with ``prefetch``, asks the actor at once for
k + 1 more tokens after them, on the guess that the target keeps all k. While the engine's target scores
the block, the actor drafts. If a row kept all k drafts and the target's own next token equals the first
ahead token, the other k are the row's next block, drafted while the target worked (the step's arm is
"prefetched"); otherwise they are dropped and the actor drafts from the row's corrected context while the
target waits ("drafted"). The engine keeps verification, stops and statistics, so the method is lossless
under every verifier: its drafts are argmax tokens, a deterministic draft (q one-hot) when sampling.

The group knows a prefix of what the actor's cache holds for each row (``_Row.cached``); a draft call
keeps the longest prefix of that agreeing with the row's tokens and feeds the rest."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import ConfigError
from ..core.methods import RemoteDraftParams
from ..core.tree import DraftTree
from .base import Drafter, common_prefix

PREFETCHED, DRAFTED = "prefetched", "drafted"  # the step's arm: made while the last step was verified, or not


class RemoteDraft:
    """The draft's actor, shared by every request of one decoder (``SpecDecoder.shared``). It lives as long
    as this object: Ray ends an unnamed actor once the last handle to it goes."""

    def __init__(self, source: dict, params: RemoteDraftParams, vocab: int):
        from ..scale.cluster import connect
        from ..scale.remote import DraftSide

        self.ray = connect(params.ray_address)
        where = on_node(self.ray, params.remote_node) if params.remote_node else "DEFAULT"
        self.actor = self.ray.remote(num_cpus=params.remote_threads, max_concurrency=2, scheduling_strategy=where)(
            DraftSide
        ).remote(source, params.remote_threads)
        self.vocab = min(vocab, self.ray.get(self.actor.vocab.remote()))
        self.keys = 0  # the last sequence key handed out
        self.epoch = 0  # the last ahead call's number (the actor's stop marks are per actor, so per RemoteDraft)


def on_node(ray, address: str):
    """A scheduling strategy that runs an actor on the alive node at ``address`` (its node IP), or an error
    naming the nodes there are."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    if address not in alive:
        raise ConfigError(f"remote_node {address!r} is no alive node of the Ray cluster; its nodes: {sorted(alive)}")
    return NodeAffinitySchedulingStrategy(alive[address], soft=False)


class RemoteDraftDrafter(Drafter):
    """A request's member of its decoder's RemoteDraftGroup (the group drafts)."""

    name = "remote_draft"

    def __init__(self, remote: RemoteDraft, spec):
        self.remote, self.spec = remote, spec
        self.group_key = ("remote_draft", id(remote), spec.params.prefetch)

    def new_group(self) -> "RemoteDraftGroup":
        return RemoteDraftGroup(self.remote, self.spec.params.prefetch)

    def max_draft_depth(self) -> int:
        return self.spec.k


@dataclass
class _Row:
    key: int
    cached: list[int]  # a prefix of the tokens the actor's cache holds for this row
    ahead_ctx: list[int] = field(default_factory=list)  # tokens + drafts of the last step, when drafting ahead
    ahead: list[int] = field(default_factory=list)  # what the actor drafted after them


class RemoteDraftGroup:
    def __init__(self, remote: RemoteDraft, prefetch: bool):
        self.remote, self.prefetch = remote, prefetch
        self.state: dict[int, _Row] = {}  # id(request) -> its row
        self.pending = []  # start / end calls not yet waited for
        self.ahead = None  # the ahead call in flight: (its ObjectRef, the rows it drafts for, its epoch)

    def join(self, rows, prefix_from=None) -> None:
        """The actor prefills the rows' prompts while the engine prefills the target's."""
        for r in rows:
            self.remote.keys += 1
            self.state[id(r)] = _Row(self.remote.keys, list(r.tokens[:-1]))
        self.pending.append(
            self.remote.actor.start.remote([self.state[id(r)].key for r in rows], [list(r.tokens[:-1]) for r in rows])
        )

    def leave(self, rows) -> None:
        gone = [self.state.pop(id(r)).key for r in rows if id(r) in self.state]
        if gone:
            self.pending.append(self.remote.actor.end.remote(gone))

    def propose(self, rows, caps: list[int]) -> list[DraftTree]:
        get = self.remote.ray.get
        self._drop_ahead()
        get(self.pending)  # the actor runs calls concurrently: a draft waits for the rows' start
        self.pending = []
        out, jobs = {}, []
        for r, cap in zip(rows, caps):
            st = self.state[id(r)]
            if cap <= 0:
                out[id(r)] = []
            elif st.ahead and r.tokens == st.ahead_ctx + st.ahead[:1]:  # the guess held: drafted already
                out[id(r)] = st.ahead[1 : cap + 1]
                r.drafter.arm = PREFETCHED
            else:
                keep = min(common_prefix(r.tokens, st.cached), len(r.tokens) - 1)
                jobs.append((r, (st.key, keep, r.tokens[keep:], cap)))
                r.drafter.arm = DRAFTED
            st.ahead = []
        if jobs:
            for (r, _), d in zip(jobs, get(self.remote.actor.draft.remote([j for _, j in jobs], self.remote.vocab))):
                out[id(r)] = d
                self.state[id(r)].cached = r.tokens + d[:-1]
        if self.prefetch:
            self._draft_ahead([(r, out[id(r)]) for r in rows if out[id(r)]])
        return [DraftTree.chain(out[id(r)]) if out[id(r)] else DraftTree.empty() for r in rows]

    def _draft_ahead(self, drafted: list) -> None:
        """k + 1 tokens after each row's drafts, made while the target verifies them."""
        if not drafted:
            return
        self.remote.epoch += 1
        jobs = []
        for r, d in drafted:
            st = self.state[id(r)]
            st.ahead_ctx = r.tokens + d
            jobs.append((st.key, len(r.tokens) + len(d) - 1, d[-1:], len(d) + 1))
        epoch = self.remote.epoch
        self.ahead = (self.remote.actor.draft.remote(jobs, self.remote.vocab, epoch), [r for r, _ in drafted], epoch)

    def feedback(self, rows, n_acc: list[int]) -> None:
        """Wait for the ahead drafts only when some row kept its whole block; else stop them."""
        if self.ahead is None:
            return
        ref, ahead_rows, _ = self.ahead
        if not any(_kept_block(r, self.state.get(id(r))) for r in ahead_rows):
            self._drop_ahead()
            return
        self.ahead = None
        for r, a in zip(ahead_rows, self.remote.ray.get(ref)):
            st = self.state.get(id(r))
            if st is not None and a:
                st.ahead = a
                st.cached = st.ahead_ctx + a[:-1]

    def _drop_ahead(self) -> None:
        if self.ahead is not None:
            self.remote.actor.stop.remote(self.ahead[2])
            self.ahead = None


def _kept_block(r, st: _Row | None) -> bool:
    """Whether row r's tokens now hold its whole last block of drafts."""
    return st is not None and r.tokens[: len(st.ahead_ctx)] == st.ahead_ctx
