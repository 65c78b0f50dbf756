"""The HTTP client side of ``specdraft loadtest`` and its ``--soak``: the prompts they send and one
request to /v1/completions, streamed or not, timed."""

from __future__ import annotations

import json
import time

import numpy as np

PROMPTS = [
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n",
    "The history of the Roman Empire begins with",
    "Here is a list of the first twenty even numbers: 2, 4, 6, 8, 10,",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Summarize: The cat sat on the mat. The cat was happy. The mat was red. Summary: The cat",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import json\n\ndef load_config(path):\n    with open(path) as f:\n",
    "Once upon a time, in a small village by the sea, there lived",
]


def send(client, body: dict, cut_after: int | None = None) -> dict:
    """One request to /v1/completions, streamed or not (``body["stream"]``): ok, latency, ttft (a
    non-streamed request's is its latency), text, tokens, usage; or ok False with the error.
    ``cut_after``: close the connection after that many stream chunks (a client disconnecting)."""
    import httpx

    t0 = time.perf_counter()
    first, text, chunks, usage = None, [], 0, None
    try:
        if not body.get("stream"):
            r = client.post("/v1/completions", json=body)
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
            d = r.json()
            text, usage = [d["choices"][0]["text"]], d["usage"]
        else:
            with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:200]}"}
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if "error" in d:
                        return {"ok": False, "error": d["error"]["message"]}
                    chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        return {"ok": False, "cut": True, "error": "disconnected on purpose"}
                    if d.get("choices") and d["choices"][0].get("text"):
                        first = first or time.perf_counter()
                        text.append(d["choices"][0]["text"])
                    usage = d.get("usage") or usage
    except httpx.HTTPError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    return {
        "ok": True,
        "start": t0,
        "end": end,
        "latency": end - t0,
        "ttft": (first or end) - t0,
        "text": "".join(text),
        "tokens": usage["completion_tokens"] if usage else None,
        "usage": usage,
    }


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None
