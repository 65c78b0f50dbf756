"""Test helpers for servers: one on 127.0.0.1 in a thread (specdraft.server.local), waiting, /health."""

from __future__ import annotations

import time

import httpx

from specdraft.server.local import free_port, serve_in_thread as running_server  # noqa: F401


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
