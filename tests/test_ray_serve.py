"""serve --replicas on a local Ray instance (2 CPUs): two SmolLM2-135M fp32 replicas behind one endpoint.
Concurrent greedy requests, streamed and not, give the single engine's answers; both replicas serve;
/metrics and /health cover both; errors pass through; the router picks the least busy replica."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdraft.api import SpecDecoder
from specdraft.cli import _serve_settings, build_parser
from specdraft.models.hf import HFModel
from specdraft.scale.cluster import connect
from specdraft.server.front import Router, merge_metrics
from specdraft.server.local import app_in_thread
from specdraft.server.replicas import start_replicas

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, there was a",
    "1, 2, 3, 4, 5, 6,",
    "The quick brown fox",
    "Water boils at",
]
N = 10


@pytest.fixture(scope="module")
def front():
    ray = connect(None, num_cpus=2)
    a = build_parser().parse_args(
        [
            "serve",
            "--target",
            "smollm2-135m",
            "--backend",
            "hf",
            "--dtype",
            "float32",
            "--replicas",
            "2",
            "--max-batch",
            "4",
        ]
    )
    app = start_replicas(*_serve_settings(a))
    try:
        with app_in_thread(app) as url:
            yield url
    finally:
        ray.shutdown()


def complete(url, prompt, stream=False):
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": N, "temperature": 0, "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers["x-specdraft-replica"]
        if not stream:
            return json.loads(r.read())["choices"][0]["text"], replica
        text = ""
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
        return text, replica


@pytest.mark.long
def test_replicas_answer_as_one_engine(front, smol_f32):
    ref = SpecDecoder(HFModel(smol_f32.model, smol_f32.tokenizer, name="smol"))
    want = [ref.generate(p, sampling={"max_new_tokens": N}, spec={"method": "plain"}).text for p in PROMPTS]
    jobs = [(p, i % 2 == 1) for i, p in enumerate(PROMPTS)]  # half of them streamed
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: complete(front, *j), jobs))
    assert [t for t, _ in got] == want
    assert {r for _, r in got} == {"0", "1"}  # both replicas served
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(front + "/metrics").text)}
    served = {
        s.labels["replica"]: s.value
        for s in fams["specdraft_requests"].samples
        if s.name == "specdraft_requests_total" and s.labels.get("status") == "ok"
    }
    assert sorted(served) == ["0", "1"] and sum(served.values()) == len(PROMPTS)
    h = httpx.get(front + "/health").json()
    assert h["status"] == "ok" and [r["routed"] for r in h["replicas"]] == [3, 3]


@pytest.mark.long
def test_replica_errors_pass_through(front):
    r = httpx.post(front + "/v1/completions", json={"model": "smollm2-135m", "prompt": "x", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert httpx.get(front + "/v1/models").json()["data"][0]["id"] == "smollm2-135m"


def test_router_fewest_running():
    r = Router(["a", "b", "c"])
    assert [r.acquire() for _ in range(3)] == [0, 1, 2]
    r.release(1)
    assert r.acquire() == 1  # the only idle one
    r.release(0), r.release(2)
    assert {r.acquire(), r.acquire()} == {0, 2}
    assert r.stats() == {"running": 3, "waiting": 0}


def test_router_sends_a_conversation_to_the_replica_holding_its_history():
    """A later turn goes to the replica that served the earlier one (its prefix cache holds the history) while
    that one is at most one request busier than the least busy; another tenant's turn does not follow it."""
    from specdraft.server.front import history_of

    r = Router(["a", "b"])
    sys_msg = {"role": "system", "content": "You are a careful assistant who answers in full sentences. " * 2}
    turn1 = {"messages": [sys_msg, {"role": "user", "content": "hi"}]}
    turn2 = {
        "messages": turn1["messages"] + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    }
    other = {"messages": [{"role": "user", "content": "a different conversation altogether, long enough " * 3}]}
    h = [history_of(json.dumps(b).encode()) for b in (turn1, turn2, other)]
    assert h[1].startswith(h[0]) and not h[2].startswith(h[0][:64])
    first = r.acquire(h[0], "alice")
    r.release(first)
    r.acquire(h[2], "alice")  # busies the other replica... or the same: round robin takes the next one
    assert r.acquire(h[1], "alice") == first  # at most one busier: the history wins
    assert r.acquire(h[1], "bob") == 1 - first  # bob has no history there: round robin among the least busy
    r.acquire(h[2], "carol")  # now replica `first` holds 1 request, the other 2
    assert r.acquire(h[1] + b"{}\n", "alice") == first
    r.running[first] += 2  # the history's replica far busier than the other: load wins
    assert r.acquire(h[1] + b"{}\n{}\n", "alice") == 1 - first
    assert history_of(b"not json") is None and history_of(b'{"x": 1}') is None


def test_merge_metrics_labels_each_replica():
    text = '# HELP x_total help\n# TYPE x_total counter\nx_total{a="1"} 2.0\n'
    fams = list(text_string_to_metric_families(merge_metrics([text, text])))
    assert [(s.labels, s.value) for s in fams[0].samples] == [
        ({"replica": "0", "a": "1"}, 2.0),
        ({"replica": "1", "a": "1"}, 2.0),
    ]


def test_replica_options_checked():
    from specdraft.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
