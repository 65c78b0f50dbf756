"""A specdraft server on 127.0.0.1 (a free port) in a thread of this process: for the tests and for
measurements that drive a server from the same process (``specdraft leak``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@contextlib.contextmanager
def serve_in_thread(decoder, **kw):
    """Yields (base URL, app); ``kw`` are app.ServerSettings' fields (default: model "smol", prompt_lookup)."""
    from .app import ServerSettings, create_app

    kw.setdefault("model_name", "smol")
    kw.setdefault("default_spec", {"method": "prompt_lookup"})
    app = create_app(decoder, ServerSettings(**kw))
    with app_in_thread(app) as url:
        yield url, app


@contextlib.contextmanager
def app_in_thread(app):
    """Serves any ASGI ``app`` on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.time()
    while not srv.started:
        if time.time() - t0 > 30 or not th.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(30)
