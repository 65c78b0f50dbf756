"""A Ray cluster of two nodes on distinct addresses (tests/two_nodes_util.py: two network namespaces on this
machine, one CPU each): the cluster itself, serve --replicas with one replica per node, bench --ray sharded
across the nodes, and node B lost while it streams. SmolLM2-135M in float32, greedy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from two_nodes_util import ADDRESS, HEAD, WORKER, Cluster, cluster_env, two_nodes, why_not

pytest.importorskip("ray")
pytestmark = pytest.mark.long
REASON = why_not()
if REASON and os.environ.get("CI"):  # CI runs as root: there the cluster must be made, not skipped
    pytest.fail(f"two Ray nodes need two network namespaces: {REASON}", pytrace=False)
if REASON:
    pytest.skip(f"two Ray nodes need two network namespaces: {REASON}", allow_module_level=True)

KEY = "two-nodes-key"
PORT = 8791
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at", "The quick brown fox"]
N = 10

# A client run in node A's namespace: each request of argv[1] (JSON: [{path, body, key}]) at once, through
# argv[2]; prints one JSON line per request: status, replica, text, the error event if a stream carried one.
CLIENT = r"""
import json, sys
from concurrent.futures import ThreadPoolExecutor
import httpx

def one(req):
    headers = {"Authorization": "Bearer " + req["key"]} if req.get("key") else {}
    out = {"text": "", "error": None}
    with httpx.stream("POST", sys.argv[2] + req["path"], json=req["body"], headers=headers, timeout=300) as r:
        out.update(status=r.status_code, replica=r.headers.get("x-specdraft-replica"))
        if not req["body"].get("stream"):
            body = json.loads(r.read())
            out["text"] = body["choices"][0]["text"] if r.status_code == 200 else None
            out["error"] = body.get("error")
            return out
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    out["error"] = event["error"]
                else:
                    out["text"] += event["choices"][0]["text"]
                    print("chunk", file=sys.stderr, flush=True)
    return out

reqs = json.loads(sys.argv[1])
with ThreadPoolExecutor(len(reqs)) as pool:
    for res in pool.map(one, reqs):
        print(json.dumps(res), flush=True)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with two_nodes(tmp_path_factory.mktemp("two_nodes")) as c:
        yield c


def test_two_nodes_alive_on_distinct_addresses(cluster):
    nodes = cluster.nodes()
    assert sorted(n["address"] for n in nodes if n["alive"]) == [HEAD, WORKER]


def test_a_node_that_cannot_join_fails_the_cluster(tmp_path):
    """The fixture fails (and leaves nothing behind) when the second node does not join."""
    c = Cluster(cluster_env(tmp_path, "x", TWO_NODES_JOIN="198.18.0.9", TWO_NODES_JOIN_TIMEOUT="5"))
    done = c.script("up", check=False)
    assert done.returncode != 0 and "node B did not join" in done.stderr
    assert not (tmp_path / "cluster").exists()


def bench_runs(tmp_path, prompts: list[str], new_tokens: int, methods: str) -> tuple[list[str], list[str]]:
    """The bench's arguments on ``prompts`` for one process and for both nodes' workers (each with --out)."""
    dataset = tmp_path / "q.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"question_id": f"p{i}", "category": "qa", "turns": [p]}) + "\n" for i, p in enumerate(prompts)
        )
    )
    args = [sys.executable, "-m", "specdraft.cli", "bench", "--target", "smollm2-135m", "--dtype", "float32"]
    args += ["--dataset", str(dataset), "--max-new-tokens", str(new_tokens), "--methods", methods]
    args += ["--threads", "1", "--no-plots"]
    one = args + ["--out", str(tmp_path / "one.json")]
    two = args + [
        "--out",
        str(tmp_path / "two.json"),
        f"--ray={ADDRESS}",
        "--ray-workers",
        "2",
        "--ray-worker-cpus",
        "1",
    ]
    return one, two


def test_bench_sharded_across_two_nodes_equals_one_node(cluster, tmp_path):
    """(Before the replicas start: they hold both nodes' CPUs.)"""
    one_run, two_run = bench_runs(tmp_path, PROMPTS, 8, "plain,prompt_lookup")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    cluster.run("A", *one_run)
    cluster.run("A", *two_run)
    tokens = lambda p: {(r["prompt_id"], r["method"]): r["token_ids"] for r in json.loads(p.read_text())["records"]}  # noqa: E731
    assert tokens(two) == tokens(one) and len(tokens(one)) == 2 * len(PROMPTS)
    hosts = {r.get("node", {}).get("address") for r in json.loads(two.read_text())["records"]}
    assert hosts >= {HEAD, WORKER}, hosts


# The target in node A's namespace, its draft (the target's first 26 layers) in an actor on node B: greedy
# output and accepted counts equal the draft model drafting in the target's own process. argv: the spec's
# ray_address and remote_node. Prints one JSON line.
REMOTE = r"""
import json, sys
from specdraft.api import SpecDecoder

dec = SpecDecoder.load("smollm2-135m", draft="smollm2-135m", draft_layers=26, dtype="float32", backend="hf")
out = {"plain": [], "local": [], "remote": [], "local_accepted": [], "remote_accepted": []}
remote = {"method": "remote_draft", "k": 3, "ray_address": sys.argv[1], "remote_node": sys.argv[2]}
for prompt in json.loads(sys.argv[3]):
    ids = dec.encode(prompt)
    sp = {"max_new_tokens": 16}
    out["plain"].append(dec.generate(ids, sampling=sp, spec={"method": "plain"}).token_ids)
    for name, spec in (("local", {"method": "draft_model", "k": 3}), ("remote", remote)):
        r = dec.generate(ids, sampling=sp, spec=spec)
        out[name].append(r.token_ids)
        out[name + "_accepted"].append(r.stats.accepted)
actor = next(iter(dec._shared["remote_draft"].values())).actor
import ray
out["draft_node"] = ray.get(actor.ping.remote())
print(json.dumps(out))
"""


def test_draft_on_node_b_target_on_node_a(cluster):
    """(Before the replicas start: they hold both nodes' CPUs.)"""
    out = json.loads(cluster.python("A", REMOTE, ADDRESS, WORKER, json.dumps(PROMPTS[:2])).strip().splitlines()[-1])
    assert out["draft_node"] == WORKER
    assert out["remote"] == out["local"] == out["plain"]
    assert out["remote_accepted"] == out["local_accepted"] and sum(out["local_accepted"]) > 0
    bad = cluster.run("A", sys.executable, "-c", REMOTE, ADDRESS, "198.18.0.9", json.dumps(PROMPTS[:1]), check=False)
    assert bad.returncode != 0 and "remote_node '198.18.0.9' is no alive node" in bad.stderr


def test_bench_redoes_the_prompts_of_a_lost_node(cluster, tmp_path):
    """Node B stopped while the sharded bench runs: its unfinished prompt is redone on node A, and the records
    equal one node's, none lost, none twice; node B then joins again. (Before the replicas start.)"""
    one_run, two_run = bench_runs(tmp_path, [f"Count from {i} to {i + 30}:" for i in range(8)], 24, "plain")
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    cluster.run("A", *one_run)
    run = cluster.popen(
        "A",
        *two_run,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    t0 = time.time()
    while not two.exists() or len(json.loads(two.read_text())["records"]) < 2:  # both workers under way
        assert run.poll() is None and time.time() - t0 < 240, run.stderr.read() if run.poll() is not None else ""
        time.sleep(0.5)
    cluster.script("stop", "B")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    recs = json.loads(two.read_text())["records"]
    ids = [r["prompt_id"] for r in recs]
    assert sorted(ids) == sorted(set(ids)) == [f"p{i}" for i in range(8)]  # none lost, none twice
    assert {r["prompt_id"]: r["token_ids"] for r in recs} == {
        r["prompt_id"]: r["token_ids"] for r in json.loads(one.read_text())["records"]
    }
    assert {r["node"]["address"] for r in recs} == {HEAD, WORKER}
    cluster.script("start", "B")
    assert sorted(n["address"] for n in cluster.nodes() if n["alive"]) == [HEAD, WORKER]


def test_eagle3_data_across_nodes_with_node_b_lost(cluster, tmp_path):
    """train eagle3 --data-only --ray over both nodes, node B stopped mid-run: answers.jsonl holds every prompt's
    answer once, token for token one process's, with features for all; node B joins again. (Before the
    replicas start.)"""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count from {i} to {i + 30}:"}) + "\n" for i in range(8)))
    args = ["train", "eagle3", "--target", "smollm2-135m", "--gen-backend", "hf", "--data", str(prompts)]
    args += ["--data-only", "--max-new-tokens", "24", "--gen-batch", "1", "--threads", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    cluster.run("A", sys.executable, "-m", "specdraft.cli", *args, "-o", str(one))
    run = cluster.popen(
        "A",
        sys.executable,
        "-m",
        "specdraft.cli",
        *args,
        "-o",
        str(two),
        f"--ray={ADDRESS}",
        "--ray-workers",
        "2",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    answers = two / "data" / "answers.jsonl"
    t0 = time.time()
    while not answers.exists() or len(answers.read_text().splitlines()) < 2:  # both workers under way
        assert run.poll() is None and time.time() - t0 < 240, run.stderr.read() if run.poll() is not None else ""
        time.sleep(0.5)
    cluster.script("stop", "B")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    rows = lambda d: [json.loads(line) for line in (d / "data" / "answers.jsonl").read_text().splitlines()]  # noqa: E731
    got = rows(two)
    assert sorted(r["i"] for r in got) == list(range(8))  # none lost, none twice
    assert {r["i"]: r["tokens"] for r in got} == {r["i"]: r["tokens"] for r in rows(one)}
    assert json.loads(out.strip().splitlines()[-1])["n_seqs"] == 8
    assert len((two / "data" / "features.jsonl").read_text().splitlines()) == 8  # features for every answer
    assert "eagle3 answers on Ray" in err and WORKER in err
    cluster.script("start", "B")


def request(prompt: str, stream: bool = False, max_tokens: int = N, key: str | None = KEY) -> dict:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return {"path": "/v1/completions", "body": body, "key": key}


def send(cluster: Cluster, url: str, reqs: list[dict]) -> list[dict]:
    out = cluster.python("A", CLIENT, json.dumps(reqs), url)
    return [json.loads(line) for line in out.strip().splitlines()]


def health(cluster: Cluster, url: str) -> dict:
    code = "import httpx, sys; print(httpx.get(sys.argv[1] + '/health', headers={'Authorization': 'Bearer %s'}).text)"
    return json.loads(cluster.python("A", code % KEY, url))


@pytest.fixture(scope="module")
def served(cluster):
    """serve --replicas 2 on the cluster, its front on node A."""
    proc = cluster.popen(
        "A",
        sys.executable,
        "-m",
        "specdraft.cli",
        "serve",
        "--target",
        "smollm2-135m",
        "--backend",
        "hf",
        "--dtype",
        "float32",
        "--replicas",
        "2",
        "--ray-address",
        ADDRESS,
        "--api-key",
        KEY,
        "--host",
        HEAD,
        "--port",
        str(PORT),
    )
    url = f"http://{HEAD}:{PORT}"
    try:
        t0 = time.time()
        while True:
            assert proc.poll() is None, "serve exited"
            try:
                if health(cluster, url)["status"] == "ok":
                    break
            except (AssertionError, ValueError):
                pass
            assert time.time() - t0 < 180, "the replicas did not start within 180 s"
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_replicas_one_per_node_answer_as_one_engine(cluster, served, smol_f32):
    from specdraft.api import SpecDecoder

    h = health(cluster, served)
    assert h["status"] == "ok" and sorted(r["node"] for r in h["replicas"]) == [HEAD, WORKER]
    ref = SpecDecoder(smol_f32)
    want = [ref.generate(p, sampling={"max_new_tokens": N}, spec={"method": "plain"}).text for p in PROMPTS]
    got = send(cluster, served, [request(p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)])
    assert [g["text"] for g in got] == want
    assert {g["replica"] for g in got} == {"0", "1"}  # both nodes answered
    # the key is enforced at the front and at each replica reached directly
    assert send(cluster, served, [request(PROMPTS[0], key=None)])[0]["status"] == 401
    for r in h["replicas"]:
        assert send(cluster, r["url"], [request(PROMPTS[0], key=None)])[0]["status"] == 401


def test_node_lost_mid_stream(cluster, served):
    """Node B's Ray stopped while both replicas stream: B's request ends with an OpenAI error event, A's
    completes, /health says degraded and names B's replica, and the front keeps answering from A."""
    client = cluster.popen(
        "A",
        sys.executable,
        "-c",
        CLIENT,
        json.dumps(
            [request(PROMPTS[0], stream=True, max_tokens=200), request(PROMPTS[1], stream=True, max_tokens=200)]
        ),
        served,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    for _ in range(4):  # both streams under way
        assert client.stderr.readline().strip() == "chunk"
    cluster.script("stop", "B")
    out, _ = client.communicate(timeout=300)
    got = [json.loads(line) for line in out.strip().splitlines()]
    lost = [g for g in got if g["error"]]
    assert len(lost) == 1 and lost[0]["error"]["code"] == "replica_unavailable"
    assert [g for g in got if not g["error"]][0]["text"]
    h = health(cluster, served)
    assert h["status"] == "degraded"
    assert [r["node"] for r in h["replicas"] if r["status"] == "unreachable"] == [WORKER]
    after = send(cluster, served, [request(p) for p in PROMPTS[:2]])
    assert all(g["status"] == 200 and g["text"] for g in after)
