"""Fast server checks on a tiny random-weight model (token-id prompts, a stub tokenizer): the
protocol, the SSE stream, both schedulers, cancellation, loadtest's guards. No real model."""

import json
import threading

import httpx
import pytest

from conftest import tiny_llama
from server_util import health, running_server, wait_until
from specdraft.api import SpecDecoder
from specdraft.cli import main
from specdraft.core.errors import SpecDraftError
from specdraft.server.protocol import StepTrace, TextStream
from specdraft.tools.loadtest import check_url, parse_levels


class StubTok:
    """Token i decodes to chr(ord('a') + i)."""

    chat_template = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i)) for i in ids)

    def __call__(self, text, add_special_tokens=False):
        text.encode("utf-8")  # as a real tokenizer, it reads Unicode text only (a lone surrogate fails)
        return {"input_ids": [ord(c) % 16 for c in text]}

    def get_vocab(self):
        return {chr(97 + i): i for i in range(16)}


def tiny_pair() -> SpecDecoder:
    """A tiny random target and a perturbed copy as its draft, sharing the stub tokenizer."""
    t = tiny_llama(vocab=16)
    t.tokenizer = StubTok()
    d = tiny_llama(vocab=16, noise_seed=5, noise=0.25)
    d.tokenizer = t.tokenizer
    return SpecDecoder(t, d)


@pytest.fixture(scope="module", params=["single", "batch"])
def tiny_server(request):
    dec = tiny_pair()
    kw = {"max_batch": 8} if request.param == "batch" else {}
    with running_server(
        dec, model_name="tiny", default_spec={"method": "draft_model", "k": 3}, max_queue=32, timeout_s=60, **kw
    ) as (url, app):
        yield url, app, dec, request.param


def ref(dec, ids, n):
    from specdraft.models.hf import HFModel

    s = SpecDecoder(HFModel(dec.target.model, dec.tokenizer), None)
    return s.generate(ids, sampling={"max_new_tokens": n, "ignore_eos": True}, spec={"method": "plain"}).text


def test_completion_and_stream(tiny_server):
    url, app, dec, kind = tiny_server
    body = {"model": "tiny", "prompt": [1, 2, 3, 1, 2], "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == ref(dec, [1, 2, 3, 1, 2], 9)
    assert r["usage"]["completion_tokens"] == 9 and r["usage"]["method"] == "draft_model"
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        raw = s.read().decode()
    ev = raw.split("\n\n")
    assert ev[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e[6:]) for e in ev[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tiny_temperature_is_greedy(tiny_server):
    """temperature 1e-39 (below config.GREEDY_BELOW) is served greedily, not a 500 from NaN probabilities."""
    url, app, dec, kind = tiny_server
    body = {"model": "tiny", "prompt": [1, 2, 3, 1, 2], "max_tokens": 9, "temperature": 1e-39, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref(dec, [1, 2, 3, 1, 2], 9), r.text


def test_lossy_rule_is_per_request_and_marked(tiny_server):
    """Both schedulers: a sampling request with spec lossy=typical says so in its usage; the same
    request without it, and a greedy one with it (the rule does not act), do not."""
    url, app, dec, kind = tiny_server
    body = {
        "model": "tiny",
        "prompt": [1, 2, 3, 1, 2],
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": 1,
        "ignore_eos": True,
    }
    lossy = httpx.post(url + "/v1/completions", json={**body, "spec": {"lossy": "typical"}}, timeout=60).json()
    exact = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    greedy = httpx.post(
        url + "/v1/completions", json={**body, "temperature": 0, "spec": {"lossy": "typical"}}, timeout=60
    ).json()
    assert lossy["usage"]["lossy"] == "typical" and lossy["usage"]["completion_tokens"] == 6
    assert "lossy" not in exact["usage"] and "lossy" not in greedy["usage"]
    assert greedy["choices"][0]["text"] == ref(dec, [1, 2, 3, 1, 2], 6)
    bad = httpx.post(url + "/v1/completions", json={**body, "spec": {"lossy": "nucleus"}}, timeout=60)
    assert bad.status_code == 400 and "unknown lossy rule 'nucleus'" in bad.json()["error"]["message"]


def test_errors(tiny_server):
    url, app, dec, kind = tiny_server
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 99]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}]}, timeout=60)
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [1], "spec": {"method": "nope"}}, timeout=60)
    assert (
        r.status_code == 400
        and r.json()["error"]["param"] == "spec.method"
        and "unknown method" in r.json()["error"]["message"]
    )
    tree = {
        "prompt": [1, 2, 1],
        "max_tokens": 3,
        "spec": {"method": "prompt_lookup", "branches": 2},
        "temperature": 0.5,
    }
    r = httpx.post(url + "/v1/completions", json=tree, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3  # trees batch too
    r = httpx.post(
        url + "/v1/completions", json={**tree, "spec": {"method": "early_exit", "exit_layer": 5}}, timeout=60
    )
    assert (
        r.status_code == 400
        and r.json()["error"]["param"] == "spec"
        and "exit_layer must be < the target's 2 layers" in r.json()["error"]["message"]
    )


def _three_concurrent_greedy(url, dec, spec, base_tokens):
    """Three concurrent greedy completions (max_tokens base_tokens + i) with ``spec``; returns the
    responses and the plain references."""
    prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5], [7, 1, 7]]
    out = [None] * 3

    def run(i):
        out[i] = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "prompt": prompts[i],
                "max_tokens": base_tokens + i,
                "temperature": 0,
                "ignore_eos": True,
                "spec": spec,
            },
        ).json()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out, [ref(dec, p, base_tokens + i) for i, p in enumerate(prompts)]


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "prompt_lookup", "branches": 3},
        {"method": "draft_model", "tree": "static"},
        {"method": "draft_model", "tree": "dynamic", "k": 3},
        {"method": "suffix"},
        {"method": "token_recycling"},
        {"method": "lookahead"},
        {"method": "early_exit", "exit_layer": 1},
        {"method": "layer_skip", "skip_layers": [1]},
        {"method": "early_exit", "exit_layer": 1, "tree": "static"},
        {"method": "auto"},
        {"method": "hybrid"},
        {"method": "cascade"},
    ],
)
def test_every_method_served_greedy_exact(tiny_server, spec):
    """Both schedulers accept every drafter (the batch one batches trees and self-speculation)."""
    url, app, dec, kind = tiny_server
    out, refs = _three_concurrent_greedy(url, dec, spec, 7)
    assert [o["choices"][0]["text"] for o in out] == refs
    assert all(o["usage"]["method"] == spec["method"] for o in out)
    if spec["method"] in ("auto", "hybrid"):  # a composite reports the arms it drafted with
        assert all(sum(o["usage"]["arms"].values()) == o["usage"]["steps"] for o in out)


@pytest.fixture(scope="module")
def tiny_heads(tiny_server, tmp_path_factory):
    from head_util import train_tiny_heads

    url, app, dec, kind = tiny_server
    out = tmp_path_factory.mktemp(f"heads_{kind}")
    dirs = train_tiny_heads(dec.target, out, [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5], [7, 1, 7], [2, 9, 4, 2]], n_heads=2)
    other = tiny_llama(vocab=16, seed=7)  # same shapes, other weights: its head must not fit this target
    dirs["other"] = train_tiny_heads(other, out / "other", [[1, 2, 3]], steps=1, n_heads=2)["medusa"]
    dirs["missing"] = out / "no_such_head"
    # a request names heads by the names the operator configured (as `serve --resource head:NAME=PATH` does)
    app.state.resources["head"] = {name: str(d) for name, d in dirs.items()}
    return dirs


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "medusa", "k": 2},
        {"method": "medusa", "tree": "static", "tree_choices": [[0], [1], [0, 0], [1, 0]]},
        {"method": "eagle", "k": 3},
    ],
)
def test_head_methods_served_greedy_exact(tiny_server, tiny_heads, spec):
    """Both schedulers serve Medusa and EAGLE (the batch one batches them: per-row drafters on their
    rows' features); concurrent greedy requests equal plain decoding."""
    url, app, dec, kind = tiny_server
    spec = {**spec, "head": spec["method"]}  # the configured name
    out, refs = _three_concurrent_greedy(url, dec, spec, 8)
    assert [o["choices"][0]["text"] for o in out] == refs
    assert all(o["usage"]["method"] == spec["method"] for o in out)


def test_bad_head_is_a_400_on_spec(tiny_server, tiny_heads):
    url, app, dec, kind = tiny_server
    body = {"prompt": [1, 2, 3], "max_tokens": 3}
    cases = [
        ({"method": "medusa", "head": "other"}, "resource 'other' is not available"),  # another target's
        ({"method": "eagle", "head": "medusa"}, "resource 'medusa' is not available"),  # a medusa head
        ({"method": "medusa", "head": "missing"}, "resource 'missing' is not available"),
        ({"method": "medusa", "head": str(tiny_heads["medusa"])}, "may not name a file path"),
    ]
    for spec, fragment in cases:
        r = httpx.post(url + "/v1/completions", json={**body, "spec": spec}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "spec.head" and fragment in err["message"], err
        assert str(tiny_heads["medusa"].parent) not in r.text  # the log has the path, not the client


def test_auto_with_an_eagle3_head_is_served(tmp_path):
    """`serve --head DIR --resource head:h3=DIR` (auto by default): every request naming no method was a 400
    ("the server's head is not available"), and so was {"method": "auto", "head": "h3"} on any server: the
    head was loaded as an "auto" head. auto's head is its eagle3 arms' head; greedy output equals plain."""
    from head_util import save_eagle3_head

    dec = tiny_pair()
    head = save_eagle3_head(dec.target, tmp_path / "h3")
    with running_server(
        dec,
        model_name="tiny",
        default_spec={"method": "auto", "head": str(head)},
        max_batch=4,
        resources={"head": {"h3": str(head)}},
    ) as (url, app):
        for spec in [None, {"method": "auto", "head": "h3"}, {"method": "auto", "head": "h3", "auto_arms": ["eagle3"]}]:
            out, refs = _three_concurrent_greedy(url, dec, spec, 6)
            assert [o["choices"][0]["text"] for o in out] == refs, out
            assert all(o["usage"]["method"] == "auto" for o in out)
        assert all(set(o["usage"]["arms"]) <= {"plain", "eagle3"} for o in out), out
        assert any("eagle3" in o["usage"]["arms"] for o in out), out  # the head's arm drafted


def test_concurrent_and_cancelled(tiny_server):
    url, app, dec, kind = tiny_server
    prompts = [[i % 16, (3 * i) % 16, 5] for i in range(8)]
    out = [None] * 8

    def run(i):
        out[i] = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "prompt": prompts[i],
                "max_tokens": 6 + i,
                "temperature": 0,
                "ignore_eos": True,
                "spec": [{"method": "plain"}, {"method": "prompt_lookup"}, {"method": "draft_model", "k": 2}][i % 3],
            },
        ).json()["choices"][0]["text"]

    def hang_up(i):
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=60,
            json={"prompt": prompts[i], "max_tokens": 200, "ignore_eos": True, "stream": True},
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    break

    ts = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    ts += [threading.Thread(target=hang_up, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out == [ref(dec, p, 6 + i) for i, p in enumerate(prompts)]
    wait_until(lambda: health(url)["running"] == 0 and health(url)["waiting"] == 0, timeout=60)
    if kind == "batch":
        assert app.state.worker.engine.num_rows == 0 and app.state.worker.engine.cache_len == 0


def test_text_stream_holds_back_stop_prefixes():
    ts = TextStream(StubTok(), ["cd"])
    assert ts.push([0, 1]) == "a"  # "b" might start... no: hold len("cd") - 1 = 1 char
    assert ts.push([2]) == "b"  # "abc": "c" held
    assert ts.push([3], final=True) == ""  # "abcd" -> cut at "cd"
    ts = TextStream(StubTok(), [])
    assert ts.push([0]) == "a" and ts.push([1], final=True) == "b"


def test_loadtest_refuses_remote_urls(capsys):
    assert check_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert check_url("http://localhost:9") == "http://localhost:9"
    for bad in ["http://10.0.0.2:8000", "https://127.0.0.1:8000", "http://example.com", "ftp://localhost"]:
        with pytest.raises(SpecDraftError):
            check_url(bad)
    assert parse_levels("1,4,16") == [1, 4, 16]
    with pytest.raises(SpecDraftError):
        parse_levels("0,1000")
    assert main(["loadtest", "--url", "http://192.168.1.5:8000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: loadtest only targets a server on this machine") and err.count("\n") == 1


def test_loadtest_runs_against_a_local_server(tiny_server, tmp_path, capsys):
    url, app, dec, kind = tiny_server  # both schedulers
    out = tmp_path / "lt.json"
    assert (
        main(
            [
                "loadtest",
                "--url",
                url,
                "--concurrency",
                "1,3",
                "--requests",
                "3",
                "--max-tokens",
                "5",
                "--timeout",
                "60",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    d = json.loads(out.read_text())
    assert [(r["mode"], r["concurrency"], r["ok"]) for r in d["results"]] == [
        ("spec", 1, 3),
        ("plain", 1, 3),
        ("spec", 3, 3),
        ("plain", 3, 3),
    ]
    assert all(r["output_tokens"] == 15 and r["ttft_p50_s"] > 0 and r["tpot_p99_s"] > 0 for r in d["results"])
    assert d["results"][1]["drafted"] == 0 and d["results"][0]["drafted"] > 0
    assert "TTFT p50" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["serve", "--max-queue", "0"], "error: --max-queue must be >= 1, got 0"),
        (["serve", "--method", "draft_model"], "error: --method draft_model needs --draft NAME"),
        (["serve", "--method", "medusa"], "error: method 'medusa' needs head=DIR (--head DIR)"),
        (["serve", "--timeout", "-1"], "error: --timeout must be > 0 seconds, got -1.0"),
        (["serve", "--host", "0.0.0.0"], "error: --host 0.0.0.0 is reachable from other machines: set --api-key KEY"),
    ],
)
def test_serve_argument_errors_before_loading(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and err.count("\n") == 1


def test_seeded_request_same_alone_and_under_load(tiny_server):
    """A seeded sampling request gives the same tokens alone and sent together with 3 other requests
    (in the batch scheduler they share its batch, where the batch rule would shrink their drafts);
    its usage says the seed pins the sample."""
    url, app, dec, kind = tiny_server
    body = {
        "model": "tiny",
        "prompt": [1, 2, 3, 1, 2],
        "max_tokens": 16,
        "temperature": 0.9,
        "seed": 5,
        "ignore_eos": True,
    }
    alone = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    others = [
        {"model": "tiny", "prompt": [4, 5, 4, 5, i], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        for i in range(3)
    ]
    out = {}

    def send(i, b):
        out[i] = httpx.post(url + "/v1/completions", json=b, timeout=60).json()

    threads = [threading.Thread(target=send, args=(i, b)) for i, b in enumerate(others + [body])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[3]["choices"][0]["text"] == alone["choices"][0]["text"]
    assert alone["usage"]["reproducible"] is True and out[3]["usage"]["reproducible"] is True


@pytest.mark.parametrize("open_metrics", [False, True])
def test_api_key(open_metrics):
    """With an API key every endpoint but /health, the static playground page / (and /metrics when opened)
    needs the Bearer token: 401 in OpenAI's error shape without it or with a wrong one."""
    t = tiny_llama(vocab=16)
    t.tokenizer = StubTok()
    with running_server(SpecDecoder(t, None), api_key="s3cret", open_metrics=open_metrics) as (url, app):
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        for headers, why in [
            ({}, "missing API key"),
            ({"Authorization": "Bearer nope"}, "invalid API key"),
            ({"Authorization": "Basic s3cret"}, "invalid API key"),
        ]:
            r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            assert why in r.json()["error"]["message"] and r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url + "/v1/completions", json=body, headers=ok, timeout=60).status_code == 200
        assert httpx.get(url + "/v1/models", timeout=60).status_code == 401
        assert httpx.get(url + "/v1/models", headers=ok, timeout=60).status_code == 200
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        assert httpx.get(url + "/metrics", timeout=60).status_code == (200 if open_metrics else 401)
        assert httpx.get(url + "/", timeout=60).status_code == 200  # the page holds nothing; it asks for the key
        assert httpx.get(url + "/v1/specdraft/methods", timeout=60).status_code == 401
        assert httpx.get(url + "/v1/specdraft/methods", headers=ok, timeout=60).status_code == 200
        assert httpx.get(url + "/playground.js", timeout=60).status_code == 200  # its script and style too
        assert httpx.get(url + "/playground.html", timeout=60).status_code == 401  # only the page's paths are open


def _step_chunks(url, body):
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        raw = s.read().decode()
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


def test_include_steps_colours_every_token(tiny_server):
    """stream_options.include_steps: pieces rebuild the text exactly, accepted tokens add up to usage's."""
    url, app, dec, kind = tiny_server
    body = {
        "prompt": [1, 2, 3, 1, 2, 3, 1, 2],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "include_steps": True},
        "spec": {"method": "prompt_lookup"},
    }
    chunks = _step_chunks(url, body)
    usage = chunks[-1]["usage"]
    steps = [c["specdraft"] for c in chunks if "specdraft" in c]
    assert all(
        "".join(p[0] for p in sd["pieces"]) == c["choices"][0]["text"]
        for c in chunks
        if "specdraft" in c
        for sd in [c["specdraft"]]
    )
    tokens = [t for sd in steps for t in sd["tokens"]]
    assert [t["index"] for t in tokens] == list(range(usage["completion_tokens"]))
    assert sum(t["accepted"] for t in tokens) == usage["accepted"] > 0
    assert len([sd for sd in steps if sd["step"]]) == usage["steps"]
    assert all(sd["step"]["emitted"] == len(sd["tokens"]) for sd in steps if sd["step"])
    plain = _step_chunks(url, {**body, "stream_options": {"include_usage": True}})  # without: no extension field
    assert not any("specdraft" in c for c in plain)
    assert "".join(c["choices"][0]["text"] for c in plain if c["choices"]) == "".join(
        c["choices"][0]["text"] for c in chunks if c["choices"]
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream_options": {"include_steps": 1}}, "stream_options.include_steps"),
        ({"stream_options": {"include_steps": True}, "stream": False}, "stream_options.include_steps"),
        ({"stream_options": {"include_steps": True}, "stream_mode": "fixed"}, "stream_options.include_steps"),
    ],
)
def test_include_steps_errors(tiny_server, extra, param):
    url = tiny_server[0]
    r = httpx.post(
        url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True, **extra}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_methods_listing_and_page(tiny_server):
    url = tiny_server[0]
    doc = httpx.get(url + "/v1/specdraft/methods", timeout=30).json()
    ids = [m["id"] for m in doc["data"]]
    assert ids[0] == "auto" and "plain" in ids and doc["default_spec"]["method"] == "draft_model"
    by = {m["id"]: m for m in doc["data"]}
    assert by["draft_model"]["available"] and "static" in by["draft_model"]["trees"]
    assert not by["medusa"]["available"] and "head" in by["medusa"]["reason"]
    for m in doc["data"]:  # what the listing says is what a request gets
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "spec": {"method": m["id"]}},
            timeout=60,
        )
        assert (r.status_code == 200) == m["available"], (m["id"], r.text)
    assert doc["stream_mode"] == "normal"  # the page asks include_steps only then
    page, script, style = (httpx.get(url + p, timeout=30) for p in ("/", "/playground.js", "/playground.css"))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert script.headers["content-type"].startswith("text/javascript") and style.status_code == 200
    assert "/v1/specdraft/methods" in script.text and "include_steps" in script.text
    assert all("http" not in r.text.replace("http-equiv", "") for r in (page, script, style))  # this origin only


def test_nested_params_and_a_non_boolean_include_usage_are_400s():
    """On a server whose default is auto, spec.params was merged under the default's flat keys and dropped
    unread (auto ran its defaults); include_usage took any value."""
    with running_server(tiny_pair(), model_name="tiny", default_spec={"method": "auto"}) as (url, app):
        for extra, param in [
            ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
            ({"spec": {"method": "auto", "params": {"learn_costs": "bogus"}}}, "spec.params"),
            ({"spec": {"params": {"learn_costs": False}}}, "spec.params"),
            ({"spec": {"method": "prompt_lookup", "params": {}}}, "spec.params"),
        ]:
            r = httpx.post(
                url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True, **extra}, timeout=30
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


class ByteTok:
    """A byte-level tokenizer (as GPT-2's and SmolLM2's): token i is byte i; counts the ids it decodes."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


def stream_pieces(tok, ids, sizes, stops=()):
    """Push ``ids`` in steps of ``sizes`` through TextStream and StepTrace as the server's stream does ->
    (the streamed text, the include_steps pieces' text)."""
    ts, trace, text, pieces = TextStream(tok, list(stops)), StepTrace(tok), "", ""
    i = 0
    for n in sizes:
        new, i = ids[i : i + n], i + n
        at = ts.sent
        delta = ts.push(new)
        text += delta
        pieces += "".join(p for p, _ in trace.step(new, None, None, at, delta)["pieces"])
    at = ts.sent
    last = ts.push([], final=True)
    return text + last, pieces + "".join(p for p, _ in trace.tail(at, last)["pieces"])


def test_stream_text_is_decoded_incrementally_and_adds_up():
    """Every step re-decoded the whole output (8,000 tokens: 10 s of event-loop CPU per stream). Now the ids
    decoded stay linear in the output, and the pieces still add up to the whole text: emoji, a character
    split over steps, stray bytes."""
    import random

    text = "naïve café 👋🏽 世界, " * 8
    ids = list(text.encode()) + [0xF0, 0x9F, 0x8E] + list("🎉 end".encode()) + [0xFF, 0x61] + [0xE4, 0xB8]
    want = bytes(ids).decode("utf-8", errors="replace")
    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.randint(1, 6) for _ in range(len(ids))]
        assert stream_pieces(ByteTok(), ids, sizes) == (want, want)
    long = list(("word 👋 " * 600).encode())[:6000]
    tok = ByteTok()
    stream_pieces(tok, long, [3] * (len(long) // 3))
    assert tok.decoded < 40 * len(long), tok.decoded  # re-decoding everything: ~len^2 / 3 ids (12 million)


def test_stream_stops_in_incremental_text():
    tok = ByteTok()
    ids = list("abc STOP def".encode())
    assert stream_pieces(tok, ids, [2] * 6, stops=["STOP"])[0] == "abc "
    assert stream_pieces(tok, ids, [1] * 12, stops=["ST", "c S"])[0] == "ab"
