"""Batched speculative decoding with continuous batching.

Several sequences (rows) decode together: each step every row proposes its own draft, a chain or
a token tree (ragged sizes, zero included), the target scores all rows' pending token + draft in ONE
forward, each row accepts its own number of tokens (chains: the batched ``verify`` functions with
``num_draft``; trees: the batch-1 tree verifiers on the row's own logits), and rows join (``add``)
and leave (finish, cancel) between steps. The plain baseline is the same loop with ``NoDrafter``
rows. Every drafter batches (``BatchDrafters`` makes a row's drafter from its SpecConfig). Drafters
that read the target's final-norm features (``wants_hidden``: Medusa, EAGLE) get, when any row
wants them, the hook's output of the batched forward: each row only its own fed positions.

A tree row feeds [pending] + its nodes with its own tree mask (each node sees the pending token and
its ancestors) at positions (row length + depth); after verification it keeps the slots of the
pending token and the accepted path, and the other nodes become holes like rejected chain drafts.

The batched KV cache (``BatchKV``) is one transformers ``DynamicCache`` of shape [B, H, L, D]
shared by all rows, through the stock model classes: every cache slot has a per-row validity bit,
turned into a 4D additive attention mask, and every fed token gets an explicit per-row position id
(its row's own length), so a row never sees another row's padding or its own rejected drafts.
Each forward appends N = max(tokens fed) slots to every row; after verification a row keeps only
its pending token + accepted drafts, the rest become holes (masked). Columns invalid in every row
are trimmed; when the holes grow past ``compact_slack`` slots the cache is compacted (each row's
valid slots gathered to the right, left-padded). A joining row is prefilled on its own and
left-padded into the batch.

Greedy rows emit exactly what batch-size-1 decoding emits (same dtype): masks and positions make
each row's attention identical; only floating-point summation order can differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .config import SPEC_OFF_AT, SPEC_SHRINK_AT, SamplingParams
from .drafters.draft_model import fit_vocab
from .engine import GenerationResult, _cut_at_stop, _StopChecker, check_fits
from .errors import ConfigError, SpecDraftError
from .metrics import GenerationStats, StepRecord
from .models.adapter import HFModel
from .sampling import make_generator, probs_from_logits, sample
from .tree import DraftTree
from .verify import greedy_verify, lossy_label, sample_verify, verify_tree


# --- the batched KV cache --------------------------------------------------------------------


def _kv(layer):
    k = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", k is not None) or k is None or k.dim() != 4:
        return None
    return layer.keys, layer.values


def _set(layer, k, v):
    layer.keys, layer.values = k, v
    if not getattr(layer, "is_initialized", True):
        layer.device = k.device
        layer.is_initialized = True


class BatchKV:
    """A KV cache of B rows with per-row lengths (``lens``) and holes, over one HFModel's weights."""

    def __init__(self, model: HFModel, compact_slack: int = 32):
        self.model = model
        self.compact_slack = compact_slack
        self.cache = DynamicCache(config=model.config)
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, L]
        self.lens: list[int] = []
        self._last_n = 0
        self.last_hidden: torch.Tensor | None = None  # [B, N, H] of the last forward(hidden=True)
        self.prefill_hidden: list = []  # per row of the last add_rows(hidden=True): [len(prefix), H] or None

    @property
    def B(self) -> int:
        return len(self.lens)

    @property
    def L(self) -> int:
        return int(self.valid.shape[1])

    def _layers(self):
        return self.cache.layers

    def _map(self, fn):
        """Apply fn(tensor [B, H, L, D]) -> tensor to every layer's keys and values."""
        for layer in self._layers():
            kv = _kv(layer)
            if kv is not None:
                _set(layer, fn(kv[0]), fn(kv[1]))

    def add_row(self, prefix: list[int]) -> int:
        """Prefill ``prefix`` (may be empty) as a new last row; returns its index."""
        return self.add_rows([prefix])[0]

    @torch.inference_mode()
    def add_rows(self, prefixes: list[list[int]], hidden: bool = False) -> list[int]:
        """Prefill several prefixes (ragged, may be empty) together in one forward of their own,
        then append them as new last rows (left-padded to the batch); returns their indices.
        ``hidden``: also leave each prefix's final-norm features in ``prefill_hidden`` (a row
        [len(prefix), H], None for an empty prefix)."""
        new = BatchKV(self.model, self.compact_slack)
        new.lens = [0] * len(prefixes)
        new.valid = torch.zeros(len(prefixes), 0, dtype=torch.bool)
        self.prefill_hidden = [None] * len(prefixes)
        if any(prefixes):
            new.forward(prefixes, keep=1, hidden=hidden)
            if hidden:
                self.prefill_hidden = [new.last_hidden[i, : len(p)].clone() if p else None
                                       for i, p in enumerate(prefixes)]
                new.last_hidden = None
            new.commit([len(p) for p in prefixes])
        first = self.B
        self._append(new)
        return list(range(first, self.B))

    def _append(self, other: "BatchKV") -> None:
        """Concatenate another BatchKV's rows below ours, left-padding the shorter one."""
        L, P, B2 = self.L, other.L, other.B
        newL = max(L, P)
        for layer, olayer in zip(self._layers(), other._layers()):
            a, r = _kv(layer), _kv(olayer)
            if a is None and r is None:
                continue
            ref = (a or r)[0]
            H, D = ref.shape[1], ref.shape[3]

            def pad(t, rows, have):
                if t is None:
                    return ref.new_zeros(rows, H, newL, D)
                if newL > have:
                    return torch.cat([t.new_zeros(rows, H, newL - have, D), t], dim=2)
                return t

            k = torch.cat([pad(a and a[0], self.B, L), pad(r and r[0], B2, P)], dim=0)
            v = torch.cat([pad(a and a[1], self.B, L), pad(r and r[1], B2, P)], dim=0)
            _set(layer, k, v)
        valid = torch.zeros(self.B + B2, newL, dtype=torch.bool)
        valid[: self.B, newL - L:] = self.valid
        valid[self.B:, newL - P:] = other.valid
        self.valid = valid
        self.lens = self.lens + other.lens

    @torch.inference_mode()
    def remove_rows(self, idx: list[int]) -> None:
        if not idx:
            return
        drop = set(idx)
        keep = [i for i in range(self.B) if i not in drop]
        if not keep:
            self.cache = DynamicCache(config=self.model.config)
            self.valid = torch.zeros(0, 0, dtype=torch.bool)
            self.lens = []
            return
        sel = torch.tensor(keep, dtype=torch.long)
        self._map(lambda t: t.index_select(0, sel.to(t.device)))
        self.valid = self.valid[sel]
        self.lens = [self.lens[i] for i in keep]
        self.trim()

    @torch.inference_mode()
    def forward(self, seqs: list[list[int]], keep: int | None = None, trees: list | None = None,
                hidden: bool = False) -> torch.Tensor:
        """Feed row r the tokens ``seqs[r]`` (ragged; may be empty) at positions lens[r].. in one
        forward; returns float32 logits [B, N, V], N = max len (row r's first len(seqs[r]) are real);
        ``keep`` returns only the last ``keep`` positions' logits (prefill).

        ``trees[r]`` (optional; None = a causal chain) is ``(allow [n, n] bool, offsets [n] long)`` for
        row r's n fed tokens: fed token i attends to the row's valid cache slots and to the fed tokens
        j with allow[i, j] (itself and its ancestors, for a token tree), at position lens[r] + offsets[i].
        The slots stay provisional until ``commit``. ``hidden``: also leave the final norm's output of
        every fed position in ``last_hidden`` [B, N, H] (row r's first len(seqs[r]) are real; the
        model's ``enable_hidden_capture`` hook, switched on for this forward only)."""
        B, L = self.B, self.L
        n = [len(s) for s in seqs]
        N = max(max(n), 1)
        ids = torch.zeros(B, N, dtype=torch.long)
        for r, s in enumerate(seqs):
            if s:
                ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        local = torch.tril(torch.ones(N, N, dtype=torch.bool))[None].expand(B, N, N)
        pos = torch.tensor(self.lens, dtype=torch.long)[:, None] + torch.arange(N)[None, :]
        if trees is not None and any(t is not None for t in trees):
            local = local.clone()
            for r, t in enumerate(trees):
                if t is not None:
                    allow, off = t
                    m = allow.shape[0]
                    local[r, :m, :m] = allow
                    pos[r, :m] = self.lens[r] + off
        allow = torch.cat([self.valid[:, None, :].expand(B, N, L), local], dim=2)
        dt = self.model.dtype
        mask = torch.zeros(B, 1, N, L + N, dtype=dt).masked_fill(~allow[:, None], torch.finfo(dt).min)
        dev = self.model.device
        kw = {self.model._cache_kw: self.cache}
        m = self.model
        self.last_hidden = None
        if hidden:
            prev = m.capture_hidden
            m.enable_hidden_capture()
            m.last_hidden_batch = None
        try:
            out = m.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                          use_cache=True, logits_to_keep=keep or N, **kw)
        finally:
            if hidden:
                m.capture_hidden = prev
        if hidden:
            self.last_hidden, m.last_hidden, m.last_hidden_batch = m.last_hidden_batch, None, None
        self._last_n = N
        self.valid = torch.cat([self.valid, torch.zeros(B, N, dtype=torch.bool)], dim=1)
        return out.logits.float()

    @torch.inference_mode()
    def commit(self, keep: list) -> None:
        """Of the last forward's slots, row r keeps its first keep[r] (an int), or the slots listed in
        keep[r] (ascending indices into the row's fed tokens: a tree's pending token + accepted
        path); the rest become holes."""
        N, L = self._last_n, self.L
        if all(isinstance(x, int) for x in keep):
            k = torch.tensor(keep, dtype=torch.long)
            self.valid[:, L - N:] = torch.arange(N)[None, :] < k[:, None]
            self.lens = [a + int(b) for a, b in zip(self.lens, keep)]
        else:
            new = torch.zeros(self.B, N, dtype=torch.bool)
            for r, x in enumerate(keep):
                if isinstance(x, int):
                    new[r, :x] = True
                elif len(x):
                    new[r, torch.as_tensor(x, dtype=torch.long)] = True
            self.valid[:, L - N:] = new
            self.lens = [a + (x if isinstance(x, int) else len(x)) for a, x in zip(self.lens, keep)]
        self.trim()
        if self.L - max(self.lens, default=0) >= self.compact_slack:
            self.compact()

    @torch.inference_mode()
    def truncate(self, r: int, n: int) -> None:
        """Keep only row r's first n cached tokens (rollback of one row; call trim() after)."""
        if n < self.lens[r]:
            slots = self.valid[r].nonzero().flatten()
            self.valid[r, slots[n:]] = False
            self.lens[r] = n

    @torch.inference_mode()
    def trim(self) -> None:
        """Drop leading and trailing columns that no row uses."""
        used = self.valid.any(dim=0).nonzero().flatten()
        if used.numel() == 0:
            lo, hi = 0, 0
        else:
            lo, hi = int(used[0]), int(used[-1]) + 1
        if lo == 0 and hi == self.L:
            return
        self._map(lambda t: t[:, :, lo:hi])
        self.valid = self.valid[:, lo:hi]

    @torch.inference_mode()
    def compact(self) -> None:
        """Gather each row's valid slots to the right end (left padding); removes every hole."""
        B, L2 = self.B, max(self.lens, default=0)
        idx = torch.zeros(B, L2, dtype=torch.long)
        valid = torch.zeros(B, L2, dtype=torch.bool)
        for r in range(B):
            slots = self.valid[r].nonzero().flatten()
            idx[r, L2 - slots.numel():] = slots
            valid[r, L2 - slots.numel():] = True

        def gather(t):
            i = idx.to(t.device)[:, None, :, None].expand(B, t.shape[1], L2, t.shape[3])
            return t.gather(2, i)

        self._map(gather)
        self.valid = valid

    def holes(self) -> int:
        return int(self.B * self.L - int(self.valid.sum()))


# --- batched drafting with a draft model ------------------------------------------------------


class BatchedDraftModel:
    """Drafts for all draft_model rows of a batch together: one BatchKV over the draft model's
    weights, so each drafting iteration is one batched draft forward (ragged catch-up feeds, then
    one token per still-drafting row). Per row it emits exactly what DraftModelDrafter emits: the
    row's draft cache holds a prefix of its tokens, the last draft is never fed, and after
    verification the cache is cut back to the context + accepted drafts."""

    def __init__(self, draft: HFModel, target_vocab: int):
        self.draft = draft
        self.target_vocab = target_vocab
        self.kv = BatchKV(draft)
        self.members: list = []  # BatchRow, in kv row order

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.target_vocab)

    def join(self, rows) -> None:
        self.kv.add_rows([[] for _ in rows])
        self.members.extend(rows)

    def leave(self, rows) -> None:
        idx = [self.members.index(r) for r in rows if r in self.members]
        self.kv.remove_rows(idx)
        drop = set(idx)
        self.members = [m for i, m in enumerate(self.members) if i not in drop]

    def propose(self, rows, caps: list[int]) -> list[DraftTree]:
        kv, R = self.kv, len(self.members)
        cap_of = {id(r): c for r, c in zip(rows, caps)}
        c = [cap_of.get(id(m), 0) for m in self.members]
        out = [[] for _ in range(R)]
        probs = [[] for _ in range(R)]
        active = [c[i] > 0 for i in range(R)]
        for i in range(R):
            self.members[i]._dbase = len(self.members[i].tokens)
        step = 0
        while any(active):
            if step == 0:
                seqs = [m.tokens[kv.lens[i]:] if active[i] else [] for i, m in enumerate(self.members)]
                last = [max(len(q) - 1, 0) for q in seqs]
            else:
                seqs = [[int(out[i][-1])] if active[i] else [] for i in range(R)]
                last = [0] * R
            logits = kv.forward(seqs)
            kv.commit([len(q) for q in seqs])
            for i, m in enumerate(self.members):
                if not active[i]:
                    continue
                lg = self._fit(logits[i, last[i]])
                thr = m.drafter.cfg.confidence_threshold
                if m.sp.greedy:
                    if thr > 0 and step > 0 and float(torch.softmax(lg, -1).max()) < thr:
                        active[i] = False
                        continue
                    t = lg.argmax(-1)
                else:
                    q = probs_from_logits(lg, m.sp)
                    if thr > 0 and step > 0 and float(q.max()) < thr:
                        active[i] = False
                        continue
                    t = sample(q, m.gen)
                    probs[i].append(q)
                out[i].append(t)
                if len(out[i]) >= c[i]:
                    active[i] = False
            step += 1
        for i, m in enumerate(self.members):
            m._ddrafted = len(out[i])
        by_row = {id(m): i for i, m in enumerate(self.members)}
        trees = []
        for r in rows:
            i = by_row[id(r)]
            if not out[i]:
                trees.append(DraftTree.empty())
            else:
                trees.append(DraftTree.chain(torch.stack(out[i]), torch.stack(probs[i]) if probs[i] else None))
        return trees

    def feedback(self, rows, n_acc: list[int]) -> None:
        for r, n in zip(rows, n_acc):
            i = self.members.index(r)
            self.kv.truncate(i, r._dbase + min(n, max(r._ddrafted - 1, 0)))
        self.kv.trim()


class GroupDraft:
    """The per-row drafter of a row drafted by a BatchedDraftModel (``group``); holds the row's
    draft length schedule (constant or heuristic, as DraftModelDrafter)."""

    name = "draft_model"

    def __init__(self, group: BatchedDraftModel, cfg):
        self.group = group
        self.cfg = cfg
        self.k = cfg.k

    def begin(self, prompt_ids, sp, generator):
        self.k = self.cfg.k

    def propose(self, tokens, max_tokens):
        raise RuntimeError("a GroupDraft row is drafted by its group (BatchEngine.step)")

    def feedback(self, num_accepted, emitted, drafted: int = 0):
        if self.cfg.schedule == "heuristic" and drafted:
            self.k = min(self.k + 2, self.cfg.max_k) if num_accepted == drafted else max(self.k - 1, 1)


# --- the engine ------------------------------------------------------------------------------


class BatchSpecPolicy:
    """Shrink speculation as the batch grows: a batched forward already uses the hardware better,
    so drafted-then-rejected tokens cost more. From ``shrink_at`` rows the draft length is halved,
    from ``off_at`` rows nothing is drafted (plain steps). Output is unchanged; only drafting is."""

    def __init__(self, shrink_at: int = SPEC_SHRINK_AT, off_at: int = SPEC_OFF_AT):
        if shrink_at < 1 or off_at < 1:
            raise ConfigError(f"batch policy thresholds must be >= 1, got shrink_at={shrink_at}, off_at={off_at}")
        self.shrink_at, self.off_at = shrink_at, off_at

    def cap(self, batch_size: int, k: int) -> int:
        if batch_size >= self.off_at:
            return 0
        if batch_size >= self.shrink_at:
            return max(1, k // 2)
        return k


@dataclass(eq=False)  # rows are compared by identity
class BatchRow:
    prompt_ids: list[int]
    sp: SamplingParams
    drafter: object
    on_emit: object = None
    tag: object = None
    tokens: list[int] = field(default_factory=list)
    stats: GenerationStats = None
    finish: str | None = None
    result: GenerationResult | None = None
    t_start: float = 0.0

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]


class BatchEngine:
    def __init__(self, target: HFModel, eos_ids: set[int] | None = None, tokenizer=None,
                 policy: BatchSpecPolicy | None = None, compact_slack: int = 32):
        self.target = target
        self.eos_ids = set(eos_ids if eos_ids is not None else target.eos_token_ids())
        self.tokenizer = tokenizer
        self.policy = policy
        self.kv = BatchKV(target, compact_slack)
        self.rows: list[BatchRow] = []

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def cache_len(self) -> int:
        return self.kv.L

    def add(self, prompt_ids: list[int], sp: SamplingParams, drafter, on_emit=None, tag=None) -> BatchRow:
        """Admit a sequence: validate, prefill its prompt (all but the last token, which is pending)."""
        return self.add_many([(prompt_ids, sp, drafter, on_emit, tag)])[0]

    def add_many(self, items: list[tuple]) -> list:
        """Admit several (prompt_ids, sampling, drafter, on_emit, tag) at once, prefilled together in one
        forward. Returns, per item, its BatchRow or the SpecDraftError that refused it."""
        rows, out = [], []
        for prompt_ids, sp, drafter, on_emit, tag in items:
            try:
                rows.append(self._new_row(prompt_ids, sp, drafter, on_emit, tag))
                out.append(rows[-1])
            except SpecDraftError as e:
                out.append(e)
        if rows:
            t0 = time.perf_counter()
            want = [_wants_hidden(r.drafter) for r in rows]
            self.kv.add_rows([r.prompt_ids[:-1] for r in rows], hidden=any(want))
            for r, w, h in zip(rows, want, self.kv.prefill_hidden):
                r.hidden_prefix = h if w else None  # the prompt's features: the row's first observe gets them
            self.kv.prefill_hidden = []
            for g in {id(r.drafter.group): r.drafter.group for r in rows if getattr(r.drafter, "group", None)}.values():
                g.join([r for r in rows if getattr(r.drafter, "group", None) is g])
            dt = (time.perf_counter() - t0) / len(rows)
            for r in rows:
                r.prefill_s = dt
            self.rows.extend(rows)
        if len(items) == 1 and isinstance(out[0], SpecDraftError):
            raise out[0]
        return out

    def _new_row(self, prompt_ids, sp, drafter, on_emit, tag) -> BatchRow:
        sp = SamplingParams.from_dict(sp)
        prompt_ids = [int(t) for t in prompt_ids]
        check_fits(self.target, len(prompt_ids), sp)
        if sp.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer")
        if _wants_hidden(drafter):  # a head on the target's features: the target must expose its final norm
            prev = self.target.capture_hidden
            self.target.enable_hidden_capture()
            self.target.capture_hidden = prev
        row = BatchRow(prompt_ids, sp, drafter, on_emit, tag, tokens=list(prompt_ids),
                       stats=GenerationStats(prompt_tokens=len(prompt_ids)), t_start=time.perf_counter())
        row.stats.lossy = lossy_label(getattr(drafter, "lossy", None), sp)
        row.gen = make_generator(sp.seed)
        row.eos = set() if sp.ignore_eos else self.eos_ids
        row.stopper = _StopChecker(sp.stop, self.tokenizer) if sp.stop else None
        drafter.begin(prompt_ids, sp, row.gen)
        return row

    def cancel(self, row: BatchRow) -> None:
        """Remove a row now (its KV slots are freed); it finishes "cancelled"."""
        if row in self.rows:
            self._finish(row, "cancelled")
            self._drop([self.rows.index(row)])

    def _finish(self, row: BatchRow, reason: str) -> None:
        row.finish = reason
        st = row.stats
        st.wall_s = time.perf_counter() - row.t_start
        out = row.output
        st.new_tokens = len(out)
        st.finish_reason = reason
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            if row.stopper is not None:
                text = row.stopper.trim(text)
        row.result = GenerationResult(out, text, st)

    def _drop(self, idx: list[int]) -> None:
        self.kv.remove_rows(idx)
        drop = set(idx)
        for i in idx:
            g = getattr(self.rows[i].drafter, "group", None)
            if g is not None:
                g.leave([self.rows[i]])
        self.rows = [r for i, r in enumerate(self.rows) if i not in drop]

    def step(self) -> list[BatchRow]:
        """One decoding step for every row; returns the rows that finished (already removed)."""
        rows = self.rows
        if not rows:
            return []
        B = len(rows)
        t0 = time.perf_counter()
        drafts, draft_s, caps = [None] * B, [0.0] * B, []
        groups: dict[int, tuple] = {}
        for r, row in enumerate(rows):
            remaining = row.sp.max_new_tokens - len(row.output)
            cap = remaining - 1
            if self.policy is not None:
                cap = min(cap, self.policy.cap(B, draft_depth(row.drafter, remaining - 1)))
            caps.append(max(cap, 0))
            g = getattr(row.drafter, "group", None)
            if g is not None:
                caps[r] = min(caps[r], row.drafter.k)
                groups.setdefault(id(g), (g, []))[1].append(r)
        for g, idx in groups.values():
            ta = time.perf_counter()
            for r, d in zip(idx, g.propose([rows[r] for r in idx], [caps[r] for r in idx])):
                drafts[r] = d
            for r in idx:
                draft_s[r] = (time.perf_counter() - ta) / len(idx)
        for r, row in enumerate(rows):
            if drafts[r] is not None:
                continue
            ta = time.perf_counter()
            drafts[r] = row.drafter.propose(row.tokens, caps[r])
            draft_s[r] = time.perf_counter() - ta
        t1 = time.perf_counter()
        ks = [d.size for d in drafts]
        chain = [d.is_chain() for d in drafts]
        seqs = [[row.tokens[-1]] + d.tokens.tolist() for row, d in zip(rows, drafts)]
        trees = [None if c else _tree_feed(d) for c, d in zip(chain, drafts)]
        want = [_wants_hidden(row.drafter) for row in rows]
        logits = self.kv.forward(seqs, trees=trees, hidden=any(want))  # [B, N, V]
        hidden, self.kv.last_hidden = self.kv.last_hidden, None
        for r, row in enumerate(rows):  # as the single-sequence engine: the row's [k + 1, V] logits
            observe = getattr(row.drafter, "observe_target", None)
            if observe is None:
                continue
            if not want[r]:
                observe(torch.tensor(seqs[r]), logits[r, : ks[r] + 1])
                continue
            # features of every position the row fed (pending token, then its drafts / tree nodes in
            # node order), not the padding; a row's first step also gets its prompt's prefill features,
            # as the single-sequence engine's first forward feeds the whole prompt
            h = hidden[r, : len(seqs[r])]
            pre = getattr(row, "hidden_prefix", None)
            if pre is not None:
                h = torch.cat([pre.to(h.dtype), h])
                row.hidden_prefix = None
            observe(torch.tensor(seqs[r]), logits[r, : ks[r] + 1], h)
        n_acc, nxt, keep, acc_tokens = [0] * B, [0] * B, [None] * B, [None] * B
        # chains: the batched verifiers (greedy rows together; sampling rows with their own generator)
        K = max([ks[r] for r in range(B) if chain[r]], default=0)
        dtok = torch.zeros(B, K, dtype=torch.long)
        for r, d in enumerate(drafts):
            if chain[r] and d.size:
                dtok[r, : d.size] = d.tokens
        greedy = [r for r in range(B) if rows[r].sp.greedy and chain[r]]
        if greedy:
            g = torch.tensor(greedy, dtype=torch.long)
            na, nx = greedy_verify(dtok[g], logits[g, : K + 1], torch.tensor([ks[r] for r in greedy]))
            for j, r in enumerate(greedy):
                n_acc[r], nxt[r] = int(na[j]), int(nx[j])
        for r in range(B):
            if not chain[r] or rows[r].sp.greedy:
                continue
            k, d = ks[r], drafts[r]
            q = None if d.draft_probs is None else d.draft_probs[None]
            na, nx = sample_verify(dtok[r: r + 1, :k], q, logits[r: r + 1, : k + 1], rows[r].sp, rows[r].gen,
                                   getattr(rows[r].drafter, "lossy", None))
            n_acc[r], nxt[r] = int(na[0]), int(nx[0])
        for r in range(B):
            if chain[r]:
                keep[r] = 1 + n_acc[r]
                acc_tokens[r] = drafts[r].tokens[: n_acc[r]].tolist()
                continue
            # token trees: each row's own tree verifier on its own logits; keep the accepted path
            d = drafts[r]
            path, nxt[r] = verify_tree(d, logits[r, : ks[r] + 1], rows[r].sp, rows[r].gen,
                                       getattr(rows[r].drafter, "lossy", None))
            n_acc[r] = len(path)
            keep[r] = [0] + [1 + i for i in path]
            acc_tokens[r] = d.tokens[path].tolist()
        self.kv.commit(keep)
        for g, idx in groups.values():
            g.feedback([rows[r] for r in idx], [n_acc[r] for r in idx])
        t2 = time.perf_counter()
        verify_s = (t2 - t1) / B
        done = []
        for r, row in enumerate(rows):
            new = acc_tokens[r] + [nxt[r]]
            if getattr(row.drafter, "group", None) is not None:
                row.drafter.feedback(n_acc[r], new, ks[r])
            else:
                row.drafter.feedback(n_acc[r], new)
            remaining = row.sp.max_new_tokens - len(row.output)
            new, finish = _cut_at_stop(new, row.eos, remaining)
            if row.stopper is not None and finish is None:
                new, finish = row.stopper.check(row.tokens[len(row.prompt_ids):], new)
            row.tokens.extend(new)
            vs = verify_s + (row.prefill_s if not row.stats.steps else 0.0)
            depth = None if chain[r] else int(drafts[r].depths().max())
            row.stats.steps.append(StepRecord(ks[r], n_acc[r], len(new), draft_s[r], vs, depth))
            if row.on_emit is not None and row.on_emit(new) and finish is None:
                finish = "cancelled"
            if finish is not None:
                self._finish(row, finish)
                done.append(r)
        self.last_step_s = time.perf_counter() - t0
        finished = [rows[r] for r in done]
        self._drop(done)
        return finished


def _wants_hidden(drafter) -> bool:
    """A drafter that reads the target's final-norm features (Medusa, EAGLE)."""
    return bool(getattr(drafter, "wants_hidden", False))


def _tree_feed(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(allow, offsets) for feeding [pending token] + a token tree's nodes: the pending token sees
    itself, node i sees the pending token and its own ancestors (itself included), at depth(i)."""
    n = tree.size
    allow = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allow[:, 0] = True
    allow[1:, 1:] = tree.ancestors()
    return allow, torch.cat([torch.zeros(1, dtype=torch.long), tree.depths()])


def draft_depth(drafter, default: int) -> int:
    """The deepest draft a drafter makes per step (what ``BatchSpecPolicy`` shrinks): a model
    tree's depth, a chain's current k, a model-free tree's depth; ``default`` when unbounded."""
    for attr in ("max_depth", "k"):
        v = getattr(drafter, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    branching = getattr(drafter, "branching", None)
    if branching:
        return len(branching)
    if hasattr(drafter, "W") and hasattr(drafter, "N"):  # lookahead: window + verification branch
        return drafter.W + drafter.N - 2
    k = getattr(getattr(drafter, "cfg", None), "k", None)
    return k if isinstance(k, int) and k > 0 else default


def generate_batch(target: HFModel, jobs: list[tuple[list[int], SamplingParams, object]], eos_ids=None,
                   tokenizer=None, policy: BatchSpecPolicy | None = None, max_batch: int | None = None,
                   join_every: int = 0) -> list[GenerationResult]:
    """Decode several (prompt_ids, sampling, drafter) jobs together; returns results in job order.

    ``max_batch`` bounds the rows decoded at once (the rest wait and join as rows leave);
    ``join_every`` > 0 admits at most one waiting job every that many steps (staggered joins)."""
    eng = BatchEngine(target, eos_ids, tokenizer, policy)
    waiting = list(enumerate(jobs))
    results: dict[int, GenerationResult] = {}
    steps = 0
    while waiting or eng.rows:
        room = len(waiting) if max_batch is None else max_batch - eng.num_rows
        if join_every and eng.rows:
            room = min(room, 0 if steps % join_every else 1)
        if room > 0 and waiting:
            admit, waiting = waiting[:room], waiting[room:]
            for r in eng.add_many([(ids, sp, drafter, None, i) for i, (ids, sp, drafter) in admit]):
                if isinstance(r, SpecDraftError):
                    raise r
        for row in eng.step():
            results[row.tag] = row.result
        steps += 1
    return [results[i] for i in range(len(jobs))]


class BatchDrafters:
    """Makes each batch row's drafter from its SpecConfig, for every method (``decoder`` is a
    SpecDecoder):

    - chains from a model (draft_model, layer_skip, early_exit) draft together: one
      ``BatchedDraftModel`` per drafting model (the draft model, or one layer view of the target per
      kept-layer set), each a batched KV cache over the shared weights;
    - token trees from a model (``tree`` static / dynamic) get a per-row ``DraftTreeDrafter`` with its
      own KV cache over the same shared weights (a new HFModel wrapper: the weights are not copied);
    - model-free drafters (prompt_lookup, suffix, token_recycling, lookahead) and plain are made by
      the decoder exactly as at batch size 1 (per-row state; Token Recycling's table stays shared);
    - trained heads (medusa, eagle; chains and trees) likewise: a per-row drafter (its own feature
      state, EAGLE its own head KV cache) over the decoder's loaded head, fed its own rows of the
      target's features.
    """

    def __init__(self, decoder):
        self.decoder = decoder
        self.groups: dict[int, BatchedDraftModel] = {}

    def reset(self) -> None:
        """Forget the batched draft caches (after a failed step the batch starts over)."""
        self.groups = {}

    def model_for(self, spec) -> HFModel | None:
        dec = self.decoder
        if spec.method == "draft_model":
            if dec.draft is None:
                raise ConfigError("method 'draft_model' needs a draft model (pass draft=NAME / --draft NAME)")
            return dec.draft
        if spec.method in ("layer_skip", "early_exit"):
            return dec.self_draft(spec)
        return None

    def make(self, spec):
        from .config import SpecConfig
        from .drafters.draft_tree import DraftTreeDrafter

        spec = SpecConfig.from_dict(spec)
        m = self.model_for(spec)
        if m is None:
            return self.decoder.make_drafter(spec)
        vocab = self.decoder.target.vocab_size
        if spec.tree == "chain":
            g = self.groups.get(id(m.model))
            if g is None:
                g = self.groups[id(m.model)] = BatchedDraftModel(HFModel(m.model, m.tokenizer, name=m.name), vocab)
            drafter = GroupDraft(g, spec)
        else:
            drafter = DraftTreeDrafter(HFModel(m.model, m.tokenizer, name=m.name), spec, vocab)
        drafter.lossy = spec.lossy_rule()  # as SpecDecoder.make_drafter does
        return drafter
