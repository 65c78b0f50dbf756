"""``specdraft loadtest``: load a local specdraft server with concurrent streaming requests and
report throughput, time to first token (TTFT) and time per output token (TPOT), with speculation
on (the server's default method, or --spec) and off (per-request ``"spec": {"method": "plain"}``).

Loopback only (127.0.0.1 / localhost / ::1), bounded in request count, concurrency and wall time.
Requests are greedy with ``ignore_eos`` so every request generates exactly --max-tokens tokens and
both modes do the same work.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

from ..core.errors import SpecDraftError
from ..core.extras import require_module
from ..core.metrics import mean_accepted_tokens_from_totals
from .client import PROMPTS, pct, send

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_REQUESTS = 1000
MAX_CONCURRENCY = 64


@dataclass(frozen=True)
class LoadtestOptions:
    """``specdraft loadtest``'s flags."""

    url: str = "http://127.0.0.1:8000"  # loopback only
    concurrency: str = "1,4,16"  # a comma list of concurrent clients
    requests: int = 16  # per concurrency level and mode
    max_tokens: int = 64
    timeout: float = 300.0  # seconds for the whole run (and per request)
    modes: str = "spec,plain"
    spec: str | None = None  # SpecConfig JSON for the spec mode (default: the server's)
    out: str = "loadtest.json"
    api_key: str | None = None  # default: $SPECDRAFT_API_KEY
    soak: bool = False
    disconnects: int = 1000  # --soak: requests whose clients disconnect
    soak_methods: str = "prompt_lookup,plain"


def add_parser(sub):
    lt = sub.add_parser("loadtest", help="load-test a local specdraft server (spec on vs off)")
    lt.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    lt.add_argument("--concurrency", default="1,4,16", help="comma list of concurrent clients")
    lt.add_argument("--requests", type=int, default=16, help="requests per concurrency level and mode")
    lt.add_argument("--max-tokens", type=int, default=64)
    lt.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run (and per request)")
    lt.add_argument("--modes", default="spec,plain", help="spec (server default) and/or plain (spec off)")
    lt.add_argument("--spec", default=None, help="SpecConfig JSON for the spec mode (default: the server's)")
    lt.add_argument("--out", default="loadtest.json", help="JSON results file")
    lt.add_argument("--api-key", default=None, help="the server's API key (default: $SPECDRAFT_API_KEY)")
    lt.add_argument(
        "--soak",
        action="store_true",
        help="mixed load at each --concurrency level (--requests each), "
        "every greedy answer checked against the same request alone, then --disconnects requests whose "
        "clients leave at random points, and the server's /health before and after",
    )
    lt.add_argument("--disconnects", type=int, default=1000, help="--soak: requests whose clients disconnect")
    lt.add_argument("--soak-methods", default="prompt_lookup,plain", help="--soak: methods the requests draw from")
    return lt


def check_url(url: str) -> str:
    u = urlparse(url)
    if u.scheme != "http" or not u.hostname:
        raise SpecDraftError(f"--url must be an http:// URL of a local server, got {url!r}")
    if u.hostname not in LOOPBACK:
        raise SpecDraftError(
            f"loadtest only targets a server on this machine (127.0.0.1, localhost or ::1); refusing {u.hostname!r}"
        )
    return url.rstrip("/")


def parse_levels(s: str) -> list[int]:
    try:
        levels = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SpecDraftError(f"--concurrency must be a comma list of integers, got {s!r}") from None
    if not levels or any(not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise SpecDraftError(f"--concurrency values must be in 1..{MAX_CONCURRENCY}, got {s!r}")
    return levels


def one_request(
    url: str, model: str, prompt: str, max_tokens: int, spec: dict | None, timeout: float, headers: dict | None = None
) -> dict:
    import httpx

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec is not None:
        body["spec"] = spec
    with httpx.Client(base_url=url, timeout=timeout, headers=headers) as c:
        r = send(c, body)
    if r["ok"] and r["usage"] is None:
        return {"ok": False, "error": "the stream ended without usage"}
    if not r["ok"]:
        return r
    n = r["tokens"]
    return {**r, "tpot": (r["latency"] - r["ttft"]) / (n - 1) if n > 1 else None}


def run_level(url, model, conc, n_requests, max_tokens, spec, deadline, headers=None) -> dict:
    results = []
    lock = threading.Lock()

    def task(i):
        left = deadline - time.perf_counter()
        if left <= 1:
            r = {"ok": False, "error": "skipped: the run's time budget is spent"}
        else:
            r = one_request(url, model, PROMPTS[i % len(PROMPTS)], max_tokens, spec, left, headers)
        with lock:
            results.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=conc) as ex:
        list(ex.map(task, range(n_requests)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    steps = sum(r["usage"]["steps"] for r in ok)
    acc = sum(r["usage"]["accepted"] for r in ok)
    drafted = sum(r["usage"]["drafted"] for r in ok)
    return {
        "concurrency": conc,
        "requests": n_requests,
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if not r["ok"]), None),
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": pct([r["ttft"] for r in ok], 50),
        "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
        "tpot_p50_s": pct([r["tpot"] for r in ok], 50),
        "tpot_p99_s": pct([r["tpot"] for r in ok], 99),
        "drafted": drafted,
        "accepted": acc,
        "steps": steps,
        "mean_accepted_tokens": mean_accepted_tokens_from_totals(acc, steps),
    }


def _fmt(v, scale=1.0, digits=1):
    return "-" if v is None else f"{v * scale:.{digits}f}"


def table(rows: list[dict]) -> str:
    head = (
        f"{'mode':6s} {'conc':>4s} {'ok':>5s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} "
        f"{'TPOT p50':>9s} {'TPOT p99':>9s} {'MAT':>5s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['mode']:6s} {r['concurrency']:4d} {r['ok']:>2d}/{r['requests']:<2d} "
            f"{_fmt(r['throughput_tok_s']):>7s} {_fmt(r['ttft_p50_s'], 1e3, 0):>7s}ms "
            f"{_fmt(r['ttft_p99_s'], 1e3, 0):>7s}ms {_fmt(r['tpot_p50_s'], 1e3, 0):>7s}ms "
            f"{_fmt(r['tpot_p99_s'], 1e3, 0):>7s}ms {_fmt(r['mean_accepted_tokens'], 1, 2):>5s}"
        )
    return "\n".join(lines)


def _soak(opts: LoadtestOptions, url, headers, levels) -> int:
    from .soak import run_soak

    if not 0 <= opts.disconnects <= MAX_REQUESTS:
        raise SpecDraftError(f"--disconnects must be in 0..{MAX_REQUESTS}, got {opts.disconnects}")
    methods = [m.strip() for m in opts.soak_methods.split(",") if m.strip()]
    out = run_soak(url, headers, levels, opts.requests, opts.disconnects, methods, opts.timeout)
    print(soak_table(out))
    with open(opts.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"saved {opts.out}", file=sys.stderr)
    return 0


def soak_table(out: dict) -> str:
    lines = [
        "| clients | requests | completed | errored | tok/s | latency p50 / p99 | TTFT p50 / p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["levels"]:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['completed']} | {r['errored']} | "
            f"{_fmt(r['tokens_per_s'])} | {_fmt(r['latency_p50_s'], 1, 2)} / {_fmt(r['latency_p99_s'], 1, 2)} s | "
            f"{_fmt(r['ttft_p50_s'], 1, 2)} / {_fmt(r['ttft_p99_s'], 1, 2)} s |"
        )
    g, d = out["greedy"], out["disconnects"]
    lines.append(f"\ngreedy under load vs alone: {g['identical']}/{g['greedy_checked']} identical")
    lines.append(f"disconnects: {d}")
    keys = ("rss_mb", "waiting", "running", "batch_rows", "cache_len", "draft_groups")
    for name in ("health_before", "after_load", "health_after"):
        h = out[name]
        lines.append(f"{name}: " + ", ".join(f"{k} {h[k]}" for k in keys if k in h))
    return "\n".join(lines)


def main_loadtest(opts: LoadtestOptions) -> int:
    httpx = require_module("httpx", "server", "specdraft loadtest")

    url = check_url(opts.url)
    key = opts.api_key or os.environ.get("SPECDRAFT_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    levels = parse_levels(opts.concurrency)
    if not 1 <= opts.requests <= MAX_REQUESTS:
        raise SpecDraftError(f"--requests must be in 1..{MAX_REQUESTS}, got {opts.requests}")
    if opts.max_tokens < 1:
        raise SpecDraftError(f"--max-tokens must be >= 1, got {opts.max_tokens}")
    if not 0 < opts.timeout <= 3600:
        raise SpecDraftError(f"--timeout must be in (0, 3600] seconds, got {opts.timeout}")
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if not modes or any(m not in ("spec", "plain") for m in modes):
        raise SpecDraftError(f"--modes must be a comma list of spec, plain; got {opts.modes!r}")
    spec = None
    if opts.spec:
        try:
            spec = json.loads(opts.spec)
        except json.JSONDecodeError as e:
            raise SpecDraftError(f"--spec is not valid JSON: {e}") from None
    try:
        h = httpx.get(url + "/health", timeout=10).json()
        model = httpx.get(url + "/v1/models", timeout=10, headers=headers).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise SpecDraftError(f"no specdraft server answers at {url}: {e}") from None
    if opts.soak:
        return _soak(opts, url, headers, levels)
    deadline = time.perf_counter() + opts.timeout
    rows = []
    for conc in levels:
        for mode in modes:
            r = run_level(
                url,
                model,
                conc,
                opts.requests,
                opts.max_tokens,
                {"method": "plain"} if mode == "plain" else spec,
                deadline,
                headers,
            )
            r["mode"] = mode
            rows.append(r)
            print(table([r]).splitlines()[-1], file=sys.stderr, flush=True)
    out = {
        "url": url,
        "model": model,
        "scheduler": h.get("scheduler"),
        "max_tokens": opts.max_tokens,
        "spec": spec,
        "results": rows,
    }
    print(table(rows))
    with open(opts.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"saved {opts.out}", file=sys.stderr)
    errors = sum(r["errors"] for r in rows)
    if errors:
        print(
            f"warning: {errors} request(s) failed; first: {next(r['first_error'] for r in rows if r['errors'])}",
            file=sys.stderr,
        )
    return 0
