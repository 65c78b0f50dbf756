"""The FastAPI application: /v1/completions, /v1/chat/completions (streaming and not), /v1/models,
/v1/specdraft/methods, /health, /metrics, and the playground page at / (server/playground.html). Request handlers only
parse, admit and relay; decoding runs on the worker thread."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..api import ModelSettings, default_backend
from ..core.config import PATH_FIELDS, SPEC_OFF_AT, SPEC_SHRINK_AT, SpecConfig
from ..core.errors import SpecDraftError
from ..core.methods import REGISTRY
from ..core.methods import method as registered
from ..drafters.runs_on import backends, unavailable
from .batch_worker import BatchWorker
from .learning import LearnCollector, api_keys, curve_view, health_view, learns_from, tenancy_problem
from .pacing import STREAM_MODES, StreamPacing, keepalive, paced, pad
from .prometheus import ServerMetrics
from .protocol import RequestError, ResponseBuilder, StepTrace, TextStream, finish_reason, parse_request, spec_over
from .resources import LOAD_S
from .resources import load as load_resources
from .scheduler import QueueFull, ServedRequest, shutdown_error

log = logging.getLogger("specdraft.server")


class _Timeout(Exception):
    pass


class _Disconnected(Exception):
    pass


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _timeout_error(timeout_s) -> RequestError:
    return RequestError(
        f"the request did not finish within the server's timeout of {timeout_s:g} s",
        status=408,
        type="timeout_error",
        code="request_timeout",
    )


def _engine_error(err: Exception) -> RequestError:
    if isinstance(err, RequestError):
        return err
    if isinstance(err, SpecDraftError):
        return RequestError(str(err))
    return RequestError(
        f"internal server error ({type(err).__name__}); see the server log",
        status=500,
        type="server_error",
        code="internal_error",
    )


class _Outcome:
    """A streamed request's outcome, counted once: when its last event is written (so a client that has read
    the whole answer finds it in /metrics), or else when the stream closes (client gone, cancelled)."""

    def __init__(self, count):
        self.status, self._count, self._counted = "cancelled", count, False

    def settle(self, status: str | None = None) -> None:
        self.status = status or self.status
        if not self._counted:
            self._counted = True
            self._count(self.status).inc()


class _JobStream(StreamingResponse):
    """A stream that, however it ends (finished, client gone, even before its first chunk), cancels
    its job if still unfinished and counts the request's outcome."""

    def __init__(self, content, job, worker, on_close, **kw):
        super().__init__(content, **kw)
        self._job, self._worker, self._on_close = job, worker, on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._job.done.is_set():
                self._worker.cancel(self._job, "disconnect")
            self._on_close()


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, or a 413 RequestError past ``limit`` bytes (checked on the declared length, then while
    reading a chunked body)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise RequestError(
            f"the request body is {int(declared)} bytes; this server takes at most {limit}",
            status=413,
            code="body_too_large",
        )
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise RequestError(f"the request body exceeds {limit} bytes", status=413, code="body_too_large")
    return bytes(raw)


async def _read_json(request: Request, limit: int):
    """The body as JSON, or a RequestError: 413 past ``limit`` bytes, 400 for invalid UTF-8 / JSON or
    nesting too deep to parse."""
    raw = await read_body(request, limit)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError("the request body is not valid UTF-8") from None
    except json.JSONDecodeError:
        raise RequestError("the request body is not valid JSON") from None
    except RecursionError:
        raise RequestError("the request body nests too deeply") from None


def _rss_mb() -> float | None:
    """This process's resident memory (Linux /proc; None elsewhere), for soak checks."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _unauthorized(message: str) -> JSONResponse:
    e = RequestError(message, status=401, code="invalid_api_key")
    return JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})


def request_key(request: Request, api_key) -> str | None:
    """The key of ``api_key`` (one, or several) that ``request`` carries as ``Authorization: Bearer <key>``
    (each compared in constant time), or None."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    given = given.strip().encode()
    hits = [k for k in api_keys(api_key) if hmac.compare_digest(given, k.encode())]  # every key compared
    return hits[0] if hits else None


def key_problem(request: Request, api_key) -> str | None:
    """Why ``request`` does not carry ``Authorization: Bearer <key>`` of ``api_key`` (one, or several), or None."""
    if not request.headers.get("authorization", ""):
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    return None if request_key(request, api_key) is not None else "invalid API key"


def key_check(api_key, open_metrics: bool = False):
    """An HTTP middleware: every path but /health, the playground's (and /metrics with ``open_metrics``) needs
    ``Authorization: Bearer <api_key>``; otherwise 401 in OpenAI's shape. (/health answers without it,
    but only whether the server is up: see ``health_details``.)"""
    # answered without the key: load balancers' probes; the static playground page, which asks for the key
    # and sends it with its own requests
    open_paths = ("/health", *PLAYGROUND) + (("/metrics",) if open_metrics else ())

    async def check(request: Request, call_next):
        if request.url.path in open_paths:
            return await call_next(request)
        problem = key_problem(request, api_key)
        if problem:
            return _unauthorized(problem)
        request.state.api_key = request_key(request, api_key)  # whose request it is (--learn-keys)
        return await call_next(request)

    return check


def health_details(request: Request, api_key, hidden: bool = False) -> bool:
    """Whether ``request`` may see what moves with each step's accepted drafts (/health's queue, rows and
    cache length; /metrics' engine series). With an API key, only its holders; without one, unless
    ``hidden`` (a server streaming fixed by default hides acceptance from everyone)."""
    return key_problem(request, api_key) is None if api_key else not hidden


def fixed_by_default(request: Request) -> bool:
    """Whether this server streams in fixed mode when a request names none (--stream-mode fixed or fixed-only)."""
    return _serving(request).stream_mode == "fixed" or request.app.state.stream_pacing.locked


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

# The API's routes, written once: a server answers each with its handler, the replicas' front relays each.
API_ROUTES: tuple[tuple[str, str], ...] = (
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
    ("get", "/v1/models"),
    ("get", "/v1/specdraft/methods"),
    ("get", "/v1/specdraft/learning"),
)


def _host_name(host: str) -> str:
    if host.startswith("["):  # [::1]:8000
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def origin_check(allowed_hosts: tuple[str, ...]):
    """An HTTP middleware for a server without an API key: a browser page must not reach it. A POST must be
    ``Content-Type: application/json`` (a cross-site form or simple request cannot send that without a
    CORS preflight, which this server never grants), and the Host header must name an allowed host, so a
    DNS-rebinding page (Host: its own domain) is refused."""
    allowed = {h.lower() for h in allowed_hosts}

    async def check(request: Request, call_next):
        host = _host_name(request.headers.get("host", "").lower())
        if host not in allowed:
            e = RequestError(
                f"the Host header {host!r} is not one this server answers to", status=421, code="misdirected_request"
            )
            return JSONResponse(e.body(), status_code=421)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if request.method == "POST" and ctype != "application/json":
            e = RequestError(
                f"the request body must be sent as Content-Type: application/json, got {ctype or 'none'!r}",
                status=415,
                code="unsupported_media_type",
            )
            return JSONResponse(e.body(), status_code=415)
        return await call_next(request)

    return check


def drain_check(app: FastAPI):
    """An HTTP middleware: once ``app.state.draining`` is set (SIGTERM, server/graceful.py), new requests
    get a 503 in OpenAI's shape (/health says "draining" with a 503 too, so balancers stop routing)."""

    async def check(request: Request, call_next):
        if not app.state.draining or request.url.path == "/metrics":
            return await call_next(request)
        if request.url.path == "/health":
            return JSONResponse({"status": "draining"}, status_code=503)
        e = RequestError(
            "the server is shutting down; retry on another replica",
            status=503,
            type="server_error",
            code="shutting_down",
        )
        return JSONResponse(e.body(), status_code=503, headers={"Retry-After": "5"})

    return check


def check_method(decoder, spec: SpecConfig):
    """A RequestError (param ``spec``) when this decoder cannot run ``spec.method`` (its backend, a draft
    model it lacks); else the method's entry in the table (its ``load_resource`` is run by the caller)."""
    m = registered(spec.method)
    problem = unavailable(
        m,
        decoder.backend,
        decoder.draft is not None,
        subject="spec.method",
        where=" this server runs",
        no_draft=f"spec.method {m.name!r} needs a draft model; this server was started "
        "without --draft (use auto, prompt_lookup or plain)",
    )
    if not problem and not m.served:
        problem = f"spec.method {m.name!r} is not served: it starts a process of its own (bench and library only)"
    if problem:
        raise RequestError(problem, param="spec")
    return m


def methods_listing(
    decoder, model_name: str, default_spec: SpecConfig, resources: dict, stream_mode: str = "normal"
) -> dict:
    """GET /v1/specdraft/methods: every registered method (auto first), whether a request's
    ``{"spec": {"method": NAME}}`` runs here (else why not), and its knobs (trees, schedules); the server's
    ``stream_mode`` ("normal", "fixed" or "fixed-only"), which says whether include_steps may be asked."""
    names = ["auto"] + [n for n in REGISTRY if n != "auto"]
    data = []
    for name in names:
        m = registered(name)
        try:
            check_method(decoder, spec_over({"method": name}, default_spec, resources))
            reason = None
        except RequestError as e:
            reason = e.message
        data.append(
            {
                "id": name,
                "object": "method",
                "summary": m.summary,
                "needs": m.needs,
                "available": reason is None,
                "reason": reason,
                "trees": list(m.trees),
                "schedules": list(m.schedules),
                "backends": list(backends(m)),
            }
        )
    d = default_spec.to_dict()
    return {
        "object": "list",
        "model": model_name,
        "backend": decoder.backend,
        "stream_mode": stream_mode,
        "draft": getattr(decoder.draft, "name", None),
        "default_spec": {k: d[k] for k in ("method", "k", "max_k", "schedule", "tree")},
        "data": data,
    }


PLAYGROUND = {
    "/": ("playground.html", "text/html; charset=utf-8"),  # package data beside this module: static,
    "/playground.js": ("playground.js", "text/javascript; charset=utf-8"),  # no build step
    "/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
# the page's scripts and styles come from its own files only (no inline script: a server string that reached
# markup could not run), it talks to this origin only, and no other site may frame it (clickjacking)
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)


def add_playground(app: FastAPI) -> None:
    """GET /: the playground page (server/playground.html, .js, .css), read once. It holds nothing secret:
    with an API key it asks for the key and sends it as a Bearer token with its own requests."""
    from importlib.resources import files

    headers = {
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Content-Security-Policy": PAGE_CSP,
        "X-Frame-Options": "DENY",
    }

    def route(body: str, media_type: str):
        async def static():
            return Response(body, media_type=media_type, headers=headers)

        return static

    for path, (name, media_type) in PLAYGROUND.items():
        app.get(path, include_in_schema=False)(
            route(files(__package__).joinpath(name).read_text(encoding="utf-8"), media_type)
        )


MAX_BODY_BYTES = 4 << 20  # a request body larger than this gets a 413 before it is parsed
STUCK_AFTER_S = 300.0  # one engine step running longer than this makes /health say the worker is stuck


@dataclass
class ServerSettings:
    """What one server serves and how (``specdraft serve`` builds it from its flags; the tests pass these
    fields to server.local.serve_in_thread).

    ``max_batch``: the rows the worker (BatchWorker) decodes together, 1 = one request at a time; with more,
    the draft length is halved from ``spec_shrink_at`` rows and speculation is off from ``spec_off_at``. ``api_key``:
    every endpoint but /health (and /metrics with ``open_metrics``) requires it (or, given several, one of them) as a
    Bearer token. ``learn_keys``: on a decoder that learns (SpecDecoder(learn=...)), the keys whose requests teach the
    head; None: every request, which a server with several keys or in fixed stream mode refuses (server/learning.py).
    ``max_body_bytes``: larger request bodies get a 413.
    ``stream_mode``: a stream's mode when the request names none ("normal" or "fixed", server/pacing.py);
    ``stream_pacing``: the fixed mode's chunk, cadence, padding, and whether requests must use it.
    ``resources``: {spec field naming a file (config.PATH_FIELDS): {name: path}}, what a request's spec may
    name (by name; never a path). Without an API key, requests must be JSON and name a loopback host or one
    of ``allowed_hosts`` (``origin_check``). /health answers 503 when the worker died or one step has run
    ``stuck_after_s``."""

    model_name: str
    default_spec: SpecConfig | dict
    prefix_cache_mb: float | None = None  # the decoder's prefix cache (SpecDecoder; None: its default, 0: off)
    max_queue: int = 64
    timeout_s: float | None = None
    default_max_tokens: int = 256
    max_batch: int = 1
    spec_shrink_at: int = SPEC_SHRINK_AT
    spec_off_at: int = SPEC_OFF_AT
    api_key: str | tuple[str, ...] | None = None
    open_metrics: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    stream_mode: str = "normal"
    stream_pacing: StreamPacing | None = None
    resources: dict | None = None
    allowed_hosts: tuple[str, ...] = ()
    stuck_after_s: float = STUCK_AFTER_S
    learn: object = None  # a learning.LearnConfig: build_server_app loads the decoder learning with it
    learn_keys: tuple[str, ...] | None = None


@dataclass
class _Serving:
    """What the route handlers read (``app.state.serving``). What a measurement may change while the server
    runs stays on ``app.state``: ``resources`` and ``stream_pacing``, read per request."""

    decoder: object
    settings: ServerSettings
    default_spec: SpecConfig
    stream_mode: str  # "fixed" when the pacing is locked
    worker: object
    metrics: ServerMetrics

    @property
    def tok(self):
        return self.decoder.tokenizer


def _serving(request: Request) -> _Serving:
    return request.app.state.serving


def make_worker(decoder, metrics: ServerMetrics, settings: ServerSettings) -> BatchWorker:
    """The worker of ``settings.max_batch`` rows (not started)."""
    return BatchWorker(
        decoder,
        metrics,
        settings.max_queue,
        max_batch=settings.max_batch,
        spec_shrink_at=settings.spec_shrink_at,
        spec_off_at=settings.spec_off_at,
    )


def create_app(decoder, settings: ServerSettings) -> FastAPI:
    """The app of one engine over ``decoder`` (a SpecDecoder), served as ``settings`` say."""
    if settings.stream_mode not in STREAM_MODES:
        raise ValueError(f"stream_mode must be one of {', '.join(STREAM_MODES)}, got {settings.stream_mode!r}")
    pacing = settings.stream_pacing or StreamPacing()
    default_spec = SpecConfig.from_dict(settings.default_spec)
    metrics = ServerMetrics()
    metrics.watch_prefix_cache(getattr(decoder, "prefix_cache", None))
    start_learning(decoder, settings, default_spec, pacing.locked or settings.stream_mode == "fixed", metrics)
    worker = make_worker(decoder, metrics, settings)
    worker.start()

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.stop()
        if decoder.learner is not None:
            decoder.learner.close()

    app = FastAPI(title="specdraft", lifespan=lifespan)
    app.state.draining = False
    app.middleware("http")(drain_check(app))
    if settings.api_key:  # added last, so it runs first: nothing about the server is told to a caller without the key
        app.middleware("http")(key_check(settings.api_key, settings.open_metrics))
    else:
        app.middleware("http")(origin_check(LOOPBACK_HOSTS + tuple(settings.allowed_hosts)))
    app.state.worker = worker
    app.state.default_spec = default_spec
    app.state.resources = {k: dict(v) for k, v in (settings.resources or {}).items()}
    app.state.stream_pacing = pacing  # read per stream, so a measurement may retune it (specdraft leak)
    app.state.metrics = metrics
    app.state.serving = _Serving(
        decoder, settings, default_spec, "fixed" if pacing.locked else settings.stream_mode, worker, metrics
    )
    app.exception_handler(Exception)(_unhandled)
    handlers = {
        "/v1/completions": completions,
        "/v1/chat/completions": chat_completions,
        "/v1/models": list_models,
        "/v1/specdraft/methods": list_methods,
        "/v1/specdraft/learning": learning,
    }
    for verb, path in API_ROUTES:
        getattr(app, verb)(path)(handlers[path])
    add_playground(app)
    app.get("/health")(health)
    app.get("/metrics")(prom)
    return app


def start_learning(decoder, settings: ServerSettings, default_spec: SpecConfig, fixed: bool, metrics) -> None:
    """On a decoder that learns: the tenancy rule checked (server/learning.py), the default spec's head loaded
    now (the learner starts, from the adapted head when one is kept), the learner's series in /metrics."""
    learner = getattr(decoder, "learner", None)
    if learner is None:
        if settings.learn_keys is not None:
            raise ValueError("learn_keys is set but the decoder does not learn (SpecDecoder(learn=...))")
        return
    problem = tenancy_problem(api_keys(settings.api_key), fixed, settings.learn_keys)
    if problem:
        raise ValueError(problem)
    if default_spec.get("head") is not None and default_spec.method in ("eagle3", "auto"):
        decoder.head(default_spec)
    elif not (settings.resources or {}).get("head"):
        log.warning(
            "--learn: this server serves no EAGLE-3 head (--head, --resource head:NAME=DIR); only the "
            "suffix drafters' store of recent outputs learns"
        )
    metrics.engine.register(LearnCollector(learner))


async def _unhandled(request, exc):
    log.exception("unhandled error")
    return _error(_engine_error(exc))


async def completions(request: Request):
    return await handle(request, chat=False)


async def chat_completions(request: Request):
    return await handle(request, chat=True)


async def list_models(request: Request):
    sv = _serving(request)
    return {
        "object": "list",
        "data": [
            {
                "id": sv.settings.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "specdraft",
                "max_model_len": sv.decoder.target.max_context,
            }
        ],
    }


async def list_methods(request: Request):
    sv = _serving(request)
    mode = "fixed-only" if request.app.state.stream_pacing.locked else sv.stream_mode
    return methods_listing(sv.decoder, sv.settings.model_name, sv.default_spec, request.app.state.resources, mode)


async def health(request: Request):
    sv, state_of = _serving(request), request.app.state
    worker = state_of.worker
    state = worker.health(sv.settings.stuck_after_s)
    body = {"status": "ok" if state == "ok" else f"worker {state}"}
    if health_details(request, sv.settings.api_key, hidden=fixed_by_default(request)):
        body.update(
            {
                "model": sv.settings.model_name,
                "scheduler": worker.kind,
                **worker.stats(),
                **worker.state(),
                "rss_mb": _rss_mb(),
                "worker_restarts": worker.restarts,
            }
        )
        if sv.decoder.learner is not None:
            body["learning"] = health_view(sv.decoder.learner)
    return JSONResponse(body, status_code=200 if state == "ok" else 503)


async def learning(request: Request):
    """The learner's state and acceptance curve (the playground draws it), to whoever sees /health's details."""
    sv = _serving(request)
    if not health_details(request, sv.settings.api_key, hidden=fixed_by_default(request)):
        return {"learning": None}  # a fixed-mode server tells nobody without the key
    return curve_view(sv.decoder.learner)


async def prom(request: Request):
    """The request counters; the engine's series too, unless they would show what fixed mode hides (a
    fixed-mode server shows them to the API key's holders only, --metrics-open or not)."""
    sv = _serving(request)
    engine = not fixed_by_default(request) or health_details(request, sv.settings.api_key, hidden=True)
    return Response(sv.metrics.exposition(engine), media_type=CONTENT_TYPE_LATEST)


async def parse(request: Request, sv: _Serving, chat: bool):
    """The request read, parsed and checked against this server (its method can run here, its resource loads,
    its stream mode is allowed); a RequestError otherwise."""
    body = await _read_json(request, sv.settings.max_body_bytes)
    p = parse_request(
        body,
        chat=chat,
        model_name=sv.settings.model_name,
        target=sv.decoder.target,
        tokenizer=sv.tok,
        default_spec=sv.default_spec,
        default_max_tokens=sv.settings.default_max_tokens,
        resources=request.app.state.resources,
    )
    check_method(sv.decoder, p.spec)  # what the method needs must exist before admission
    named = {k: v for k, v in (body.get("spec") or {}).items() if k in PATH_FIELDS}
    limit = min(LOAD_S, sv.settings.timeout_s or LOAD_S)  # checked and loaded where timeout and shutdown reach
    await load_resources(sv.decoder, p.spec, named, limit, lambda: request.app.state.draining)
    p.stream_mode = p.stream_mode or sv.stream_mode
    if request.app.state.stream_pacing.locked and p.stream_mode != "fixed":
        raise RequestError(
            'this server streams only in stream_mode "fixed" (it hides what speculation '
            'accepted); leave stream_mode out or set it to "fixed"',
            param="stream_mode",
        )
    if p.include_steps and p.stream_mode == "fixed":
        raise RequestError(
            "stream_options.include_steps shows what speculation accepted, which stream_mode "
            '"fixed" hides; leave one out',
            param="stream_options.include_steps",
        )
    return p


async def handle(request: Request, chat: bool):
    """POST /v1/completions and /v1/chat/completions: parse, admit, then stream or answer."""
    sv = _serving(request)
    endpoint = "chat" if chat else "completions"
    count = sv.metrics.requests.labels
    try:
        p = await parse(request, sv, chat)
    except RequestError as e:
        count(endpoint, "invalid").inc()
        return _error(e)
    job = ServedRequest(
        p.prompt_ids, p.sampling, p.spec, sv.settings.timeout_s, asyncio.get_running_loop(), processor=p.processor
    )
    key = getattr(request.state, "api_key", None)
    job.learn = learns_from(key, sv.settings.learn_keys)
    job.partition = (key, p.cache_salt)  # cached prefixes are this tenant's and this salt's only
    try:
        sv.worker.submit(job)
    except QueueFull as e:
        count(endpoint, "rejected").inc()
        return _error(RequestError(str(e), status=429, type="rate_limit_error", code="queue_full"))
    rb = ResponseBuilder(chat, sv.settings.model_name, sv.tok, hide_acceptance=p.stream_mode == "fixed")
    if p.stream:
        outcome = _Outcome(lambda status: count(endpoint, status))
        return _JobStream(
            stream(sv, job, request, rb, p, outcome),
            job,
            sv.worker,
            outcome.settle,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await answer(sv, job, request, rb, p, lambda status: count(endpoint, status).inc())


async def answer(sv: _Serving, job: ServedRequest, request: Request, rb: ResponseBuilder, p, count):
    """A request that is not streamed: its whole answer, or its error (``count(status)`` counts it)."""
    timeout_s = sv.settings.timeout_s
    try:  # fixed mode: the answer leaves when the stream's last event would (what acceptance sped up is hidden)
        events = job_events(sv.worker, job, request, watch_disconnect=True)
        fixed = p.stream_mode == "fixed"
        async for kind, payload in paced(events, request.app.state.stream_pacing, job.t_arrive) if fixed else events:
            if kind == "done":
                break
            if kind == "timeout":
                raise _Timeout()
            if kind == "error":
                e = _engine_error(payload)
                count("error" if e.status >= 500 else "invalid")
                return _error(e)
    except _Timeout:
        count("timeout")
        return _error(_timeout_error(timeout_s))
    except _Disconnected:
        count("cancelled")
        return Response(status_code=499)
    except asyncio.CancelledError:
        sv.worker.cancel(job, "disconnect")
        count("cancelled")
        raise
    res = payload
    if res.stats.finish_reason == "cancelled":
        if job.cancel_reason == "shutdown":
            count("cancelled")
            return _error(shutdown_error())
        status = "timeout" if job.cancel_reason == "timeout" else "cancelled"
        count(status)
        return _error(_timeout_error(timeout_s)) if status == "timeout" else Response(status_code=499)
    count("ok")
    return JSONResponse(rb.full(res.text or "", res.stats, p.spec.method, res.logprobs))


async def next_event(worker, job: ServedRequest, request: Request, watch_disconnect: bool):
    while True:
        wait = 0.25
        if job.deadline is not None:
            wait = min(wait, max(0.01, job.deadline - time.monotonic()))
        try:
            return await asyncio.wait_for(job.events.get(), wait)
        except asyncio.TimeoutError:
            if job.expired():
                worker.cancel(job, "timeout")
                raise _Timeout() from None
            if watch_disconnect and await request.is_disconnected():
                worker.cancel(job, "disconnect")
                raise _Disconnected() from None


async def job_events(worker, job: ServedRequest, request: Request, watch_disconnect: bool = False):
    """The job's events, ending with its first non-"tokens" one; a timeout is ("timeout", None)."""
    while True:
        try:
            kind, payload = await next_event(worker, job, request, watch_disconnect)
        except _Timeout:
            yield "timeout", None
            return
        yield kind, payload
        if kind != "tokens":
            return


async def stream(sv: _Serving, job: ServedRequest, request: Request, rb: ResponseBuilder, p, outcome: _Outcome):
    """A streamed request's server-sent events (fixed mode: paced, padded chunks)."""
    fixed, pacing, timeout_s = p.stream_mode == "fixed", request.app.state.stream_pacing, sv.settings.timeout_s
    sse = (lambda obj: pad(_sse(obj), pacing.pad_bytes)) if fixed else _sse
    done_line = pad("data: [DONE]\n\n", pacing.pad_bytes) if fixed else "data: [DONE]\n\n"
    ts = TextStream(sv.tok, p.sampling.stop)
    trace = StepTrace(sv.tok) if p.include_steps else None
    if rb.chat:
        yield sse(rb.chunk(None, first=True))
    events = job_events(sv.worker, job, request)
    async for kind, payload in paced(events, pacing, job.t_arrive) if fixed else events:
        if kind == "tokens":
            new, lps, at = payload[0], payload[1], ts.sent
            delta = ts.push(new)
            steps = trace.step(new, payload[2], lps, at, delta) if trace else None
            if delta or lps or fixed or trace:  # logprobs go with the step that made their tokens, text or not yet
                yield sse(rb.chunk(delta, logprobs=lps, steps=steps))
        elif kind == "keepalive":
            yield keepalive(pacing.pad_bytes)
        elif kind in ("timeout", "error"):
            e = _timeout_error(timeout_s) if kind == "timeout" else _engine_error(payload)
            outcome.settle("timeout" if kind == "timeout" else "error" if e.status >= 500 else "invalid")
            yield sse(e.body()) + done_line
            return
        else:
            res = payload
            if res.stats.finish_reason == "cancelled":
                outcome.settle("timeout" if job.cancel_reason == "timeout" else "cancelled")
                if job.cancel_reason in ("timeout", "shutdown"):
                    e = _timeout_error(timeout_s) if job.cancel_reason == "timeout" else shutdown_error()
                    yield sse(e.body()) + done_line
                return
            # one write: the end of a stream shows as one event, whatever it carries
            at = ts.sent
            last = ts.push([], final=True)
            steps = trace.tail(at, last) if trace else None
            outcome.settle("ok")
            yield (
                sse(rb.chunk(last or None, finish=finish_reason(res.stats), steps=steps))
                + (sse(rb.usage_chunk(res.stats, p.spec.method)) if p.include_usage else "")
                + done_line
            )
            return


def build_server_app(models: ModelSettings, settings: ServerSettings, method_defaulted: bool = False):
    """Loads the models and returns the FastAPI app of one engine (`specdraft serve`'s, a replica's too:
    server/replicas.py). ``method_defaulted``: the spec names no method (auto), so the decoder settles what it
    can run (SpecDecoder.usable) once the models are loaded."""
    dec = models.load(learn=settings.learn, prefix_cache_mb=settings.prefix_cache_mb)
    if (models.backend or default_backend(models.target)) == "auto":
        print(
            "serve: one path stays loaded for every request, the one --backend auto took above without a "
            "request's shape (`specdraft generate` and the library weigh each request's prompt and answer "
            "lengths)",
            file=sys.stderr,
            flush=True,
        )
    if method_defaulted:
        settings = replace(settings, default_spec=dec.usable(settings.default_spec))
    return create_app(dec, settings)
