"""The serving side of online learning (package doc): one ``Learner`` per ``SpecDecoder`` that learns.

It binds to the first EAGLE-3 head the decoder loads (``adopt``): the head continues from its adapted
version when one is kept (store.py), and the training process starts. The engine's loop holds each step
inside ``stepping()`` and calls ``after_step`` between steps (engine.StepHook). There the learner:

- counts the acceptance of the head's steps;
- hands finished requests to the training process, and their outputs to the suffix drafters' store;
- judges the update on trial (``guard.AcceptanceGuard``): kept, or rolled back;
- swaps a new update in. Each parameter takes the update's tensor as it is, so the pause between two steps
  is microseconds (copying a 44M-parameter head took 150-230 ms on a busy 2-core CPU); the tensors it
  replaced are what a rollback puts back.

Swaps happen only while no step runs (``_swap`` refuses otherwise), so every step drafts with one set of
weights; a drafter's cache made with older weights is rebuilt (``head.version``, drafters/eagle.py).
Decoding stays lossless whatever the weights: the drafter only proposes, and the target verifies."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import weakref
from dataclasses import dataclass, field

import torch

from ..core.device import HOST
from ..drafters.datastore import ServedOutputs
from ..drafters.eagle3 import Eagle3Drafter
from ..engine import StepHook
from .config import LearnConfig
from .guard import AcceptanceGuard
from .wire import Failed, Progress, ServedSequence, Stop, Verdict, Weights, WireTensor

log = logging.getLogger("specdraft.learning")


@dataclass
class LearnStatus:
    """A snapshot for /health, /metrics and the playground."""

    state: str  # "waiting for an EAGLE-3 head", "learning", "failed: ...", "stopped"
    head: str | None = None
    adapted: str | None = None  # the kept version this server started from or saved last
    updates: int = 0  # updates copied into the head
    kept: int = 0
    rollbacks: int = 0
    on_trial: bool = False
    served_tokens: int = 0  # in the store of recent outputs the suffix drafters search
    sent: int = 0  # served sequences handed to the training process
    dropped: int = 0  # not handed over: its queue was full
    acceptance: float | None = None  # the latest window's
    acceptance_before: float | None = None  # the window before the update on trial
    curve: list = field(default_factory=list)  # [(unix time, acceptance)], a point per window
    progress: Progress = field(default_factory=Progress)


def head_drafter(drafter, head):
    """The EAGLE-3 drafter on ``head`` inside ``drafter`` (itself, or a part of a composite such as auto), or None."""
    if isinstance(drafter, Eagle3Drafter):
        return drafter if drafter.head is head else None
    return next((d for p in getattr(drafter, "parts", ()) if (d := head_drafter(p, head)) is not None), None)


def head_arms(drafter, head) -> set[str] | None:
    """The names of auto's arms that draft with ``head`` (a step counts when one of them drafted it); None:
    ``drafter`` drafts with it every step."""
    arms = getattr(drafter, "arms", None)
    if arms is None:
        return None
    return {a.name for a in arms if head_drafter(a.drafter, head) is not None}


@dataclass
class Update:
    """Weights from the training process, waiting for a pause between steps."""

    version: int
    tensors: dict[str, torch.Tensor]


@dataclass
class _Watch:
    """A row that drafts with the head: its steps counted so far and which of them are the head's."""

    arms: set[str] | None
    seen: int = 0


class Learner(StepHook):
    """``home``: the models' home the adapted store lives under (None: $SPECDRAFT_HOME). ``spawn`` False: no
    training process (tests hand updates over themselves)."""

    def __init__(self, target, cfg: LearnConfig, home=None, spawn: bool = True):
        self.target, self.cfg, self.home, self.spawn = target, cfg, home, spawn
        self.head = self.head_path = self.store = None
        self.guard = AcceptanceGuard(cfg.window, cfg.max_drop)
        self._status = LearnStatus("waiting for an EAGLE-3 head")
        self._lock = threading.Lock()
        self._stepping = 0
        self._pending: Update | None = None
        self._before: dict[str, torch.Tensor] | None = None  # the weights before the update on trial
        self._rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.served = ServedOutputs(cfg.served_tokens) if cfg.served_tokens else None  # for the suffix drafters
        self._proc = self._data = self._control = self._out = None

    # --- binding ----------------------------------------------------------------------------------
    def adopt(self, head, head_path: str) -> None:
        """A head the decoder loaded: the first EAGLE-3 one is learned (module doc); others are served as shipped.
        The learner binds to it only once all went well (an adapted head that does not load is an error
        for this load, and the next load tries again)."""
        if self.head is not None:
            if head is not self.head:
                log.warning(
                    "learn: the head %s is served as shipped (this server learns %s)", head_path, self.head_path
                )
            return
        from .store import AdaptedStore, adapted_root, head_fingerprint, store_name

        fp = head_fingerprint(head_path)
        store = AdaptedStore(adapted_root(self.home) / store_name(self.target.name, fp)) if self.cfg.persist else None
        adapted = self._adapted_state(store, head, head_path)
        self.head, self.head_path, self.store = head, str(head_path), store
        head.version = 0
        if adapted is not None:
            self._take(adapted)  # no drafter holds the head yet
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of the serving process's state
        self._data, self._control, self._out = ctx.Queue(self.cfg.queue), ctx.Queue(), ctx.Queue()
        for q in (self._data, self._control):  # what the process never read is dropped at exit, not waited for
            q.cancel_join_thread()
        if self.spawn:
            self._start_process(
                ctx,
                {**getattr(head, "meta", {}), "type": "eagle3", "adapted_from": self.head_path, "shipped_sha256": fp},
            )
        self._status.head = self.head_path
        self._status.state = "learning"  # last: the loop's after_step acts on the head from now on

    def drafts_with_head(self, drafter) -> bool:
        """Whether ``drafter`` (or a part of it) drafts with the head this learner changes."""
        return self.head is not None and head_drafter(drafter, self.head) is not None

    def _adapted_state(self, store, head, head_path) -> dict[str, torch.Tensor] | None:
        """The kept version's weights for ``head`` (logged in one line), or None."""
        ck = store.load(self.target.facts.num_layers) if store is not None else None
        if ck is None:
            return None
        if ck.shape != head.shape:
            log.warning(
                "learn: the adapted head %s has another shape than %s; starting from the shipped head",
                store.current(),
                head_path,
            )
            return None
        self._status.adapted = str(store.current())
        log.warning(
            "learn: continuing from the adapted head %s (`specdraft heads reset` returns to the shipped head %s)",
            self._status.adapted,
            head_path,
        )
        return {k: ck.state[k] for k, _ in head.named_parameters()}

    def _start_process(self, ctx, meta: dict) -> None:
        from . import process

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        state = {k: WireTensor.of(v) for k, v in self.head.state_dict().items()}
        setup = process.ProcessSetup(
            shape=self.head.shape,
            state=state,
            cfg=self.cfg,
            served_dtype=str(self._dtype()).replace("torch.", ""),
            store_root=None if self.store is None else str(self.store.root),
            store_meta=meta,
            threads=max(1, round(self.cfg.budget * cpus)),
            cpus=cpus,
            parent_pid=os.getpid(),
        )
        self._proc = ctx.Process(
            target=process.main,
            args=(setup, self._data, self._control, self._out),
            name="specdraft-learner",
            daemon=True,
        )
        with _environ(OMP_WAIT_POLICY="PASSIVE"), _main_hidden():  # OpenMP reads it when the child's starts
            self._proc.start()
        threading.Thread(target=self._read, args=(self._proc,), name="specdraft-learner-reader", daemon=True).start()

    def _dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    def _read(self, proc) -> None:
        """The training process's messages (a thread): updates wait in ``_pending`` for the loop's next pause."""
        while self._proc is proc:
            try:
                msg = self._out.get(timeout=1.0)
            except queue.Empty:
                if proc.is_alive() or self._proc is not proc:
                    continue
                msg = Failed(f"the training process ended (exit code {proc.exitcode})")
            except (EOFError, OSError):
                return
            if isinstance(msg, Weights):
                update = Update(msg.version, {k: t.tensor() for k, t in msg.state.items()})
                with self._lock:
                    self._pending = update
            elif isinstance(msg, Progress):
                self._status.progress = msg
            elif isinstance(msg, Failed):
                self._fail(msg.message)
                return

    def _fail(self, why: str) -> None:
        if self._status.state == "learning":
            log.error("learn: stopped learning (%s); the head serves as it is", why)
            self._status.state = f"failed: {why}"

    # --- the engine's hook --------------------------------------------------------------------------
    @contextlib.contextmanager
    def stepping(self):
        with self._lock:
            self._stepping += 1
        try:
            yield
        finally:
            with self._lock:
                self._stepping -= 1

    def after_step(self, rows: list, finished: list) -> None:
        try:
            taught = [r for r in finished if r.error is None and getattr(r.tag, "learn", True)]
            if self.served is not None:
                for row in taught:
                    self.served.add(row.output)
            if self.head is None or self._status.state != "learning":
                return
            for row in list(rows) + list(finished):
                self._count(row)
            for row in taught:
                self._hand_over(row)
            for row in finished:
                self._rows.pop(row, None)
            with self._lock:
                if self._stepping == 0:  # another thread's step runs (library use): next time
                    self._judge()
                    self._try_pending()
        except Exception as e:  # noqa: BLE001 - learning must never take serving down
            log.exception("learn: between steps")
            self._fail(f"{type(e).__name__}: {e}")

    def _watch(self, row) -> _Watch | None:
        w = self._rows.get(row)
        if w is None and row not in self._rows:
            w = _Watch(head_arms(row.drafter, self.head)) if head_drafter(row.drafter, self.head) else None
            self._rows[row] = w
        return w

    def _count(self, row) -> None:
        w = self._watch(row)
        if w is None:
            return
        steps = row.stats.steps
        for st in steps[w.seen :]:
            if w.arms is None or (st.arm or "").split("/")[0] in w.arms:
                self.guard.observe(st.drafted, st.accepted)
        w.seen = len(steps)

    def _hand_over(self, row) -> None:
        """A finished row's sequence to the training process."""
        d = head_drafter(row.drafter, self.head)
        seq = (
            None
            if d is None
            else served_sequence(row.tokens, len(row.prompt_ids), d.feats, self.target, self.cfg.max_len)
        )
        if seq is None:
            return
        try:
            self._data.put_nowait(seq)
            self._status.sent += 1
        except queue.Full:
            self._status.dropped += 1

    # --- updates (with the lock held, no step running) ---------------------------------------------
    def _params(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.head.named_parameters())

    def _swap(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's weights replaced by ``state``'s tensors (module doc); only ever between steps. -> the
        tensors replaced."""
        if self._stepping:
            raise RuntimeError("the head's weights may change only between engine steps")
        return self._take(state)

    def _take(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        old = {}
        for k, p in self._params().items():
            t = state[k]
            if t.shape != p.shape:
                raise ValueError(f"the update's {k} has shape {tuple(t.shape)}; the head's is {tuple(p.shape)}")
            old[k], p.data = p.data, t.to(device=p.device, dtype=p.dtype)  # (trained on the CPU; the head may not be)
        self.head.version += 1
        return old

    def _try_pending(self) -> None:
        if self._pending is None or not self.guard.can_try():
            return
        update, self._pending = self._pending, None
        self._before = self._swap(update.tensors)
        self.guard.start(update.version)
        self._status.updates += 1

    def _judge(self) -> None:
        v = self.guard.verdict()
        if v is None:
            return
        version, keep = v
        if keep:
            self._status.kept += 1
        else:
            self._swap(self._before)
            self._status.rollbacks += 1
            log.warning(
                "learn: update %d rolled back (acceptance %.3f after it, %.3f before)",
                version,
                self.guard.last_after,
                self.guard.last_before,
            )
        self._before = None
        self._control.put(Verdict(version, keep))

    # --- what it shows ------------------------------------------------------------------------------
    def status(self) -> LearnStatus:
        s = self._status
        t = self.guard.trial
        s.on_trial, s.acceptance_before = t is not None, None if t is None else round(t.before, 4)
        rate = self.guard.recent.rate
        s.acceptance = None if rate is None else round(rate, 4)
        s.curve = list(self.guard.curve)
        s.served_tokens = 0 if self.served is None else self.served.n_tokens
        if s.progress.saved_path:
            s.adapted = s.progress.saved_path
        return dataclasses.replace(s)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the training process (it finishes what it writes first)."""
        if self._proc is None:
            return
        if self._status.state == "learning":
            self._status.state = "stopped"
        with contextlib.suppress(Exception):
            self._control.put(Stop())
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        self._proc = None


def served_sequence(
    tokens: list[int], n_prompt: int, feats: torch.Tensor, target, max_len: int
) -> ServedSequence | None:
    """What a finished request teaches (wire.ServedSequence), cut to its last ``max_len`` tokens; None when it
    holds no answer to learn or its drafter never saw its features (cancelled before its first step)."""
    n = len(tokens)
    if n - n_prompt < 2 or feats.shape[0] < n - 1:
        return None
    start = max(0, n - max_len)
    ids = torch.tensor(tokens[start:], dtype=torch.long, device=HOST)
    with torch.inference_mode():
        embeds = target.embed(ids)
    return ServedSequence(
        ids.numpy().copy(), max(0, n_prompt - start), WireTensor.of(feats[start : n - 1]), WireTensor.of(embeds)
    )


@contextlib.contextmanager
def _main_hidden():
    """While a process is spawned: the caller's main script is not named to it. The training process needs
    nothing from it, and spawn would otherwise import it again in the child, which runs a script written
    without an ``if __name__ == "__main__"`` guard a second time."""
    import sys

    main = sys.modules.get("__main__")
    saved = {k: main.__dict__.pop(k) for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    if main is not None:
        main.__spec__ = None
    try:
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


@contextlib.contextmanager
def _environ(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
