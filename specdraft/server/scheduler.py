"""The scheduler's common part: run admitted requests on the engine, off the event loop.

The worker is ``BatchWorker`` (batch_worker.py): up to ``max_batch`` rows decoded together through the
engine's one loop (specdraft.engine); ``max_batch`` 1 runs one request at a time (the batch-1 engine).
``BaseWorker`` holds what does not depend on the rows:

- a bounded wait list: ``submit`` raises QueueFull when ``max_queue`` requests already wait;
- ``ServedRequest``: what a request carries to the worker and how tokens come back (``post`` puts events on
  the request's asyncio queue from the worker thread); ``ServedRequest.cancel`` (client disconnect or
  timeout) makes the engine's ``on_emit`` return True, so the row finishes "cancelled" at the next
  step and its state is freed; a job still waiting is removed from the wait list at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque

from ..core.errors import SpecDraftError

log = logging.getLogger("specdraft.server")


class QueueFull(Exception):
    pass


def prepare(decoder, prompt_ids, sampling, spec, **kw):
    """The request as the engine takes it (``SpecDecoder.prepare``); what its spec asks that this decoder cannot
    make (an unknown auto arm, a datastore that does not load) is a 400 naming the spec field."""
    from .protocol import RequestError, spec_param

    try:
        return decoder.prepare(prompt_ids, sampling, spec, **kw)
    except RequestError:
        raise
    except SpecDraftError as e:
        raise RequestError(f"spec: {e}", param=spec_param(str(e))) from None


def shutdown_error():
    from .protocol import RequestError

    return RequestError(
        "the server shut down before this request finished; retry on another replica",
        status=503,
        type="server_error",
        code="shutting_down",
    )


class ServedRequest:
    def __init__(
        self,
        prompt_ids,
        sampling,
        spec,
        timeout_s: float | None,
        loop: asyncio.AbstractEventLoop | None,
        processor=None,
    ):
        self.id = uuid.uuid4().hex[:12]
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.spec = spec
        self.processor = processor  # compiled when the request was parsed (protocol.parse_request)
        self.partition = None  # whose cached prefixes it may use: (API key, cache_salt) (core/prefix_cache.py)
        self.t_arrive = time.monotonic()
        self.deadline = None if not timeout_s else self.t_arrive + timeout_s
        self.t_first: float | None = None
        self.loop = loop
        self.events: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self.cancelled = threading.Event()
        self.cancel_reason: str | None = None
        self.done = threading.Event()
        self.result = None
        self._last_emit = None
        self.steps: list | None = None  # the row's StepRecords (engine), once admitted: each step's is posted
        self.learn = True  # whether the online learner may learn from this request (server/learning.py)

    def admitted(self, row) -> None:
        self.steps = row.stats.steps

    def post(self, kind: str, payload=None) -> None:
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancelled.set()

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def on_emit(self, new, logprobs: list | None = None) -> bool:
        """The engine's per-step callback: stream the tokens (and their logprob entries, when the request
        asked for them); True cancels the request."""
        if self.t_first is None:
            self.t_first = time.monotonic()
        if new:
            step = self.steps[-1] if self.steps else None
            self.post("tokens", ([int(t) for t in new], logprobs, step))
        if self.expired():
            self.cancel("timeout")
        return self.cancelled.is_set()

    def finish(self, result) -> None:
        self.result = result
        self.done.set()
        self.post("done", result)

    def fail(self, err: Exception) -> None:
        self.done.set()
        self.post("error", err)


class BaseWorker:
    def __init__(self, decoder, metrics, max_queue: int):
        self.decoder = decoder
        self.metrics = metrics
        self.max_queue = max_queue
        self.waiting: deque[ServedRequest] = deque()
        self.cv = threading.Condition()
        self._stop = False
        self.busy_since: float | None = None  # monotonic time the current step (or request) began, None: idle
        self.restarts = 0  # loops restarted after an exception escaped them
        self._thread = threading.Thread(target=self._supervise, name=type(self).__name__, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0):
        with self.cv:
            self._stop = True
            for j in self.waiting:
                j.cancel("shutdown")
                j.fail(shutdown_error())
            self.waiting.clear()
            self.cv.notify_all()
        self._cancel_running("shutdown")
        self._thread.join(timeout)

    def _supervise(self) -> None:
        """The thread's body: the loop, restarted after anything that escapes it (the rows it held are
        failed by ``_recover``), so no request can stop the worker for good."""
        while True:
            try:
                self._loop()
                return
            except Exception:
                log.exception("the %s worker's loop failed; its running requests fail, the loop restarts", self.kind)
                self.restarts += 1
                self.busy_since = None
                try:
                    self._recover()
                except Exception:
                    log.exception("recovering the worker failed")

    def health(self, stuck_after_s: float) -> str:
        """ "ok", "dead" (the thread ended while the server runs) or "stuck" (one step has run for more than
        ``stuck_after_s``), for /health."""
        if not self._thread.is_alive() and not self._stop:
            return "dead"
        t = self.busy_since
        if t is not None and time.monotonic() - t > stuck_after_s:
            return "stuck"
        return "ok"

    def _update_gauges(self):
        self.metrics.queue_depth.set(len(self.waiting))
        self.metrics.running.set(self.num_running())

    def submit(self, job: ServedRequest) -> None:
        with self.cv:
            if self._stop:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self.waiting.append(job)
            self._update_gauges()
            self.cv.notify_all()

    def cancel(self, job: ServedRequest, reason: str) -> None:
        job.cancel(reason)
        with self.cv:
            if job in self.waiting:
                self.waiting.remove(job)
                self._update_gauges()

    def _take(self, block: bool) -> ServedRequest | None:
        """Pop the next live waiting job (None when nothing waits and not blocking, or stopping)."""
        with self.cv:
            while True:
                while self.waiting:
                    job = self.waiting.popleft()
                    self._update_gauges()
                    if job.cancelled.is_set():
                        continue
                    if job.expired():
                        job.cancel("timeout")
                        continue
                    return job
                if self._stop or not block:
                    return None
                self.cv.wait(0.5)

    def stats(self) -> dict:
        with self.cv:
            return {"waiting": len(self.waiting), "running": self.num_running()}

    def state(self) -> dict:
        """What the decoding side holds (for /health and soak checks): nothing beyond stats here."""
        return {}

    # subclass API
    def num_running(self) -> int: ...

    def _cancel_running(self, reason: str) -> None: ...

    def _recover(self) -> None:
        """After the loop failed: fail what it was running, so that it can start over."""

    def _loop(self) -> None: ...
