"""Start a specdraft server on 127.0.0.1 (a random free port) in a thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def running_server(decoder, **kw):
    import uvicorn

    from specdraft.server import create_app

    kw.setdefault("model_name", "smol")
    kw.setdefault("default_spec", {"method": "prompt_lookup"})
    app = create_app(decoder, **kw)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.time()
    while not srv.started:
        if time.time() - t0 > 30 or not th.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, app
    finally:
        srv.should_exit = True
        th.join(30)


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
