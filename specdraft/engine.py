"""The decode loop: one loop for every batch size and every method (a single request is a batch of
one; the plain baseline is the drafter that drafts nothing).

Several requests (rows) decode together: each step every row proposes its own draft, a chain or a
token tree (ragged sizes, zero included), the target scores all rows' pending token + draft in ONE
forward (``SequenceRows.forward``, models/base.py), each row accepts its own number of tokens
(``verify``: greedy, lossless sampling or an opt-in lossy rule), and rows join (``add``) and leave
(finish, cancel) between steps. Drafters that batch across rows (a draft model) draft through one
``DraftGroup`` per engine; the others draft per row.

Invariant: a row's cache holds every token of ``Request.tokens`` but the last one (the "pending"
token); each step feeds pending + draft and keeps the pending token + the accepted drafts (a
chain's prefix, or a tree's accepted path).

Greedy rows emit exactly what batch-size-1 decoding emits (same dtype): masks and positions make
each row's attention identical; only floating-point summation order can differ. A seeded sampling row
emits exactly its batch-size-1 tokens: it decodes in a lane of its own (models/lanes.py), so its
forwards, its draft model's and its random stream are those of decoding it alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable

import torch

from .core.config import SamplingParams, SpecConfig
from .core.device import HOST
from .core.errors import ConfigError, ContextLengthError, SpecDraftError
from .core.metrics import GenerationStats, StepRecord
from .core.policy import BatchRule, DraftLength
from .core.prefix_cache import PrefixCache
from .core.processors import RequestProcessor, logprob_entries
from .core.sampling import NO_TOKEN, argmax_last, make_generator
from .core.tree import DraftTree, feed_mask
from .core.verify import TypicalAcceptance, greedy_tree_path, greedy_verify, lossy_label, sample_verify, verify_tree
from .drafters.base import Drafter, StepOutcome
from .models.lanes import RowLanes


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    logprobs: list[dict] | None = None  # per token (SamplingParams.logprobs): processors.logprob_entries

    def to_dict(self, per_step: bool = False) -> dict:
        out: dict[str, object] = {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict(per_step)}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


def check_fits(target, n_prompt: int, sp: SamplingParams) -> None:
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


# on_emit(new_tokens) after every step (on_emit(new_tokens, logprob_entries) when logprobs are asked);
# returning True cancels the request
OnEmit = Callable[..., Any]


@dataclass
class Job:
    """A request to admit (``Engine.add_many``, ``generate_batch``): its prompt, sampling and drafter;
    ``on_emit`` (streaming, cancelling), ``tag`` (the caller's, kept on its Request), its draft-length policy
    (None: the drafter's depth every step) and its opt-in lossy rule (``SpecConfig.lossy_rule()``; None:
    exact verification)."""

    prompt_ids: list[int]
    sampling: SamplingParams | dict | None
    drafter: Drafter
    _: KW_ONLY
    on_emit: OnEmit | None = None
    tag: Any = None
    length: DraftLength | None = None
    lossy: TypicalAcceptance | None = None
    spec: SpecConfig | None = None  # the checked spec its drafter was built from (SpecDecoder.prepare)
    processor: RequestProcessor | None = None  # its logits processor, compiled once (None: built on admission)
    partition: Any = None  # whose prefixes it may start from and leaves behind (core/prefix_cache.py)
    start: tuple[Any, int] | None = None  # (a saved prefix, m): its prompt's first m tokens, not computed again


@dataclass(eq=False)  # requests are compared by identity
class Request:
    """One sequence's state in the loop."""

    prompt_ids: list[int]
    sp: SamplingParams
    drafter: Drafter
    on_emit: OnEmit | None = None
    tag: Any = None  # the caller's (Job.tag)
    length: DraftLength = field(default_factory=DraftLength)
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = field(default_factory=GenerationStats)
    gen: torch.Generator | None = None
    eos: set[int] = field(default_factory=set)
    stopper: "_StopChecker | None" = None
    finish: str | None = None
    result: GenerationResult | None = None
    t_start: float = 0.0
    prefill_s: float = 0.0
    lossy: TypicalAcceptance | None = None  # the request's opt-in lossy rule; None: exact verification
    hidden_prefix: torch.Tensor | None = None  # the prompt's features, for the first observe
    seen: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # this step's (fed tokens,
    # logits, features), for the drafter's observe
    processor: RequestProcessor | None = None  # penalties, bias, min_tokens, grammar (None: none asked)
    logprobs: list | None = None  # the emitted tokens' entries when the request asks for logprobs
    error: Exception | None = None  # what failed in this row's own work (its drafter, its processing)
    own_lane: bool = False  # decoded apart from the other rows, exactly as alone (seeded sampling)
    partition: Any = None  # Job.partition
    start: tuple[Any, int] | None = None  # Job.start

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    def outcome(self) -> GenerationResult:
        """A finished row's result; its error raised instead when its own work failed."""
        if self.error is not None:
            raise self.error
        assert self.result is not None  # a row finishes with its result or its error
        return self.result

    @property
    def seeded_sampling(self) -> bool:
        return self.sp.seed is not None and not self.sp.greedy

    @property
    def group_key(self):
        """The draft group this row drafts in: its drafter's, or one of its own in its own lane."""
        key = self.drafter.group_key
        return ("own lane", id(self), key) if key is not None and self.own_lane else key


@dataclass
class _Decided:
    """What a verifier decided for ``rows``, still on the logits' device (``Engine._decide_on_device``)."""

    rows: list[int]
    values: list[torch.Tensor]  # a chain's [accepted counts, next tokens]; [] when its verification failed
    tree: bool = False  # a greedy tree's: values is [the target's argmax at its fed positions]


class Engine:
    """Continuous batching over one target (any ``TargetModel``, models/base.py). ``rule`` (a
    ``policy.BatchRule``, optional) shrinks drafting as the batch grows. ``isolate_seeded``: each seeded
    sampling row decodes in a lane of its own, so its tokens are those of decoding it alone; False
    batches such rows with the others (faster; their stats then say ``reproducible`` False). ``prefix_cache``
    (core/prefix_cache.py): rows leave their committed tokens there (where the backend saves prefixes); a
    Job's ``start`` is what it found there (SpecDecoder.prepare looks it up)."""

    def __init__(
        self,
        target,
        eos_ids: set[int] | None = None,
        tokenizer=None,
        rule: BatchRule | None = None,
        compact_slack: int = 32,
        isolate_seeded: bool = True,
        prefix_cache: PrefixCache | None = None,
    ):
        self.target = target
        self.device = target.device  # where its logits come back: verification and the rows' random streams
        self.isolate_seeded = isolate_seeded
        self.eos_ids = set(eos_ids if eos_ids is not None else target.eos_token_ids())
        self.tokenizer = tokenizer
        self.rule = rule
        self.kv = RowLanes(lambda: target.new_rows(compact_slack))
        self.prefix_cache = prefix_cache if target.capabilities.prefixes else None
        self.rows: list[Request] = []
        self.groups: dict = {}  # group_key -> DraftGroup
        self.last_step_s = 0.0

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def cache_len(self) -> int:
        return self.kv.L

    # --- rows join and leave ----------------------------------------------------------------------
    def add(
        self,
        prompt_ids: list[int],
        sp: SamplingParams | dict | None,
        drafter: Drafter,
        on_emit: OnEmit | None = None,
        tag: Any = None,
        length: DraftLength | None = None,
        lossy: TypicalAcceptance | None = None,
    ) -> Request:
        """Admit a request: validate, prefill its prompt (all but the last token, which is pending).
        ``lossy``: the request's opt-in lossy verification rule (None: exact; core/verify.py)."""
        row = self.add_many([Job(prompt_ids, sp, drafter, on_emit=on_emit, tag=tag, length=length, lossy=lossy)])[0]
        assert isinstance(row, Request)  # (one job: its refusal was raised)
        return row

    def add_many(self, jobs: list[Job]) -> list[Request | Exception]:
        """Admit several jobs at once, prefilled together in one forward. Returns, per job, its Request or
        the exception that refused it (one job alone: that exception is raised)."""
        rows: list[Request] = []
        out: list[Request | Exception] = []
        for job in jobs:
            try:
                rows.append(self._new_request(job))
                out.append(rows[-1])
            except Exception as e:  # this job's own setup (its sampling, its drafter's begin): it alone fails
                out.append(e)
        if rows:
            self._prefill(rows)
        if len(jobs) == 1 and isinstance(out[0], Exception):
            raise out[0]
        return out

    def _new_request(self, job: Job) -> Request:
        sp = SamplingParams.from_dict(job.sampling)
        prompt_ids = [int(t) for t in job.prompt_ids]
        drafter, lossy = job.drafter, job.lossy
        check_fits(self.target, len(prompt_ids), sp)
        if sp.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer")
        caps = self.target.capabilities
        if drafter.wants_hidden and not (caps.hidden or caps.layers):  # a head on the target's features
            raise ConfigError(
                f"{drafter.name} reads the target's features, which {self.target.name} on the "
                f"{self.target.backend} backend does not hand over"
            )
        row = Request(
            prompt_ids,
            sp,
            drafter,
            job.on_emit,
            job.tag,
            job.length or DraftLength(),
            tokens=list(prompt_ids),
            stats=GenerationStats(prompt_tokens=len(prompt_ids)),
            t_start=time.perf_counter(),
            lossy=lossy,
            partition=job.partition,
            start=job.start,
        )
        row.stats.cached_tokens = 0 if job.start is None else job.start[1]
        row.stats.lossy = lossy_label(lossy, sp)
        if row.seeded_sampling:
            row.stats.reproducible = (
                drafter.reproducible and row.length.reproducible and lossy is None and self.isolate_seeded
            )
            row.own_lane = row.stats.reproducible  # what else runs must not change its forwards' numerics
        row.gen = make_generator(sp.seed, self.device)
        row.eos = set() if sp.ignore_eos else self.eos_ids
        row.stopper = _StopChecker(sp.stop, self.tokenizer) if sp.stop else None
        row.processor = job.processor or RequestProcessor.for_request(
            sp, prompt_ids, self.target.vocab_size, self.eos_ids, self.tokenizer
        )
        row.logprobs = None if sp.logprobs is None else []
        drafter.begin(prompt_ids, sp, row.gen, row.processor)  # (a drafter that samples processes its logits so)
        return row

    def _prefill(self, rows: list[Request]) -> None:
        t0 = time.perf_counter()
        want = [r.drafter.wants_hidden for r in rows]
        self.kv.add_rows(
            [r.prompt_ids[:-1] for r in rows],
            hidden=any(want),
            own=[r.own_lane for r in rows],
            start=[r.start for r in rows],
        )
        for r, w, h in zip(rows, want, self.kv.prefill_hidden):
            r.hidden_prefix = h if w else None
        self.kv.prefill_hidden = []
        first = len(self.rows)  # the new rows are the cache's last ones
        for key, members in _by_group(rows).items():
            if key not in self.groups:
                self.groups[key] = members[0].drafter.new_group()
            self.groups[key].join(members, self.kv.locate([first + rows.index(m) for m in members]))
        dt = (time.perf_counter() - t0) / len(rows)
        for r in rows:
            r.prefill_s = dt
        self.rows.extend(rows)

    def cancel(self, row: Request) -> None:
        """Remove a row now (its KV slots are freed); it finishes "cancelled"."""
        if row in self.rows:
            self._finish(row, "cancelled")
            self._drop([self.rows.index(row)])

    def _finish(self, row: Request, reason: str) -> None:
        row.finish = reason
        st = row.stats
        st.wall_s = time.perf_counter() - row.t_start
        st.prefill_s = row.prefill_s
        out = row.output
        st.new_tokens = len(out)
        st.finish_reason = reason
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if row.stopper is not None:
                text = row.stopper.trim(text)
        row.result = GenerationResult(out, text, st, row.logprobs)

    def _drop(self, idx: list[int]) -> None:
        if self.prefix_cache is not None:
            for r in idx:
                self._save_prefix(self.prefix_cache, r)
        self.kv.remove_rows(idx)
        gone = [self.rows[i] for i in idx]
        for key, members in _by_group(gone).items():
            self.groups[key].leave(members)
            if members[0].own_lane:  # its row's own group
                del self.groups[key]
        drop = set(idx)
        self.rows = [r for i, r in enumerate(self.rows) if i not in drop]

    def _save_prefix(self, cache: PrefixCache, r: int) -> None:
        """A leaving row's committed tokens into the prefix cache (not a failed row's: its cache may be torn)."""
        row = self.rows[r]
        if row.error is not None or row.finish == "error":
            return
        saved = self.kv.save_prefix(r)
        # the cache may hold accepted tokens past an end the row found mid-draft (EOS, a stop string): only
        # those it emitted are named
        cache.insert(row.tokens[: saved.n], saved, row.partition)

    # --- one step -----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One decoding step for every row; returns the rows that finished (already removed)."""
        shed = self._shed()
        rows = self.rows
        if not rows:
            return shed
        t0 = time.perf_counter()
        drafts, draft_s = self._draft(rows)
        drafts = self._fit(drafts)
        t1 = time.perf_counter()
        logits = self._process(rows, drafts, self._score(rows, drafts))
        n_acc, new, keep = self._verify(rows, drafts, logits)
        lps = [
            None if row.sp.logprobs is None else logprob_entries(logits[r, _slots(keep[r])], new[r], row.sp.logprobs)
            for r, row in enumerate(rows)
        ]
        self.kv.commit(keep)
        verify_s = time.perf_counter() - t1
        ended = [
            self._advance(row, drafts[r], n_acc[r], new[r], draft_s[r], verify_s, lps[r]) for r, row in enumerate(rows)
        ]
        for key, members in _by_group(rows).items():  # after the rows' tokens grew: groups read them
            self._guard(members, self.groups[key].feedback, members, [n_acc[rows.index(m)] for m in members])
        done = [r for r, row in enumerate(rows) if ended[r] or row.error is not None]
        for r in done:
            if rows[r].error is not None and rows[r].finish is None:
                self._finish(rows[r], "error")
        self.last_step_s = time.perf_counter() - t0
        finished = [rows[r] for r in done]
        self._drop(done)
        return shed + finished

    def _shed(self) -> list[Request]:
        """Rows a shared, full cache cannot feed even their pending token this step leave first, the last
        joined first, each with its own error: the others decode on (llama.cpp: rows share n_ctx cells)."""
        idx = []
        for room, members in self.kv.rooms():  # per lane: its cache's room, its rows
            over = 0 if room is None else len(members) - room[1]
            idx += members[len(members) - over :] if over > 0 else []
        gone = [self.rows[r] for r in sorted(idx)]
        for row in gone:
            row.error = ContextLengthError(
                "the model's context (shared by the requests decoding together) is full; retry when fewer requests run"
            )
            self._finish(row, "error")
        if gone:
            self._drop(sorted(idx))
        return gone

    def _fit(self, drafts: list[DraftTree]) -> list[DraftTree]:
        """Drafts cut to what a shared, bounded cache can take this step (each lane's ``draft_room``): the
        free cells beyond the pending tokens and, for token trees, the spare sequence ids. A cut draft keeps
        its first nodes (ancestor-closed), as if its drafter had stopped early, so verification stays exact."""
        out = list(drafts)
        for room, members in self.kv.rooms():  # each lane's cache bounds its own rows
            if room is None:
                continue
            seqs, cells = room[0], room[1] - len(members)
            for r in members:
                d = out[r].first(max(cells, 0))
                while d.extra_leaves() > seqs:
                    d = d.first(d.size // 2)
                seqs, cells = seqs - d.extra_leaves(), cells - d.size
                out[r] = d
        return out

    @staticmethod
    def _guard(rows: list[Request], fn, *args, default=None):
        """``fn(*args)`` for work that belongs to ``rows`` only (a drafter, a group, a processor): an
        exception fails those rows (they finish "error" at the end of the step and leave the batch),
        not the others. Rows that already failed are skipped."""
        if any(r.error is not None for r in rows):
            return default
        try:
            return fn(*args)
        except Exception as e:  # a bug in one request's work must not take the batch down
            for r in rows:
                r.error = e
            return default

    def _caps(self, rows: list[Request]) -> list[int]:
        """Each row's draft depth this step: its DraftLength, then the batch rule (seeded sampling rows
        are exempt, so their samples do not depend on what else runs)."""
        caps = []
        for row in rows:
            limit = row.sp.max_new_tokens - len(row.output) - 1
            k = row.length.choose(row.drafter.max_draft_depth(), limit)
            if self.rule is not None and not row.seeded_sampling:
                k = self.rule.cap(len(rows), k)
            caps.append(max(0, min(k, limit)))
        return caps

    def _draft(self, rows: list[Request]) -> tuple[list[DraftTree], list[float]]:
        caps = self._caps(rows)
        drafts: list = [None] * len(rows)
        draft_s = [0.0] * len(rows)
        for key, members in _by_group(rows).items():
            ta = time.perf_counter()
            idx = [rows.index(m) for m in members]
            proposed = self._guard(
                members,
                self.groups[key].propose,
                members,
                [caps[r] for r in idx],
                default=[DraftTree.empty()] * len(idx),
            )
            for r, d in zip(idx, proposed):
                drafts[r] = d
            for r in idx:
                draft_s[r] = (time.perf_counter() - ta) / len(idx)
        for r, row in enumerate(rows):
            if drafts[r] is None:
                ta = time.perf_counter()
                drafts[r] = self._guard([row], row.drafter.propose, row.tokens, caps[r], default=DraftTree.empty())
                draft_s[r] = time.perf_counter() - ta
            if row.processor is not None and not row.drafter.reads_fed_positions:
                drafts[r] = self._guard([row], self._constrain, row, drafts[r], default=DraftTree.empty())
        return drafts, draft_s

    @staticmethod
    def _constrain(row: Request, draft: DraftTree) -> DraftTree:
        """The draft without what the grammar rules out (the target scores none of it), then the tokens
        the grammar forces after it."""
        proc = row.processor
        if proc is None:  # (the caller constrains only rows with a processor)
            return draft
        d = proc.prune(row.tokens, draft)
        room = row.sp.max_new_tokens - len(row.output) - 1 - d.size
        return proc.extend_forced(row.tokens, d, min(row.drafter.forced_tokens, room))

    def _score(self, rows: list[Request], drafts: list[DraftTree]) -> torch.Tensor:
        """The target's forward over every row's pending token + draft; each drafter observes its own
        row's fed tokens, logits [k + 1, V] and features (when it wants them), kept for its observe."""
        seqs = [[row.tokens[-1]] + d.tokens.tolist() for row, d in zip(rows, drafts)]
        trees = [None if d.is_chain() else feed_mask(d) for d in drafts]
        want = [row.drafter.wants_hidden for row in rows]
        logits = self.kv.forward(seqs, trees=trees, hidden=any(want))  # [B, N, V]
        hidden, self.kv.last_hidden = self.kv.last_hidden, None
        for r, row in enumerate(rows):
            h = None
            if want[r]:  # the positions the row fed; a row's first step also gets its prompt's features
                assert hidden is not None  # forward(hidden=True) leaves them
                h = hidden[r, : len(seqs[r])]
                if row.hidden_prefix is not None:
                    h = torch.cat([row.hidden_prefix.to(h.dtype), h])
                    row.hidden_prefix = None
            row.seen = (torch.tensor(seqs[r], device=HOST), logits[r, : drafts[r].size + 1], h)
        return logits

    def _process(self, rows: list[Request], drafts: list[DraftTree], logits: torch.Tensor) -> torch.Tensor:
        """Rows with penalties, bias or a grammar get every fed position processed with its own history
        (the context + the draft tokens on its path); the others are left as scored."""
        todo = [r for r, row in enumerate(rows) if row.processor is not None]
        if not todo:
            return logits
        logits = logits.to(torch.float32, copy=True)
        for r in todo:
            m = drafts[r].size + 1
            out = self._guard([rows[r]], _processed, rows[r].processor, logits[r, :m], rows[r].tokens, drafts[r])
            if out is not None:
                logits[r, :m] = out
        return logits

    def _verify(self, rows, drafts, logits) -> tuple[list[int], list[list[int]], list]:
        """Per row: the number of accepted drafts, the tokens to append (accepted drafts + the next
        token), and the fed slots the cache keeps. Greedy chains are verified together, sampled chains
        with the row's own generator, trees per row; what chains and greedy trees decide is read from the
        logits' device at once (``_decide_on_device``)."""
        chain = [d.is_chain() for d in drafts]
        decided = self._read_decisions(self._decide_on_device(rows, drafts, chain, logits), drafts)
        n_acc, new, keep = [], [], []
        for r, (row, d) in enumerate(zip(rows, drafts)):
            if r in decided:
                path, t = decided[r]
            else:  # a sampled tree (a row whose verification fails, e.g. on NaN logits, finishes "error")
                path, t = self._guard(
                    [row], verify_tree, d, logits[r, : d.size + 1], row.sp, row.gen, row.lossy, default=([], 0)
                )
            if t < 0:  # sampling found no token to draw (sampling.sample, strict False)
                row.error, path, t = row.error or SpecDraftError(NO_TOKEN), [], 0
            n_acc.append(len(path))
            keep.append(1 + len(path) if chain[r] else [0] + [1 + i for i in path])
            new.append((d.tokens[: len(path)] if chain[r] else d.tokens[path]).tolist() + [t])
        return n_acc, new, keep

    def _decide_on_device(self, rows, drafts, chain: list[bool], logits) -> list[_Decided]:
        """What the verifiers decide, left on the logits' device: the greedy chains' (together), each sampled
        chain's (with its row's generator) and each greedy tree's argmax. Sampled trees are not here: they
        walk their nodes (verify.rejection_sample_tree)."""
        dtok = self._draft_tokens(drafts, chain)
        found = []
        greedy = [r for r, row in enumerate(rows) if chain[r] and row.sp.greedy]
        if greedy:
            found.append(_Decided(greedy, self._greedy_chains(greedy, drafts, dtok, logits)))
        for r, (row, d) in enumerate(zip(rows, drafts)):
            if chain[r] and not row.sp.greedy:
                q = None if d.draft_probs is None else d.draft_probs[None]
                out = self._guard(
                    [row],
                    sample_verify,
                    dtok[r : r + 1, : d.size],
                    q,
                    logits[r : r + 1, : d.size + 1],
                    row.sp,
                    row.gen,
                    row.lossy,
                    None,
                    False,
                )  # (num_draft, strict)
                found.append(_Decided([r], [] if out is None else list(out)))
            elif not chain[r] and row.sp.greedy:
                found.append(_Decided([r], [argmax_last(logits[r, : d.size + 1])], tree=True))
        return found

    @staticmethod
    def _read_decisions(found: list[_Decided], drafts) -> dict[int, tuple[list[int], int]]:
        """``_decide_on_device``'s tensors read in one go -> per row: (its accepted path's node indices,
        the next token)."""
        values = _read_once([t for f in found for t in f.values])
        out: dict[int, tuple[list[int], int]] = {}
        for f in found:
            got, values = values[: len(f.values)], values[len(f.values) :]
            if f.tree:
                out[f.rows[0]] = greedy_tree_path(drafts[f.rows[0]], torch.tensor(got[0], device=HOST))
            elif not got:  # its verification failed (the row's error is set)
                out[f.rows[0]] = ([], 0)
            else:
                out.update((r, (list(range(got[0][j])), got[1][j])) for j, r in enumerate(f.rows))
        return out

    def _draft_tokens(self, drafts: list[DraftTree], chain: list[bool]) -> torch.Tensor:
        """The chains' draft tokens [B, K] (zeros past a chain's end and for trees), sent to the logits'
        device in one copy."""
        K = max([d.size for d, c in zip(drafts, chain) if c], default=0)
        dtok = torch.zeros(len(drafts), K, dtype=torch.long, device=HOST)
        for r, d in enumerate(drafts):
            if chain[r] and d.size:
                dtok[r, : d.size] = d.tokens
        return dtok.to(self.device)

    def _greedy_chains(self, greedy: list[int], drafts, dtok: torch.Tensor, logits: torch.Tensor) -> list:
        """[accepted counts, next tokens] of the greedy chain rows, verified together (on the device)."""
        K = dtok.shape[1]
        scored = logits[:, : K + 1]  # a view; indexing rows with a tensor copies them element by element
        if len(greedy) < len(drafts):  # (5 ms for one 151k-vocab row on these CPUs; index_select copies whole rows)
            g = torch.tensor(greedy, dtype=torch.long, device=self.device)
            scored, dtok = scored.index_select(0, g), dtok.index_select(0, g)
        sizes = torch.tensor([drafts[r].size for r in greedy], device=self.device)
        return list(greedy_verify(dtok, scored, sizes))

    def _advance(
        self,
        row: Request,
        draft: DraftTree,
        n_acc: int,
        new: list[int],
        draft_s: float,
        step_s: float,
        logprobs: list | None = None,
    ) -> bool:
        """The end of a row's step (``step_s``: the batch's target-side seconds): feedback, stop
        conditions, the step record, streaming. True when the row finished."""
        if row.error is not None:
            return True
        assert row.seen is not None  # _score set it this step
        fed, logits, hidden = row.seen
        row.seen = None
        self._guard(
            [row], row.drafter.observe, StepOutcome(fed, logits, hidden, draft, n_acc, new, step_s, len(self.rows))
        )
        row.length.observe(draft.size, n_acc, draft_s, step_s, 1 + draft.size)
        new, finish = _cut_at_stop(new, row.eos, row.sp.max_new_tokens - len(row.output))
        if row.stopper is not None:  # a stop string wins over EOS / the length limit it completes before
            cut, hit = row.stopper.check(row.tokens[len(row.prompt_ids) :], new)
            if hit:
                new, finish = cut, "stop"
        row.tokens.extend(new)
        if row.processor is not None:
            self._guard([row], row.processor.commit, new)
        if logprobs is not None and row.logprobs is not None:  # (both or neither: the request asks for them)
            logprobs = logprobs[: len(new)]
            row.logprobs.extend(logprobs)
        vs = step_s / len(self.rows) + (row.prefill_s if not row.stats.steps else 0.0)
        depth = None if draft.is_chain() else int(draft.depths().max())
        row.stats.steps.append(StepRecord(draft.size, n_acc, len(new), draft_s, vs, depth, row.drafter.arm))
        emit_args = (new,) if logprobs is None else (new, logprobs)  # with logprobs asked: their entries too
        if row.on_emit is not None and row.on_emit(*emit_args) and finish is None:
            finish = "cancelled"
        if finish is not None:
            self._finish(row, finish)
        return finish is not None


def _processed(processor: RequestProcessor, logits: torch.Tensor, history: list[int], draft: DraftTree) -> torch.Tensor:
    """A row's processed logits; a position where processing left no token (greedy would emit the masked
    token 0, sampling would draw from NaN) fails the row with a clear error instead."""
    out = processor.process(logits, history, draft)
    if not bool((out > float("-inf")).any(-1).all()):
        raise ConfigError(
            "no token is allowed here: the request's constraints (grammar, min_tokens, logit_bias) rule out every token"
        )
    return out


def _read_once(parts: list[torch.Tensor]) -> list[list[int]]:
    """1-D integer tensors on one device -> their values, as lists, in one read from the device (the
    step's one wait for it)."""
    if not parts:
        return []
    flat = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()
    out, at = [], 0
    for p in parts:
        out.append(flat[at : at + p.numel()])
        at += p.numel()
    return out


def _slots(keep) -> list[int]:
    """The fed positions a row keeps (``keep`` as ``SequenceRows.commit`` takes it: a count or a list)."""
    return list(range(keep)) if isinstance(keep, int) else keep


def _by_group(rows: list[Request]) -> dict:
    """group_key -> the rows (in order) whose drafter drafts through that group."""
    out: dict = {}
    for r in rows:
        if r.group_key is not None:
            out.setdefault(r.group_key, []).append(r)
    return out


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

    def check(self, before: list[int], new: list[int]) -> tuple[list[int], bool]:
        """(``new`` cut after the token completing a stop string, whether one completed)."""
        ctx = before[-self.window :]  # a stop string spans at most `window` earlier tokens
        if not new or not self._hit(ctx + new):
            return new, False
        for i in range(1, len(new) + 1):
            if self._hit(ctx + new[:i]):
                return new[:i], True
        return new, True

    def trim(self, text: str) -> str:
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        return text if cut < 0 else text[:cut]


class StepHook:
    """What a loop over ``Engine.step`` runs around its steps (the online learner, specdraft/learning):
    each step inside ``stepping()``, then ``after_step(rows still running, rows finished)``, between steps.
    This one does nothing."""

    def stepping(self):
        return contextlib.nullcontext()

    def after_step(self, rows: list[Request], finished: list[Request]) -> None:
        pass


# --- entry points -----------------------------------------------------------------------------------
def generate(
    target,
    drafter: Drafter,
    prompt_ids: list[int],
    sp: SamplingParams | dict | None,
    eos_ids: set[int] | None = None,
    tokenizer=None,
    length: DraftLength | None = None,
    on_emit: OnEmit | None = None,
    on_admit: Callable[[Request], None] | None = None,
    lossy: TypicalAcceptance | None = None,
    hook: StepHook | None = None,
) -> GenerationResult:
    """Decode one request: the loop with a batch of one. ``on_emit(new_tokens)`` (optional) is called
    after every step with the tokens appended (for streaming; ``on_emit(new_tokens, logprob_entries)``
    when the request asks for logprobs); returning True cancels the request (finish_reason
    "cancelled"). ``on_admit(row)`` (optional) sees the row once prefilled: its ``stats.steps`` gains the
    step's StepRecord before each ``on_emit``. ``hook``: a StepHook around the steps."""
    job = Job(prompt_ids, sp, drafter, on_emit=on_emit, length=length, lossy=lossy)
    return run_one(Engine(target, eos_ids, tokenizer), job, on_admit, hook)


def run_one(
    eng: Engine, job: Job, on_admit: Callable[[Request], None] | None = None, hook: StepHook | None = None
) -> GenerationResult:
    """Decode ``job`` alone on ``eng`` (an engine with no rows; it keeps what it caches across calls)."""
    hook = StepHook() if hook is None else hook
    row = eng.add_many([job])[0]
    if isinstance(row, Exception):
        raise row
    if on_admit is not None:
        on_admit(row)
    try:
        while eng.rows:
            with hook.stepping():
                finished = eng.step()
            hook.after_step(eng.rows, finished)
    finally:  # (an interrupt, an engine bug: the engine is left empty for the next call)
        for r in list(eng.rows):
            eng.cancel(r)
    return row.outcome()


def generate_batch(
    target,
    jobs: list[Job],
    eos_ids=None,
    tokenizer=None,
    rule: BatchRule | None = None,
    max_batch: int | None = None,
    join_every: int = 0,
    isolate_seeded: bool = True,
    hook: StepHook | None = None,
) -> list[GenerationResult]:
    """Decode several jobs together (their ``tag`` is set to their place here); results in job order.

    ``max_batch`` bounds the rows decoded at once (the rest wait and join as rows leave);
    ``join_every`` > 0 admits at most one waiting job every that many steps (staggered joins);
    ``isolate_seeded``: as ``Engine``'s; ``hook``: a StepHook around the steps."""
    hook = StepHook() if hook is None else hook
    eng = Engine(target, eos_ids, tokenizer, rule, isolate_seeded=isolate_seeded)
    waiting = list(enumerate(jobs))
    results: dict[int, GenerationResult] = {}
    steps = 0
    while waiting or eng.rows:
        room = len(waiting) if max_batch is None else max_batch - eng.num_rows
        if join_every and eng.rows:
            room = min(room, 0 if steps % join_every else 1)
        if room > 0 and waiting:
            admit, waiting = waiting[:room], waiting[room:]
            for r in eng.add_many([dataclasses.replace(job, tag=i) for i, job in admit]):
                if isinstance(r, Exception):
                    raise r
        with hook.stepping():
            finished = eng.step()
        hook.after_step(eng.rows, finished)
        for row in finished:
            results[row.tag] = row.outcome()
        steps += 1
    return [results[i] for i in range(len(jobs))]
