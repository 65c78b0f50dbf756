"""``specdraft loadtest --soak``: a bounded soak of a local server.

1. Mixed load at each concurrency level: streaming and not, greedy and sampled, the methods given,
   max_tokens drawn from a small set. Reported per level: completed / errored, p50 / p99 latency and
   time to first token, tokens/s.
2. Every greedy answer under load is compared with the same request sent alone afterwards (all of
   them; identical requests are sent alone once).
3. Disconnects: requests whose clients go away at random points, before the first byte (often still
   queued) or after a random number of streamed chunks.
4. The server's /health before and after (resident memory, queue, batch rows, cache length): nothing
   may grow without bound once the load is gone.

Loopback only, bounded in requests and time, like the rest of loadtest.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .client import PROMPTS, pct, send

MAX_TOKENS = (8, 16, 32, 64)


def _request(i: int, rng: random.Random, methods: list[str], lengths=MAX_TOKENS) -> dict:
    greedy = rng.random() < 0.6
    body = {
        "prompt": PROMPTS[i % len(PROMPTS)],
        "max_tokens": rng.choice(lengths),
        "ignore_eos": True,
        "temperature": 0 if greedy else 0.8,
        "spec": {"method": rng.choice(methods)},
        "stream": rng.random() < 0.5,
    }
    if not greedy:
        body["seed"] = i
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


def health(client: httpx.Client) -> dict:
    return client.get("/health").json()


def mixed_level(client_for, conc: int, n: int, methods: list[str], seed: int, lengths=MAX_TOKENS) -> tuple[dict, list]:
    rng = random.Random(seed)
    bodies = [_request(seed * 10_000 + i, rng, methods, lengths) for i in range(n)]
    out = [None] * n

    def task(i):
        out[i] = send(client_for(), bodies[i])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=conc) as ex:
        list(ex.map(task, range(n)))
    wall = time.perf_counter() - t0
    ok = [r for r in out if r["ok"]]
    tokens = sum(r["tokens"] or 0 for r in ok)
    row = {
        "concurrency": conc,
        "requests": n,
        "completed": len(ok),
        "errored": n - len(ok),
        "first_error": next((r.get("error") for r in out if not r["ok"]), None),
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": pct([r["latency"] for r in ok], 50),
        "latency_p99_s": pct([r["latency"] for r in ok], 99),
        "ttft_p50_s": pct([r["ttft"] for r in ok], 50),
        "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
    }
    return row, list(zip(bodies, out))


def greedy_check(client: httpx.Client, pairs: list) -> dict:
    """Every greedy answer under load against the same request alone (sent once per distinct request)."""
    alone: dict = {}
    same = differ = 0
    examples = []
    for body, res in pairs:
        if body["temperature"] != 0 or not res["ok"]:
            continue
        key = (body["prompt"], body["max_tokens"], body["spec"]["method"])
        if key not in alone:
            alone[key] = send(client, {**body, "stream": False})["text"]
        if res["text"] == alone[key]:
            same += 1
        else:
            differ += 1
            examples.append({"request": key, "under_load": res["text"][:80], "alone": alone[key][:80]})
    return {"greedy_checked": same + differ, "identical": same, "different": differ, "examples": examples[:5]}


def disconnects(client_for, n: int, conc: int, methods: list[str], seed: int, max_tokens: int = 64) -> dict:
    """``n`` requests whose clients leave early: half before the first byte (a client timeout, often
    while queued), half after a random number of stream chunks."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        body = _request(i, rng, methods)
        body.update(stream=True, max_tokens=max_tokens)
        plans.append((body, rng.choice([0, 1, 2, 4, 8])))
    counts = {"cut_before_first_byte": 0, "cut_mid_stream": 0, "completed": 0, "errors": 0}
    lock = threading.Lock()

    def task(i):
        body, cut = plans[i]
        if cut == 0:
            c = httpx.Client(
                base_url=client_for().base_url, timeout=rng.uniform(0.01, 0.3), headers=client_for().headers
            )
            r = send(c, body)
            c.close()
            kind = "completed" if r["ok"] else "cut_before_first_byte"
        else:
            r = send(client_for(), body, cut_after=cut)
            kind = "completed" if r["ok"] else ("cut_mid_stream" if r.get("cut") else "errors")
        with lock:
            counts[kind] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=conc) as ex:
        list(ex.map(task, range(n)))
    counts["wall_s"] = time.perf_counter() - t0
    return counts


def run_soak(
    url: str,
    headers: dict | None,
    levels: list[int],
    per_level: int,
    n_disconnects: int,
    methods: list[str],
    timeout: float,
    lengths=MAX_TOKENS,
) -> dict:
    """``lengths``: the max_tokens values requests draw from (the disconnect phase uses the largest)."""
    local = threading.local()

    def client_for() -> httpx.Client:
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=url, timeout=timeout, headers=headers)
        return local.c

    main = httpx.Client(base_url=url, timeout=timeout, headers=headers)
    before = health(main)
    out = {"levels": [], "health_before": before}
    pairs = []
    for j, conc in enumerate(levels):
        row, p = mixed_level(client_for, conc, per_level, methods, seed=j + 1, lengths=lengths)
        out["levels"].append(row)
        pairs += p
    out["after_load"] = health(main)
    out["greedy"] = greedy_check(main, pairs)
    out["disconnects"] = disconnects(client_for, n_disconnects, max(levels), methods, seed=99, max_tokens=max(lengths))
    t0 = time.perf_counter()  # cancelled rows leave at the server's next step; give it a moment
    while (h := health(main)).get("running", 0) or h.get("waiting", 0):
        if time.perf_counter() - t0 > 60:
            break
        time.sleep(0.2)
    out["health_after"] = h
    return out
