"""The routing front of ``specdraft serve --replicas N``: one OpenAI-compatible endpoint before N engine
replicas (started on Ray by server/replicas.py; each the same FastAPI app as a single server).

The front (this module's app, in the ``serve`` process) sends each request to the replica with the fewest
running requests and relays the response bytes as they arrive, so a stream stays on its replica from the
first byte to ``[DONE]``. Requests are parsed and checked by the replica: its errors reach the client
unchanged. /metrics merges every replica's metrics with a ``replica`` label; /health lists the replicas."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .app import (
    API_ROUTES,
    LOOPBACK_HOSTS,
    MAX_BODY_BYTES,
    add_playground,
    drain_check,
    health_details,
    key_check,
    origin_check,
    read_body,
)
from .learning import api_keys
from .protocol import RequestError

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


class _Routed:
    """A history the front sent to a replica (a prefix cache entry without keys and values)."""

    def __init__(self, n: int, replica: int):
        self.n, self.nbytes, self.replica = n, 8 * n, replica  # (held as int64 tokens)


class Router:
    """Picks a replica for each request: the one that served the longest prefix of its history (its prefix
    cache holds it) unless that one is busier than the least busy by more than ``SLACK`` requests; else the
    fewest running (ties: round robin). Counts per replica."""

    SLACK = 1
    MIN_SHARED = 64  # bytes of history in common that make a replica worth choosing (a system prompt or more)

    def __init__(self, urls: list[str], history_bytes: int = 64 << 20):
        from ..core.prefix_cache import PrefixCache

        self.urls = urls
        self.running = [0] * len(urls)
        self.routed = [0] * len(urls)
        self.down: set[int] = set()  # replicas that did not answer (their node lost); /health probes them again
        self.last = -1
        self.histories = PrefixCache(history_bytes)  # histories' bytes -> the replica that served them

    def acquire(self, history: bytes | None = None, tenant=None) -> int:
        """``history``: the request's conversation as bytes (``history_of``), ``tenant``: whose it is (the
        replicas' caches are per tenant too)."""
        n = len(self.urls)
        up = [j for j in range(n) if j not in self.down] or list(range(n))
        least = min(up, key=lambda j: (self.running[j], (j - self.last - 1) % n))
        i = least
        if history:
            hit = self.histories.lookup(list(history), tenant)
            if (
                hit is not None
                and hit[0].replica not in self.down
                and hit[1] >= self.MIN_SHARED
                and self.running[hit[0].replica] <= self.running[least] + self.SLACK
            ):
                i = hit[0].replica
            self.histories.insert(list(history), _Routed(len(history), i), tenant)
        self.last = i
        self.running[i] += 1
        self.routed[i] += 1
        return i

    def release(self, i: int) -> None:
        self.running[i] -= 1

    # what graceful.GracefulServer reads while draining
    def stats(self) -> dict:
        return {"running": sum(self.running), "waiting": 0}

    def stop(self) -> None:
        pass


def merge_metrics(texts: list[str]) -> str:
    """The replicas' Prometheus texts as one exposition: each sample gains a ``replica`` label, and the
    samples of one metric stay together under its HELP and TYPE lines, as the format requires."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for i, text in enumerate(texts):
        fam = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                fam = families.setdefault(line.split(" ", 3)[2], ([], []))
                if line not in fam[0]:
                    fam[0].append(line)
            elif line and not line.startswith("#") and fam is not None:
                fam[1].append(_with_replica(line, i))
    return "".join(line + "\n" for head, samples in families.values() for line in head + samples)


def _with_replica(sample: str, i: int) -> str:
    name, brace, rest = sample.partition("{")
    if brace:
        return f'{name}{{replica="{i}",{rest}'
    name, _, value = sample.partition(" ")
    return f'{name}{{replica="{i}"}} {value}'


def _unavailable(message: str) -> JSONResponse:
    e = RequestError(message, status=503, type="server_error", code="replica_unavailable")
    return JSONResponse(e.body(), status_code=503)


class _Front:
    """What the front's handlers read (``app.state.front``): the replicas, the router, the HTTP client."""

    def __init__(self, urls: list[str], api_key: str | None, max_body_bytes: int):
        self.urls, self.api_key, self.max_body_bytes = urls, api_key, max_body_bytes
        self.router = Router(urls)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
        self.auth = {"Authorization": f"Bearer {api_keys(api_key)[0]}"} if api_key else {}  # the first of several

    async def replica_get(self, path: str, headers: dict | None = None) -> list:
        """GET ``path`` of every replica (None where one did not answer), with the front's key unless ``headers``."""

        async def one(u):
            try:
                return await self.client.get(u + path, headers=self.auth if headers is None else headers, timeout=10)
            except httpx.HTTPError:
                return None

        return await asyncio.gather(*(one(u) for u in self.urls))


def create_front(
    urls: list[str],
    *,
    api_key: str | None = None,
    open_metrics: bool = False,
    on_stop=None,
    max_body_bytes: int = MAX_BODY_BYTES,
    allowed_hosts: tuple[str, ...] = (),
) -> FastAPI:
    """The one endpoint in front of the replicas at ``urls``: the same key, origin and body-size rules as a
    replica, checked before a body is held in memory or relayed."""
    front = _Front(urls, api_key, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await front.client.aclose()
        if on_stop:
            on_stop()

    app = FastAPI(title="specdraft replicas", lifespan=lifespan)
    app.state.draining = False
    app.state.worker = front.router
    app.state.front = front
    app.middleware("http")(drain_check(app))
    if api_key:
        app.middleware("http")(key_check(api_key, open_metrics))
    else:
        app.middleware("http")(origin_check(LOOPBACK_HOSTS + tuple(allowed_hosts)))
    for verb, path in API_ROUTES:
        getattr(app, verb)(path)(relay)
    add_playground(app)
    app.get("/health")(front_health)
    app.get("/metrics")(front_metrics)
    return app


def history_of(body: bytes) -> bytes | None:
    """A generation request's conversation as bytes whose prefixes are its earlier turns' (each message, or
    the prompt, serialized on its own), or None for any other body."""
    try:
        d = json.loads(body)
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    parts: list = d["messages"] if isinstance(d.get("messages"), list) else [d.get("prompt")]
    if parts == [None]:
        return None
    return b"".join(json.dumps(p, sort_keys=True).encode() + b"\n" for p in parts)


def _salt(body: bytes):
    try:
        d = json.loads(body)
        return d.get("cache_salt") if isinstance(d, dict) else None
    except ValueError:
        return None


async def relay(request: Request):
    """The request to the least busy replica; its response relayed as it arrives."""
    front = request.app.state.front
    router, client = front.router, front.client
    try:
        content = await read_body(request, front.max_body_bytes)
    except RequestError as e:
        return JSONResponse(e.body(), status_code=e.status)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    history, tenant = history_of(content), (request.headers.get("authorization"), _salt(content))
    for _ in front.urls:  # a replica that cannot be reached has not seen the request: the next one takes it
        i = router.acquire(history, tenant)
        try:
            up = await client.send(
                client.build_request(
                    request.method, front.urls[i] + request.url.path, headers=headers, content=content
                ),
                stream=True,
            )
            break
        except httpx.HTTPError as e:
            router.release(i)
            router.down.add(i)
            failure = f"replica {i} did not answer: {type(e).__name__}"
    else:
        return _unavailable(failure)

    async def body():
        try:
            async for chunk in up.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the replica (its node) was lost mid-answer: an error event ends the stream
            router.down.add(i)
            lost = RequestError(
                f"replica {i} was lost mid-answer ({type(e).__name__}); retry the request",
                status=503,
                type="server_error",
                code="replica_unavailable",
            )
            yield f"data: {json.dumps(lost.body())}\n\ndata: [DONE]\n\n".encode()
        finally:  # the client left or the replica finished: either way the replica's slot is free
            await up.aclose()
            router.release(i)

    out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS}
    out["X-Specdraft-Replica"] = str(i)
    return StreamingResponse(body(), status_code=up.status_code, headers=out)


async def front_health(request: Request):
    front = request.app.state.front
    router = front.router
    answers = await front.replica_get("/health")
    replicas = [
        {
            "replica": i,
            "url": u,
            "node": urlsplit(u).hostname,
            "running": router.running[i],
            "routed": router.routed[i],
            **(r.json() if r is not None and r.status_code == 200 else {"status": "unreachable"}),
        }
        for i, (u, r) in enumerate(zip(front.urls, answers))
    ]
    router.down = {r["replica"] for r in replicas if r["status"] == "unreachable"}
    ok = all(r["status"] == "ok" for r in replicas)
    body: dict[str, object] = {"status": "ok" if ok else "degraded"}
    if health_details(request, front.api_key):  # replica addresses and loads: the key's holders only
        body["replicas"] = replicas
    return JSONResponse(body, status_code=200 if ok else 503)


async def front_metrics(request: Request):
    # with the caller's own key (or none): a replica shows its engine series to whom it would show them
    auth = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    answers = await request.app.state.front.replica_get("/metrics", headers=auth)
    return Response(
        merge_metrics([r.text if r is not None and r.status_code == 200 else "" for r in answers]),
        media_type=CONTENT_TYPE_LATEST,
    )
