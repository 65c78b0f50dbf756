"""The training process: spawned by the serving process (``learner.Learner``), it takes served sequences
into its replay buffer, trains a float32 copy of the head, and every ``publish_every`` optimizer steps
sends the weights as an update; it waits for the server's verdict on an update before sending the next,
writes a kept one to the adapted store and goes back to the weights before a rolled back one.

Its cost is bounded twice:

- its threads run at nice 19 (after its start), so the serving engine gets a core whenever it has work:
  the kernel preempts the learner within its scheduling tick, inside any engine step (nice 19 weighs 15
  against nice 0's 1024). ``OMP_WAIT_POLICY=PASSIVE`` (set by the parent) keeps its OpenMP threads from
  spinning on a core while they wait. SCHED_IDLE would yield even more, but on a machine that other
  processes keep busy it starved the learner outright: no optimizer step in a minute of a test;
- it paces itself: after each piece of work it sleeps until its CPU seconds are at most ``budget`` of
  the machine's CPU seconds since the work began (``Pacer``).

It trains each served token about ``reuse`` times, then waits for more traffic."""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from dataclasses import dataclass

from .config import LearnConfig
from .wire import Failed, Progress, ServedSequence, Stop, Verdict, Weights, WireTensor

IDLE_POLL_S = 0.2  # how often a waiting process looks at its queues


@dataclass
class ProcessSetup:
    shape: object  # models.eagle3.Eagle3Shape
    state: dict[str, WireTensor]  # the served head's state dict
    cfg: LearnConfig
    served_dtype: str  # the update's dtype: the served head's
    store_root: str | None  # the adapted store (None: updates are not kept on disk)
    store_meta: dict  # the saved head's ``specdraft`` section
    threads: int
    cpus: int
    parent_pid: int  # the serving process: when it is gone, so is this one


@dataclass
class Published:
    """The update on trial: its version and the weights it sent (float32), kept until the server's verdict."""

    version: int
    weights: dict


class Pacer:
    """Sleeps after each piece of work so that the process's CPU seconds stay within ``share`` of the
    machine's (``cpus`` x wall seconds); reports the share used since it started."""

    def __init__(self, share: float, cpus: int):
        self.rate, self.cpus = share * cpus, cpus
        self.t0, self.c0 = time.monotonic(), time.process_time()

    @contextlib.contextmanager
    def work(self):
        c, w = time.process_time(), time.monotonic()
        yield
        rest = (time.process_time() - c) / self.rate - (time.monotonic() - w)
        if rest > 0:
            time.sleep(rest)

    def share(self) -> float:
        wall = time.monotonic() - self.t0
        return (time.process_time() - self.c0) / (wall * self.cpus) if wall > 0 else 0.0


def lower_priority() -> None:
    """nice 19 for every thread of this process; threads made later inherit it (Linux keeps it per thread)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, 19)


def main(setup: ProcessSetup, data: "queue.Queue", control: "queue.Queue", out: "queue.Queue") -> None:
    try:
        import torch

        torch.set_num_threads(setup.threads)
        loop = _Loop(setup, data, control, out)
        lower_priority()  # after its start (a copy of the head, once), which a niced process on a busy machine
        loop.run()  # would stretch to minutes
    except Exception as e:  # noqa: BLE001 - whatever it is, the server must hear of it and serve on
        last = traceback.format_exc().strip().splitlines()[-1]
        out.put(Failed(f"{type(e).__name__}: {e}" if str(e) else last))


class _Loop:
    def __init__(self, setup: ProcessSetup, data, control, out):
        import torch

        from .trainer import HeadTrainer

        self.setup, self.data, self.control, self.out = setup, data, control, out
        self.cfg = setup.cfg
        self.trainer = HeadTrainer(setup.shape, {k: t.tensor() for k, t in setup.state.items()}, setup.cfg)
        self.dtype = getattr(torch, setup.served_dtype)
        self.pacer = Pacer(setup.cfg.budget, setup.cpus)
        self.good = self.trainer.snapshot()  # the weights the server holds as kept
        self.published: Published | None = None
        self.version = self.since_publish = 0
        self.received_tokens = self.trained_tokens = 0
        self.progress = Progress()
        self.stopped = self.changed = False

    def run(self) -> None:
        while not self.stopped and os.getppid() == self.setup.parent_pid:
            self._take_messages(block=not self._may_train())
            if self.stopped:
                return
            if self._may_train():
                with self.pacer.work():
                    self._train_step()
                self._maybe_publish()
            if self.changed:
                self._report()

    def _may_train(self) -> bool:
        waiting = self.published is not None and self.since_publish >= self.cfg.publish_every
        fresh = self.trained_tokens < self.cfg.reuse * self.received_tokens
        return self.trainer.ready() and fresh and not waiting

    def _take_messages(self, block: bool) -> None:
        for q in (self.control, self.data):
            while True:
                try:
                    msg = q.get(timeout=IDLE_POLL_S) if block and q is self.control else q.get_nowait()
                except queue.Empty:
                    break
                block = False
                self.changed = True
                self._handle(msg)
                if self.stopped:
                    return

    def _handle(self, msg) -> None:
        if isinstance(msg, Stop):
            self.stopped = True
        elif isinstance(msg, ServedSequence):
            self.trainer.buffer.add(msg)
            self.received_tokens += msg.n_tokens - msg.n_prompt
            self.progress.received += 1
        elif isinstance(msg, Verdict) and self.published is not None and msg.version == self.published.version:
            snap = self.published.weights
            self.published, self.since_publish = None, 0
            if msg.keep:
                self.good = snap
                with self.pacer.work():
                    self._save(msg.version, snap)
            else:
                self.trainer.restore(self.good)

    def _train_step(self) -> None:
        r = self.trainer.step()
        p = self.progress
        p.steps, p.loss, p.accuracy = self.trainer.steps, round(r.loss, 4), [round(a, 3) for a in r.accuracy]
        self.trained_tokens += r.tokens
        self.since_publish += 1
        self.changed = True

    def _maybe_publish(self) -> None:
        if self.published is not None or self.since_publish < self.cfg.publish_every:
            return
        self.version += 1
        self.published = Published(self.version, self.trainer.snapshot())
        self.since_publish = 0
        self.out.put(Weights(self.version, self.trainer.weights(self.dtype)))

    def _save(self, version: int, snap: dict) -> None:
        if self.setup.store_root is None:
            return
        from pathlib import Path

        from .store import AdaptedStore

        meta = {
            **self.setup.store_meta,
            "learner_update": version,
            "optimizer_steps": self.trainer.steps,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        try:
            path = AdaptedStore(Path(self.setup.store_root)).save(
                self.setup.shape, self.trainer.state(snap), meta, self.dtype
            )
        except OSError as e:
            self.progress.warning = f"the adapted head was not saved: {e}"
            return
        self.progress.saved_version, self.progress.saved_path = version, str(path)

    def _report(self) -> None:
        self.changed = False
        p, b = self.progress, self.trainer.buffer
        p.buffer_tokens, p.buffer_sequences, p.busy_share = b.n_tokens, len(b), round(self.pacer.share(), 4)
        self.out.put(Progress(**vars(p)))
