"""Graceful shutdown: the first SIGTERM (or Ctrl-C) stops admitting (new requests get a 503, /health
says "draining"), lets admitted requests finish for up to ``drain_s`` seconds, cancels what is still
running after that (its clients get what a cancellation gives them), then stops uvicorn and exits 0.
A second signal stops at once."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

log = logging.getLogger("specdraft.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_s: float):
        super().__init__(config)
        self.drain_s = drain_s
        self.draining = threading.Event()

    def handle_exit(self, sig, frame) -> None:
        # uvicorn's own handler records the signal and raises it again after shutting down, which would
        # end the process with 128 + SIGTERM; a drained shutdown is a normal exit (0)
        if self.draining.is_set():
            self.force_exit = self.should_exit = True
            return
        self.draining.set()
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        app = self.config.app
        app.state.draining = True
        worker = app.state.worker
        end = time.monotonic() + self.drain_s
        while time.monotonic() < end and any(worker.stats().values()):
            time.sleep(0.05)
        left = worker.stats()
        if any(left.values()):
            log.warning(
                "shutdown: cancelling %d running and %d waiting request(s) after %.0f s",
                left["running"],
                left["waiting"],
                self.drain_s,
            )
        worker.stop()
        self.should_exit = True


def serve(app, host: str, port: int, log_level: str, drain_s: float) -> None:
    GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), drain_s).run()
