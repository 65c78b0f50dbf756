"""Test helpers for servers: one on 127.0.0.1 in a thread (specdraft.server.local), waiting, /health."""

from __future__ import annotations

import time

import httpx

# Re-exported: the server tests import these two from here.
from specdraft.server.local import free_port  # noqa: F401
from specdraft.server.local import serve_in_thread as running_server  # noqa: F401


def wait_until(pred, timeout=60.0, every=0.05):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def health(url):
    return httpx.get(url + "/health", timeout=10).json()


REQUEST_COUNTS = {"specdraft_requests_total", "specdraft_requests_created"}  # counted when the answer has left


def metric_samples(text: str) -> dict:
    """A Prometheus exposition as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
