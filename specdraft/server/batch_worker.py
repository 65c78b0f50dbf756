"""The server's one worker, continuous batching: waiting requests join the running batch between steps
(up to ``max_batch`` rows), every step decodes all rows together (specdraft.engine.Engine), and
finished or cancelled rows leave at once, freeing their KV slots. ``max_batch`` 1 is one request at a
time (kind "single"): the batch-1 loop, without the batch rule."""

from __future__ import annotations

import time

from ..core.config import SPEC_OFF_AT, SPEC_SHRINK_AT
from ..core.errors import SpecDraftError
from ..core.policy import BatchRule
from ..engine import Job, StepHook
from .scheduler import BaseWorker, log, prepare


class BatchWorker(BaseWorker):
    kind = "batch"

    def __init__(
        self,
        decoder,
        metrics,
        max_queue: int,
        max_batch: int = 16,
        spec_shrink_at: int = SPEC_SHRINK_AT,
        spec_off_at: int = SPEC_OFF_AT,
    ):
        super().__init__(decoder, metrics, max_queue)
        self.max_batch = max_batch
        if max_batch == 1:  # one request at a time: no batch to shrink drafts for (/health says "single")
            self.kind, rule = "single", None
        else:
            rule = BatchRule(spec_shrink_at, spec_off_at)
        self.engine = decoder.new_engine(rule=rule)
        self._n_rows = 0
        self._taken: list = []  # jobs the loop took from the queue and has not admitted yet
        self.hook = getattr(decoder, "learner", None) or StepHook()  # the online learner swaps weights between steps

    def num_running(self) -> int:
        return self._n_rows

    def state(self) -> dict:
        eng = self.engine  # read without the lock: a snapshot for monitoring
        return {"batch_rows": eng.num_rows, "cache_len": eng.cache_len, "draft_groups": len(eng.groups)}

    def _cancel_running(self, reason):
        for row in list(self.engine.rows):
            row.tag.cancel(reason)

    def _admit(self, jobs) -> None:
        """Admit jobs together: one batched prefill."""
        m = self.metrics

        def wrap(job):
            def on_emit(new, logprobs=None):
                if job.t_first is None:
                    m.ttft.observe(time.monotonic() - job.t_arrive)
                return job.on_emit(new, logprobs)

            return on_emit

        items: list[Job] = []  # tagged by the server's job
        for job in jobs:
            try:
                items.append(
                    prepare(
                        self.decoder,
                        job.prompt_ids,
                        job.sampling,
                        job.spec,
                        on_emit=wrap(job),
                        tag=job,
                        processor=job.processor,
                        partition=job.partition,
                    )
                )
            except Exception as e:  # this request's own drafter: it fails alone (a bug logs and answers 500)
                if not isinstance(e, SpecDraftError):
                    log.exception("making the drafter of request %s failed", job.id)
                job.fail(e)
        if not items:
            return
        try:
            out = self.engine.add_many(items)
        except Exception as e:
            log.exception("admitting %d request(s) failed", len(items))
            for it in items:
                it.tag.fail(e)
            return
        for it, r in zip(items, out):
            if isinstance(r, Exception):
                it.tag.fail(r)
            else:
                it.tag.admitted(r)

    def _reset(self, err: Exception) -> None:
        """Fail every running request with ``err`` and start over with an empty batch."""
        for row in list(self.engine.rows):
            row.tag.fail(err)
        self.engine = self.decoder.new_engine(rule=self.engine.rule)
        with self.cv:
            self._n_rows = 0
            self._update_gauges()

    def _recover(self):
        err = RuntimeError("the batch worker failed while running this request")
        for job in self._taken:  # taken from the queue, not yet admitted: no row holds them
            job.fail(err)
        self._taken = []
        self._reset(err)

    def _loop(self):
        eng = self.engine
        while True:
            jobs = self._taken = []
            while eng.num_rows + len(jobs) < self.max_batch:
                job = self._take(block=eng.num_rows == 0 and not jobs)
                if job is None:
                    break
                jobs.append(job)
            if jobs:
                self.busy_since = time.monotonic()  # admission is work too (drafters made, prompts prefilled)
                try:
                    self._admit(jobs)
                finally:
                    self.busy_since = None
            self._taken = []
            with self.cv:
                self._n_rows = eng.num_rows
                self._update_gauges()
                if self._stop and not eng.rows:
                    return
            if not eng.rows:
                continue
            # rows whose request was cancelled while waiting for this step leave before it
            for row in [r for r in eng.rows if r.tag.cancelled.is_set()]:
                eng.cancel(row)
                self.metrics.observe_result(row.result.stats)
                row.tag.finish(row.result)
            if not eng.rows:  # all cancelled: the gauges must say so before the loop blocks for new jobs
                with self.cv:  # (found by the soak test: /health kept reporting a cancelled row as running)
                    self._n_rows = 0
                    self._update_gauges()
                continue
            try:
                t0 = time.perf_counter()
                self.busy_since = time.monotonic()
                with self.hook.stepping():
                    finished = eng.step()
                self.metrics.step_latency.observe(time.perf_counter() - t0)
            except Exception as e:  # a bug in the shared work: fail every running request, start over
                log.exception("batch step failed")
                self._reset(e)
                eng = self.engine
                continue
            finally:
                self.busy_since = None
            for row in finished:
                if row.error is not None:  # this request's own work failed; the other rows decode on
                    log.error("request %s failed", row.tag.id, exc_info=row.error)
                    row.tag.fail(row.error)
                    continue
                self.metrics.observe_result(row.result.stats)
                row.tag.finish(row.result)
            self.hook.after_step(eng.rows, finished)
            with self.cv:
                self._n_rows = eng.num_rows
                self._update_gauges()
