"""What the replicas' front and the network add to a request: the same greedy completion (SmolLM2-135M,
float32, 32 tokens) sent through the front and straight to the replica the front chose, one at a time,
interleaved. Run inside node A with `serve --replicas 2` up on the two-namespace cluster (docs/scale.md):

    scripts/two_nodes.sh run A .venv/bin/python docs/results/two_nodes/front_overhead.py URL KEY

Prints one JSON line: median seconds per request through the front and direct, per replica, and the ratio."""

import json
import statistics
import sys
import time

import httpx

url, key = sys.argv[1], sys.argv[2]
auth = {"Authorization": f"Bearer {key}"}
replicas = httpx.get(url + "/health", headers=auth).json()["replicas"]
body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}
times: dict[str, list[float]] = {}
for rnd in range(11):  # the first round warms up
    for r in replicas:
        for via, base in (("front", url), ("direct", r["url"])):
            t0 = time.perf_counter()
            resp = httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=120)
            dt = time.perf_counter() - t0
            served = resp.headers.get("x-specdraft-replica", str(r["replica"]))
            if rnd and served == str(r["replica"]):
                times.setdefault(f"{via} {r['node']}", []).append(dt)
med = {k: round(statistics.median(v), 4) for k, v in times.items()}
ratio = {
    r["node"]: round(med[f"front {r['node']}"] / med[f"direct {r['node']}"], 3)
    for r in replicas
    if f"front {r['node']}" in med
}
print(json.dumps({"seconds": med, "front_over_direct": ratio, "n": {k: len(v) for k, v in times.items()}}))
