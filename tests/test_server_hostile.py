"""Issue 29's regression tests: a bad or unlucky request hurts only itself. Each test failed before its
fix (the item it guards is named): bounded spec fields named in the 400 (1, 9), a worker thread that
cannot die and a /health that says when it did (1), constraints that rule out every token (2), request
paths (4), fixed-only leaks (5), /health without the key (6), logit_bias "²" (7), llama.cpp tree room (8)
and the keyless server's origin checks."""

import json
import os
import threading
import time

import httpx
import pytest
import torch

from conftest import tiny_llama
from server_util import REQUEST_COUNTS, metric_samples, running_server
from specdraft.api import SpecDecoder, _cached
from specdraft.cli import main
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import SpecDraftError
from specdraft.core.sampling import sample
from specdraft.drafters.base import NoDrafter
from specdraft.engine import Engine, generate
from specdraft.server.pacing import StreamPacing
from specdraft.server.scheduler import BaseWorker
from test_server_fast import StubTok, tiny_pair

JSON = {"Content-Type": "application/json"}
BODY = {"prompt": [1, 2, 3, 1, 2], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def batch_server():
    with running_server(
        tiny_pair(), model_name="tiny", default_spec={"method": "prompt_lookup", "k": 2}, max_batch=4, timeout_s=60
    ) as (url, app):
        yield url, app


def post(url, body, path="/v1/completions", **kw):
    return httpx.post(url + path, json=body, timeout=30, **kw)


@pytest.mark.parametrize(
    "spec,param",
    [
        ({"method": "prompt_lookup", "schedule": "cost_aware", "k": 10**30}, "spec.k"),  # item 1: killed the worker
        ({"method": "lookahead", "lookahead_window": 300, "lookahead_ngram": 300}, "spec.lookahead_window"),
        (
            {"method": "lookahead", "lookahead_window": 60, "lookahead_max_ngrams": 60, "lookahead_ngram": 8},
            "spec.lookahead_window",
        ),
        ({"method": "token_recycling", "recycle_branching": [4096]}, "spec.recycle_branching"),
        ({"method": "prompt_lookup", "branches": 300}, "spec.branches"),
        ({"method": "prompt_lookup", "branches": 20, "k": 20}, "spec.branches"),
        ({"method": "draft_model", "tree": "static", "tree_branching": [300]}, "spec.tree_branching"),
        ({"method": "draft_model", "tree": "dynamic", "tree_topk": 10**6}, "spec.tree_topk"),
        ({"method": "draft_model", "tree": "dynamic", "tree_budget": 10**6}, "spec.tree_budget"),
        ({"method": "suffix", "tree_nodes": 10**9}, "spec.tree_nodes"),
        ({"method": "cascade", "cascade_k": 10**9}, "spec.cascade_k"),
        ({"method": "hybrid", "retrieval_k": 10**9}, "spec.retrieval_k"),
    ],
)
def test_unbounded_spec_fields_are_400s_naming_the_field(batch_server, spec, param):
    """Items 1 and 9: every size a client picks is bounded; the 400 names the field; the worker lives on."""
    url, app = batch_server
    r = post(url, {**BODY, "spec": spec})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert post(url, BODY).status_code == 200
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"


def test_logit_bias_superscript_digit_is_a_400(batch_server):
    """Item 7: "²".isdigit() is True but int("²") raises: it was a 500."""
    r = post(batch_server[0], {**BODY, "logit_bias": {"²": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_a_drafter_bug_fails_its_request_only_and_the_loop_survives(batch_server, monkeypatch):
    """Item 1's root: an exception other than SpecDraftError while admitting a request (the cost curve's
    TypeError) escaped the batch worker's loop; its thread died and every later request hung."""
    url, app = batch_server
    worker = app.state.worker
    real = worker.decoder.make_drafter

    def make(spec):
        if spec.k == 3:
            raise TypeError("injected")
        return real(spec)

    monkeypatch.setattr(worker.decoder, "make_drafter", make)
    r = post(url, {**BODY, "spec": {"method": "prompt_lookup", "k": 3}})
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error" and "Traceback" not in r.text
    assert post(url, BODY).status_code == 200
    # anything escaping the loop itself: the loop restarts, later requests are served
    real_admit, calls = worker._admit, []

    def admit(jobs):
        if not calls:  # fail with jobs taken from the queue and not admitted yet
            calls.append(1)
            raise RuntimeError("injected into the loop")
        return real_admit(jobs)

    monkeypatch.setattr(worker, "_admit", admit)
    restarts = worker.restarts
    # the request the loop held when it failed fails with it (it must not hang); the next one is served
    assert post(url, BODY).status_code == 500
    assert post(url, BODY).status_code == 200 and worker.restarts == restarts + 1
    assert worker._thread.is_alive()


def test_health_reports_a_dead_or_stuck_worker():
    """A watchdog: /health is not ok when the worker thread ended or one step runs too long."""

    class Ends(BaseWorker):
        kind = "test"

        def num_running(self):
            return 0

        def _loop(self):
            return

    class Metrics:
        class _G:
            def set(self, v):
                pass

        queue_depth = running = _G()

    w = Ends(None, Metrics(), 4).start()
    w._thread.join(5)
    assert w.health(60) == "dead"
    t = tiny_llama(vocab=16)
    t.tokenizer = StubTok()
    with running_server(SpecDecoder(t, None), stuck_after_s=0.5) as (url, app):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        app.state.worker.busy_since = time.monotonic() - 1  # one step "running" for a second
        r = httpx.get(url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "worker stuck"
        app.state.worker.busy_since = None


def test_health_without_the_key_says_only_up():
    """Item 6: queue, rows and cache_len move with each step's accepted drafts: the key's holders only
    (and nobody's on a fixed-only server without a key)."""
    t = tiny_llama(vocab=16)
    t.tokenizer = StubTok()
    dec = SpecDecoder(t, None)
    with running_server(dec, api_key="k3y", max_batch=2) as (url, app):
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
        h = httpx.get(url + "/health", headers={"Authorization": "Bearer k3y"}, timeout=10).json()
        assert h["status"] == "ok" and "cache_len" in h and "running" in h
    with running_server(dec, max_batch=2, stream_pacing=StreamPacing(locked=True)) as (url, app):
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}


def test_fixed_only_hides_acceptance_and_paces_plain_answers():
    """Item 5: in fixed mode a non-streamed answer leaves on the stream's grid, and no usage (streamed
    or not) counts steps or accepted drafts."""
    pacing = StreamPacing(chunk_tokens=4, interval_s=0.2, pad_bytes=0, locked=True)
    with running_server(
        tiny_pair(), model_name="tiny", default_spec={"method": "draft_model", "k": 4}, stream_pacing=pacing
    ) as (url, app):
        t0 = time.monotonic()
        r = post(url, {**BODY, "max_tokens": 8})
        took = time.monotonic() - t0
        assert r.status_code == 200 and took >= 0.35, took  # 8 tokens = 2 chunks: ticks 1 and 2, then the end
        u = r.json()["usage"]
        assert u["completion_tokens"] == 8 and not {"steps", "drafted", "accepted", "acceptance_rate"} & set(u)
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=30,
            json={**BODY, "stream": True, "stream_options": {"include_usage": True}},
        ) as s:
            raw = s.read().decode()
        usage = [json.loads(e[6:])["usage"] for e in raw.split("\n\n") if e.startswith("data: {") and '"usage"' in e]
        assert usage and not {"steps", "drafted", "accepted"} & set(usage[-1])


def test_request_paths_are_refused_without_opening_them(batch_server, tmp_path):
    """Item 4: a FIFO named by spec.skip_config froze the event loop (and /health); error messages told
    which files exist. A request names only what the operator configured, by name."""
    url, app = batch_server
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for spec in [
        {"method": "layer_skip", "skip_config": str(fifo)},
        {"method": "suffix", "datastore": "/etc"},
        {"method": "medusa", "head": "/etc/hostname"},
        {"method": "auto", "autotune": "/dev/zero"},
    ]:
        r = post(url, {**BODY, "spec": spec})
        field = next(k for k in spec if k != "method")
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == f"spec.{field}" and "may not name a file path" in err["message"]
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_keyless_server_takes_json_from_its_own_host_only(batch_server):
    """Suspected item: a keyless loopback server took cross-site form posts (any Content-Type) and any
    Host (DNS rebinding)."""
    url = batch_server[0]
    raw = json.dumps(BODY)
    assert httpx.post(url + "/v1/completions", content=raw, headers=JSON, timeout=30).status_code == 200
    r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(url + "/v1/completions", content=raw, headers={**JSON, "Host": "evil.example:80"}, timeout=30)
    assert r.status_code == 421


def test_replica_front_limits_the_body_before_relaying():
    """Suspected item: the replica front read any body whole (only replicas enforced the limit)."""
    from fastapi.testclient import TestClient

    from specdraft.server.front import create_front

    front = create_front(["http://127.0.0.1:9"], max_body_bytes=1000, allowed_hosts=("testserver",))
    with TestClient(front) as c:
        r = c.post("/v1/completions", content=b"x" * 5000, headers=JSON)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert c.get("/health").json().keys() == {"status"} or "replicas" in c.get("/health").json()


def test_sample_refuses_rows_without_a_token():
    """Item 2: sample() returned V (out of range) for a NaN row and 0 for an all-zero one."""
    for bad in (torch.full((1, 5), float("nan")), torch.zeros(1, 5), torch.tensor([[0.2, float("inf"), 0, 0, 0]])):
        with pytest.raises(SpecDraftError, match="no token can be sampled"):
            sample(bad, torch.Generator().manual_seed(0))
    assert int(sample(torch.tensor([[0.0, 1.0, 0.0]]), None)) == 1


def test_a_row_whose_constraints_leave_no_token_fails_alone():
    """Item 2, in the engine: a row whose processing masks every token finishes "error" with a clear
    message; the other row's tokens equal decoding alone."""
    target = tiny_llama(vocab=8)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    bad_sp = SamplingParams(max_new_tokens=6, ignore_eos=True, logit_bias={1: 1.0})
    alone = generate(target, NoDrafter(), [1, 2, 3], sp, eos_ids=set()).token_ids
    eng = Engine(target, eos_ids=set())
    good = eng.add([1, 2, 3], sp, NoDrafter())
    bad = eng.add([4, 5], bad_sp, NoDrafter())
    bad.processor.process = lambda x, history, tree=None: torch.full_like(x, float("-inf"))
    while eng.rows:
        eng.step()
    assert good.result.token_ids == alone
    assert bad.finish == "error" and "rule out every token" in str(bad.error)


def test_grammar_complete_before_min_tokens_ends_with_eos(smol_f32):
    """Item 2 on SmolLM2: a choice completes in fewer tokens than min_tokens. Greedy emitted a token the
    grammar forbids ([94, 95, 0, 0, 0, 0, 2]), sampling drew from NaN and failed the whole batch. Now the
    complete grammar ends the output (EOS wins over min_tokens), next to a normal request that decodes
    exactly as alone."""
    with running_server(
        SpecDecoder(smol_f32, None),
        model_name="smol",
        max_batch=4,
        default_spec={"method": "prompt_lookup"},
        timeout_s=120,
    ) as (url, app):
        base = {
            "prompt": "Answer yes or no: is the sky blue?",
            "guided_choice": ["yes", "no"],
            "min_tokens": 6,
            "max_tokens": 8,
        }
        normal = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        want = post(url, normal).json()["choices"][0]["text"]
        out = {}

        def send(name, body):
            out[name] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        ts = [
            threading.Thread(target=send, args=a)
            for a in [
                ("greedy", {**base, "temperature": 0}),
                ("sampled", {**base, "temperature": 1.0, "seed": 1}),
                ("normal", normal),
            ]
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        for name in ("greedy", "sampled"):
            r = out[name]
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] in ("yes", "no") and r.json()["choices"][0]["finish_reason"] == "stop"
        assert out["normal"].json()["choices"][0]["text"] == want
        h = httpx.get(url + "/health", timeout=10).json()
        assert h["running"] == 0 and h["batch_rows"] == 0


def test_spec_caches_are_bounded():
    """Item 9: per-spec caches (cost-aware policies, auto's memories, Token Recycling tables) were kept
    forever, one per distinct client spec."""
    from collections import OrderedDict

    cache = OrderedDict()
    for i in range(100):
        _cached(cache, i, lambda: object(), limit=8)
    assert list(cache) == list(range(92, 100))
    dec = SpecDecoder(tiny_llama(vocab=16), None)
    for i in range(80):
        dec.policy_for(SpecConfig(method="prompt_lookup", schedule="cost_aware", typical_delta=float(i)))
    assert len(dec._policies) <= 64


@pytest.fixture(scope="module")
def small_llama(smol_gguf):
    """SmolLM2 Q4_1 on llama.cpp with a 256-cell context shared by all rows."""
    pytest.importorskip("llama_cpp")
    from specdraft.models.llama import LlamaModel

    return LlamaModel(smol_gguf.path, smol_gguf.tokenizer, n_ctx=256)


def test_llama_failed_prefill_leaves_no_phantom_row(small_llama):
    """Item 3: a prefill refused for a full context kept its sequence id and length; the next row then
    decoded in that empty sequence, without its own prompt (wrong output, silently)."""
    from specdraft.core.errors import ContextLengthError

    prompt = small_llama.tokenize("The capital of France is", special=False)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = generate(small_llama, NoDrafter(), prompt, sp).token_ids
    eng = Engine(small_llama)
    eng.add([5] * 200, SamplingParams(max_new_tokens=8, ignore_eos=True), NoDrafter())
    with pytest.raises(ContextLengthError):
        eng.kv.add_rows([[7] * 120])  # 200 + 120 cells > 256
    assert eng.kv.B == 1 and eng.kv.draft_room()[0] == 255
    eng.cancel(eng.rows[0])
    row = eng.add(prompt, sp, NoDrafter())
    while eng.rows:
        eng.step()
    assert row.result.token_ids == alone


class Wide(NoDrafter):
    """Drafts a flat tree of ``n`` leaves (children of the pending token) whenever it may draft."""

    name = "wide"

    def __init__(self, n: int):
        self.n = n

    def propose(self, tokens, max_tokens):
        from specdraft.core.tree import DraftTree

        if max_tokens < 1:
            return DraftTree.empty()
        return DraftTree(torch.arange(self.n) % 1000 + 100, torch.full((self.n,), -1, dtype=torch.long))


def test_llama_trees_fit_the_free_sequences_and_cells(small_llama):
    """Item 8: trees with more leaves than free sequence ids raised inside the shared forward and failed
    every row; a request exactly filling the context failed because its tree needed cells beyond it.
    (Prompts without a near-tie in their first tokens: a tree's cache holes move llama.cpp's logits a little.)"""
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [small_llama.tokenize(p, special=False) for p in ("One two three", "The capital of France is")]
    alone = [generate(small_llama, NoDrafter(), p, sp).token_ids for p in prompts]
    eng = Engine(small_llama)
    rows = [eng.add(p, sp, Wide(150)) for p in prompts]  # 300 leaves: more than the 256 sequence ids
    while eng.rows:
        eng.step()
    assert [r.error for r in rows] == [None, None] and [r.result.token_ids for r in rows] == alone
    prompt = (prompts[0] * 80)[:240]
    full = SamplingParams(max_new_tokens=256 - len(prompt), ignore_eos=True)  # prompt + output = the context
    eng = Engine(small_llama)
    row = eng.add(prompt, full, Wide(40))
    while eng.rows:
        eng.step()
    assert row.error is None and len(row.result.token_ids) == 256 - len(prompt)


def moved_by_one_request(url, body, headers=None, victim=None) -> dict:
    """The /metrics samples one request (sent with ``victim`` headers) changes, as an observer reading before
    and after (with ``headers``) sees them."""
    before = metric_samples(httpx.get(url + "/metrics", headers=headers, timeout=10).text)
    assert post(url, body, headers=victim).status_code == 200
    after = metric_samples(httpx.get(url + "/metrics", headers=headers, timeout=10).text)
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


@pytest.mark.parametrize(
    "settings",
    [
        {
            "stream_pacing": StreamPacing(chunk_tokens=4, interval_s=0.02, pad_bytes=0, locked=True)
        },  # fixed-only, keyless
        {
            "stream_mode": "fixed",
            "api_key": "k3y",
            "open_metrics": True,
            "stream_pacing": StreamPacing(chunk_tokens=4, interval_s=0.02, pad_bytes=0),
        },
    ],
)
def test_fixed_mode_metrics_do_not_reveal_a_requests_acceptance(settings):
    """/metrics read around one non-streamed prompt_lookup request gave its drafted / accepted / steps exactly,
    what fixed mode hides from usage and /health. Now a fixed-mode server shows what the engine moves per
    request to the API key's holders only; the observer sees the request counted, nothing else."""
    with running_server(
        tiny_pair(), model_name="tiny", default_spec={"method": "prompt_lookup", "k": 4}, **settings
    ) as (url, app):
        key = {"Authorization": "Bearer k3y"} if settings.get("api_key") else None
        for prompt in ([1, 2, 3, 1, 2, 3, 1, 2, 3], [5, 9, 2, 14, 7]):  # repetitive (accepts) and novel
            moved = moved_by_one_request(url, {**BODY, "prompt": prompt, "max_tokens": 8}, victim=key)
            assert {name for name, _ in moved} <= REQUEST_COUNTS, moved
        if key:
            moved = moved_by_one_request(url, {**BODY, "max_tokens": 8}, key, victim=key)
            assert moved[("specdraft_verify_steps_total", ())] > 0  # the key's holders see it all
            from specdraft.server.front import create_front
            from specdraft.server.local import app_in_thread

            with app_in_thread(create_front([url], api_key="k3y", open_metrics=True)) as front:  # replicas' front
                for headers, shown in [({}, False), ({"Authorization": "Bearer k3y"}, True)]:
                    names = {
                        n for n, _ in metric_samples(httpx.get(front + "/metrics", headers=headers, timeout=10).text)
                    }
                    assert "specdraft_requests_total" in names and ("specdraft_verify_steps_total" in names) == shown


def test_resource_errors_name_the_resource_not_its_path(tmp_path):
    """A missing datastore answered "datastore /srv/.../nonexistent not found"; a directory missing its
    manifest "No such file or directory: '/etc/meta.json'". Errors name the resource; the log has the path."""
    secret = tmp_path / "secret-layout"
    secret.mkdir()
    (secret / "skip.json").write_text('{"skip_layers": [0], "num_layers": 99}')  # another model's
    table = {
        "datastore": {"ds": str(secret / "nonexistent"), "dir": str(secret)},
        "skip_config": {"other": str(secret / "skip.json"), "dir": str(secret)},
    }
    with running_server(tiny_pair(), model_name="tiny", resources=table) as (url, app):
        for field, name, method in [
            ("datastore", "ds", "suffix"),
            ("datastore", "dir", "suffix"),
            ("skip_config", "other", "layer_skip"),
            ("skip_config", "dir", "layer_skip"),
        ]:
            r = post(url, {**BODY, "spec": {"method": method, field: name}})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == f"spec.{field}", r.text
            assert err["message"] == f"spec.{field}: resource {name!r} is not available" and "/" not in r.text


def test_serve_refuses_resources_that_are_not_what_their_field_reads(tmp_path, capsys):
    """Checked at start (exists; a directory or regular file as its field reads it): a FIFO as skip_config
    hung its request and shutdown."""
    fifo, d = tmp_path / "fifo", tmp_path / "dir"
    os.mkfifo(fifo)
    d.mkdir()
    for item, why in [
        (f"skip_config:s={fifo}", "not a regular file"),
        (f"skip_config:s={d}", "not a regular file"),
        (f"datastore:ds={fifo}", "not a directory"),
        (f"head:h={tmp_path / 'none'}", "no such file"),
        (f"datastore:ds={d}", "meta.json: no such file"),
    ]:
        assert main(["serve", "--resource", item]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --resource {item}: {why}") and err.count("\n") == 1, err


def test_a_blocking_resource_is_reached_by_the_timeout_and_by_shutdown(tmp_path, monkeypatch):
    """A resource that blocks its reader (a FIFO that became one after the start check) hung its request
    forever, past --timeout, and kept the process alive after SIGTERM. Loading runs in a daemon thread that
    the request's timeout and the drain both stop waiting for."""
    from specdraft.server import resources

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(resources, "problem", lambda field, path: None)  # as if it changed after the check
    try:
        with running_server(
            tiny_pair(), model_name="tiny", timeout_s=1.0, resources={"skip_config": {"s": str(fifo)}}
        ) as (url, app):
            body = {**BODY, "spec": {"method": "layer_skip", "skip_config": "s"}}
            t0 = time.monotonic()
            r = post(url, body)
            assert r.status_code == 408 and r.json()["error"]["param"] == "spec.skip_config", r.text
            assert time.monotonic() - t0 < 5 and httpx.get(url + "/health", timeout=5).status_code == 200
            out = {}
            th = threading.Thread(target=lambda: out.update(r=post(url, body)))
            th.start()
            time.sleep(0.3)
            app.state.draining = True  # SIGTERM's drain (server/graceful.py)
            th.join(5)
            app.state.draining = False
            assert out["r"].status_code == 503 and out["r"].json()["error"]["code"] == "shutting_down"
    finally:
        try:  # lets the blocked readers go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def test_a_blocked_resource_load_does_not_keep_the_process_alive(tmp_path):
    """asyncio.to_thread's pool is joined at exit: a load blocked on a FIFO kept `serve` alive after SIGTERM."""
    import subprocess
    import sys

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = (
        "import asyncio\nfrom specdraft.server.resources import _bounded\n"
        f"async def main():\n    try:\n        await _bounded(lambda: open({str(fifo)!r}).read(), 0.3, lambda: False)\n"
        "    except TimeoutError:\n        print('timeout')\nasyncio.run(main())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert p.returncode == 0 and p.stdout.strip() == "timeout", p.stderr


def _release(fifo) -> None:
    """Lets a reader blocked on ``fifo`` go (it reads an empty file)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader
        pass


RESOURCE_FILES = {  # a valid file of each field a spec names by its resource name, and a method reading it
    "skip_config": ("layer_skip", {"skip_layers": [1], "num_layers": 2}),
    "autotune": ("auto", {"arms": [{"name": "prompt_lookup", "spec": {"method": "prompt_lookup", "k": 2}}]}),
}


@pytest.mark.parametrize("swap", ["fifo", "removed"])
@pytest.mark.parametrize("field", list(RESOURCE_FILES))
def test_admission_reads_no_resource_file_again(tmp_path, monkeypatch, field, swap):
    """A resource is read once, within the bounded check; admission on the worker thread read the file
    again: one swapped for a FIFO while its request waited blocked the worker for good (every later
    request hung), one removed gave a 400 carrying its path."""
    method, doc = RESOURCE_FILES[field]
    f = tmp_path / "secret-layout" / f"{field}.json"
    f.parent.mkdir()
    f.write_text(json.dumps(doc))
    try:
        with running_server(
            tiny_pair(), model_name="tiny", timeout_s=3, max_batch=2, resources={field: {"r": str(f)}}
        ) as (url, app):
            worker = app.state.worker
            real = worker._admit

            def swapped_then_admitted(jobs):  # the file changes after the check, before admission
                if f.is_file():
                    f.unlink()
                    if swap == "fifo":
                        os.mkfifo(f)
                return real(jobs)

            monkeypatch.setattr(worker, "_admit", swapped_then_admitted)
            body = {**BODY, "spec": {"method": method, field: "r"}}
            r = post(url, body)
            assert r.status_code == 200, r.text
            r = post(url, body)  # the next request's check sees the swap
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == f"spec.{field}: resource 'r' is not available"
            assert post(url, BODY).status_code == 200
    finally:
        _release(f)


def test_health_counts_admission_as_busy(monkeypatch):
    """/health said "ok" while the worker was held up admitting a request (busy_since was set only around a
    decoding step): admission (making drafters, prefill) is the worker's work too."""
    gate = threading.Event()
    with running_server(tiny_pair(), model_name="tiny", stuck_after_s=0.3, max_batch=2) as (url, app):
        dec = app.state.worker.decoder
        real = dec.make_drafter
        monkeypatch.setattr(dec, "make_drafter", lambda spec: (gate.wait(20), real(spec))[1])
        out = {}
        th = threading.Thread(target=lambda: out.update(r=post(url, BODY)))
        th.start()
        try:
            t0 = time.monotonic()
            while httpx.get(url + "/health", timeout=5).status_code == 200:
                assert time.monotonic() - t0 < 5, "/health stayed ok during a held-up admission"
                time.sleep(0.05)
            assert httpx.get(url + "/health", timeout=5).json()["status"] == "worker stuck"
        finally:
            gate.set()
            th.join(20)
        assert out["r"].status_code == 200 and httpx.get(url + "/health", timeout=5).status_code == 200


def test_autotune_arm_paths_do_not_reach_clients(tmp_path):
    """An operator's autotune file whose arm names a path passed the resource check, and the client's 400
    named that path. Arms' resources are checked and loaded with the file; the client hears the name only."""
    secret = tmp_path / "secret-operator-dir"
    at = tmp_path / "at.json"
    at.write_text(json.dumps({"arms": [{"name": "suffix", "spec": {"method": "suffix", "datastore": str(secret)}}]}))
    with running_server(tiny_pair(), model_name="tiny", resources={"autotune": {"at": str(at)}}) as (url, app):
        r = post(url, {**BODY, "spec": {"method": "auto", "autotune": "at"}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "spec.autotune", r.text
        assert err["message"] == "spec.autotune: resource 'at' is not available" and "secret" not in r.text
        assert post(url, BODY).status_code == 200


SURROGATES = [  # valid JSON ("\ud800" escaped), but no Unicode text: tokenizers and llguidance fail on it
    ({"guided_regex": "a\ud800"}, "guided_regex"),
    ({"guided_choice": ["yes", "n\udfff"]}, "guided_choice[1]"),
    ({"structured_outputs": {"regex": "\ud800"}}, "structured_outputs.regex"),
    ({"stop": ["\udc00"]}, "stop[0]"),
    ({"spec": {"method": "\ud800"}}, "spec.method"),
    ({"logit_bias": {"\ud800": 1}}, "logit_bias"),
    ({"prompt": "abc \ud800"}, "prompt"),
]


@pytest.mark.parametrize("extra,param", SURROGATES)
def test_lone_surrogates_are_400s_naming_the_field(batch_server, extra, param):
    """guided_regex / guided_choice with a lone surrogate were a 500 (UnicodeEncodeError in the grammar compiler)."""
    r = httpx.post(batch_server[0] + "/v1/completions", content=json.dumps({**BODY, **extra}), headers=JSON, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "surrogate" in err["message"], r.text


def test_lone_surrogates_in_text_a_tokenizer_reads_are_400s():
    """With a real tokenizer (SmolLM2's), a prompt with a lone surrogate was a 500 (TypeError from the
    tokenizer), a chat message's content a 500 (UnicodeEncodeError in the chat template)."""
    from transformers import AutoTokenizer

    from conftest import smol_files

    t = tiny_llama(vocab=16)
    t.tokenizer = AutoTokenizer.from_pretrained(smol_files())
    with running_server(SpecDecoder(t, None), model_name="tiny") as (url, app):
        chat = lambda content: {"messages": [{"role": "user", "content": content}]}  # noqa: E731
        for path, body, param in [
            ("/v1/completions", {"prompt": "abc \ud800"}, "prompt"),
            ("/v1/completions", {"prompt": ["\udbff x"]}, "prompt[0]"),
            ("/v1/chat/completions", chat("hi \ud800"), "messages[0].content"),
            ("/v1/chat/completions", chat([{"type": "text", "text": "\udc00"}]), "messages[0].content[0].text"),
        ]:
            r = httpx.post(url + path, content=json.dumps({**body, "max_tokens": 2}), headers=JSON, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and "surrogate" in err["message"], r.text
