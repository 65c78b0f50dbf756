"""The OpenAI-compatible server, end to end with the official openai client on 127.0.0.1
(SmolLM2-135M fp32). Every server is started with a given worker: "single" (max_batch 1, one request
at a time) and "batch" (the continuous batch engine, 16 rows)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import health, running_server, wait_until
from specdraft.api import SpecDecoder
from specdraft.models.hf import HFModel

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, there was a",
    "1, 2, 3, 4, 5, 6,",
    "The quick brown fox",
    "import numpy as np\nimport",
    "My favourite colour is",
    "Water boils at",
]
SPECS = [{"method": "prompt_lookup", "k": 3}, {"method": "plain"}, {"method": "draft_model", "k": 3}]


def decoder(smol, d):
    """A decoder with its own KV caches over shared weights; the draft ``d`` is SmolLM2's first 4 layers."""
    return SpecDecoder(HFModel(smol.model, smol.tokenizer, name="smol"), HFModel(d.model, d.tokenizer, name=d.name))


@pytest.fixture(scope="module")
def ref_dec(smol_f32, smol_draft4):
    return decoder(smol_f32, smol_draft4)


_REFS = {}  # plain greedy texts, computed once per (prompt, n, chat) for both schedulers' servers


def reference(ref_dec, prompt, n, chat=False):
    if (prompt, n, chat) not in _REFS:
        out = ref_dec.generate(prompt, sampling={"max_new_tokens": n}, spec={"method": "plain"}, chat=chat)
        _REFS[prompt, n, chat] = out.text
    return _REFS[prompt, n, chat]


@pytest.fixture(scope="module", params=["single", "batch"])
def server(request, smol_f32, smol_draft4):
    kw = {"max_queue": 64, "timeout_s": 300}
    if request.param == "batch":
        kw["max_batch"] = 16
    with running_server(decoder(smol_f32, smol_draft4), **kw) as (url, app):
        yield url, app, request.param


def client(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_completions_chat_and_usage(server, ref_dec):
    url, app, kind = server
    c = client(url)
    r = c.completions.create(model="smol", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == reference(ref_dec, PROMPTS[0], 12)
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    u = r.usage.model_dump()
    assert u["completion_tokens"] == 12 and u["prompt_tokens"] == 5 and u["total_tokens"] == 17
    assert u["method"] == "prompt_lookup" and u["drafted"] >= u["accepted"] >= 0 and u["mean_accepted_tokens"] >= 1
    r = c.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=10,
        temperature=0,
        extra_body={"spec": {"method": "draft_model", "k": 2}},
    )
    assert r.choices[0].message.content == reference(ref_dec, "Say hi", 10, chat=True)
    assert r.usage.model_dump()["method"] == "draft_model" and r.usage.model_dump()["drafted"] > 0
    m = c.models.list()
    assert [x.id for x in m.data] == ["smol"]


def _sse_lines(url, path, body):
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[6:]) for e in events[:-2]]


def test_streaming_wire_format_and_text(server, ref_dec):
    url, app, kind = server
    chunks = _sse_lines(
        url,
        "/v1/completions",
        {
            "model": "smol",
            "prompt": PROMPTS[1],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert "".join(ch["choices"][0]["text"] for ch in chunks[:-1]) == reference(ref_dec, PROMPTS[1], 12)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    chunks = _sse_lines(
        url,
        "/v1/chat/completions",
        {
            "model": "smol",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        },
    )
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
    assert text == reference(ref_dec, "Hi", 8, chat=True)
    assert chunks[-1]["object"] == "chat.completion.chunk" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # the openai client's stream reader
    st = client(url).completions.create(
        model="smol", prompt=PROMPTS[2], max_tokens=10, temperature=0, stream=True, stop=[" the"]
    )
    text = "".join(ch.choices[0].text for ch in st)
    assert (
        text
        == ref_dec.generate(
            PROMPTS[2], sampling={"max_new_tokens": 10, "stop": [" the"]}, spec={"method": "plain"}
        ).text
    )


EMOJI = "Repeat after me: 🎉👋🏽 世界 naïve café 🎉👋🏽 世界 naïve café 🎉👋🏽"


def test_stream_pieces_add_up_with_emoji(server, smol_tok):
    """Decoded incrementally, a stream's text and its include_steps pieces are the non-streamed text:
    SmolLM2's byte tokens split emoji over steps (and the tokenizer alone, over every step size)."""
    from test_server_fast import stream_pieces

    ids = smol_tok(EMOJI, add_special_tokens=False)["input_ids"]
    want = smol_tok.decode(ids, skip_special_tokens=True)
    assert any(smol_tok.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids)))  # a character over tokens
    for n in (1, 2, 3, 5):
        assert stream_pieces(smol_tok, ids, [n] * len(ids)) == (want, want)
    url = server[0]
    body = {"model": "smol", "prompt": EMOJI, "max_tokens": 24, "temperature": 0, "spec": {"method": "prompt_lookup"}}
    text = httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    chunks = _sse_lines(url, "/v1/completions", {**body, "stream": True, "stream_options": {"include_steps": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert "".join(p for c in chunks for p, _ in c["specdraft"]["pieces"]) == text


@pytest.mark.parametrize(
    "body,param,fragment",
    [
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
        ({"prompt": "x", "max_tokens": 10_000}, "max_tokens", "exceeds the model's context"),
        ({"prompt": "x", "top_p": "high"}, "top_p", "top_p must be a number"),
        ({"prompt": "x", "n": 2}, "n", "n must be 1"),
        ({"prompt": "x", "logprobs": 30}, "logprobs", "logprobs (top alternatives per token) must be <= 20"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"prompt": "x", "presence_penalty": 5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"prompt": "x", "guided_regex": "a(b"}, "guided_regex", "regex does not compile"),
        (
            {
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            },
            "response_format",
            "json_schema",
        ),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "response_format must be"),
        (
            {"prompt": "x", "guided_regex": "a", "guided_json": {}},
            "guided_regex",
            "set one structured-output constraint",
        ),
        ({"prompt": "x", "spec": {"method": "medusa"}}, "spec.method", "method 'medusa' needs head=DIR"),
        ({"prompt": "x", "spec": {"k": 0}}, "spec.k", "k (draft tokens per step) must be >= 1"),
        ({"prompt": "x", "spec": {"kk": 1}}, "spec", "unknown SpecConfig field(s) ['kk']"),
        ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({}, "prompt", "missing required parameter: prompt"),
    ],
)
def test_invalid_requests_get_400(server, body, param, fragment):
    url, app, kind = server
    r = httpx.post(url + "/v1/completions", json={"model": "smol", **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and fragment in err["message"] and err["type"] == "invalid_request_error"
    assert "Traceback" not in r.text


def test_error_responses_through_openai_client(server):
    import openai

    url, app, kind = server
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="smol", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.param == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x")
    assert e.value.code == "model_not_found"
    r = httpx.post(
        url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"


def test_concurrent_streams_each_get_their_greedy_output(server, ref_dec):
    url, app, kind = server
    n = 16 if kind == "batch" else 4
    jobs = [(PROMPTS[i % len(PROMPTS)], 6 + (i % 5), SPECS[i % len(SPECS)]) for i in range(n)]
    refs = [reference(ref_dec, p, m) for p, m, _ in jobs]
    out = [None] * n

    def run(i):
        p, m, spec = jobs[i]
        st = client(url).completions.create(
            model="smol", prompt=p, max_tokens=m, temperature=0, stream=True, extra_body={"spec": spec}
        )
        out[i] = "".join(ch.choices[0].text for ch in st)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert out == refs


def test_cancelled_streams_leak_nothing(server):
    url, app, kind = server
    worker = app.state.worker
    n = 12

    def run(i):
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=120,
            json={
                "model": "smol",
                "prompt": PROMPTS[i % 8],
                "max_tokens": 400,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "spec": SPECS[i % 3],
            },
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # first token: hang up

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    wait_until(lambda: health(url)["waiting"] == 0 and health(url)["running"] == 0, timeout=120)
    assert not worker.waiting
    if kind == "batch":
        assert worker.engine.num_rows == 0 and worker.engine.cache_len == 0
    # still serving correctly afterwards
    r = client(url).completions.create(model="smol", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("max_batch", [1, 2])
def test_queue_full_429_and_timeout(smol_f32, smol_draft4, max_batch):
    import openai

    with running_server(decoder(smol_f32, smol_draft4), max_queue=1, timeout_s=8, max_batch=max_batch) as (url, app):
        c = client(url)
        running = []
        for i in range(max_batch):  # fill the running batch
            st = c.completions.create(
                model="smol",
                prompt=PROMPTS[i],
                max_tokens=1000,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            next(iter(st))
            running.append(st)
        second = {}
        t = threading.Thread(
            target=lambda: second.setdefault(
                "r",
                httpx.post(url + "/v1/completions", json={"model": "smol", "prompt": "a", "max_tokens": 2}, timeout=60),
            )
        )
        t.start()
        wait_until(lambda: health(url)["waiting"] == 1, timeout=30)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model="smol", prompt="b", max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "queue_full"
        # the running requests run into the 8 s timeout: their streams end with an error event
        for st in running:
            with pytest.raises(openai.APIError) as e:
                for _ in st:
                    pass
            assert "timeout" in str(e.value)
        t.join(60)
        assert second["r"].status_code in (200, 408)
        wait_until(lambda: health(url)["running"] == 0)
        text = httpx.get(url + "/metrics").text
        assert 'specdraft_requests_total{endpoint="completions",status="rejected"} 1.0' in text
        timeouts = max_batch + (second["r"].status_code == 408)
        assert f'specdraft_requests_total{{endpoint="completions",status="timeout"}} {float(timeouts)}' in text


@pytest.mark.parametrize("max_batch", [1, 4])
def test_metrics_parse_and_match_requests(smol_f32, smol_draft4, max_batch):
    with running_server(decoder(smol_f32, smol_draft4), max_queue=8, max_batch=max_batch) as (url, app):
        c = client(url)
        usages = []
        for i in range(3):
            r = c.completions.create(
                model="smol", prompt=PROMPTS[i], max_tokens=5 + i, temperature=0, extra_body={"spec": SPECS[i]}
            )
            usages.append(r.usage.model_dump())
        r = c.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usages.append([ch for ch in r][-1].usage.model_dump())
        httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": -2})
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}

        def value(name, **labels):
            return sum(
                s.value
                for s in fams[name].samples
                if s.name == name + "_total" or s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
                if all(s.labels.get(k) == v for k, v in labels.items())
            )

        assert value("specdraft_requests", endpoint="completions", status="ok") == 3
        assert value("specdraft_requests", endpoint="chat", status="ok") == 1
        assert value("specdraft_requests", endpoint="completions", status="invalid") == 1
        assert value("specdraft_generation_tokens") == sum(u["completion_tokens"] for u in usages)
        assert value("specdraft_prompt_tokens") == sum(u["prompt_tokens"] for u in usages)
        assert value("specdraft_draft_tokens") == sum(u["drafted"] for u in usages)
        assert value("specdraft_accepted_tokens") == sum(u["accepted"] for u in usages)
        assert value("specdraft_verify_steps") == sum(u["steps"] for u in usages)
        assert value("specdraft_queue_depth") == 0
        assert fams["specdraft_step_seconds"].type == "histogram"
        count = [s.value for s in fams["specdraft_step_seconds"].samples if s.name.endswith("_count")][0]
        assert count >= sum(u["steps"] for u in usages)
        mat = value("specdraft_mean_accepted_tokens")
        steps = sum(u["steps"] for u in usages)
        assert mat == pytest.approx((sum(u["accepted"] for u in usages) + steps) / steps)
        assert "specdraft_position_acceptance" in fams


PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
}


def test_structured_output_logprobs_and_penalties(server, ref_dec):
    """The openai client's response_format (json_schema, strict) and logprobs; vLLM's guided_regex as an
    extra field; penalties. Greedy answers equal the library's plain decoding with the same parameters."""
    import jsonschema

    url, app, kind = server
    c = client(url)
    msgs = [{"role": "user", "content": "Describe Ada Lovelace as JSON with her name and age."}]
    r = c.chat.completions.create(
        model="smol",
        messages=msgs,
        max_tokens=40,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        extra_body={"spec": {"method": "prompt_lookup", "k": 3}},
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    want = ref_dec.generate(
        msgs[0]["content"],
        chat=True,
        spec={"method": "plain"},
        sampling={"max_new_tokens": 40, "json_schema": PERSON, "logprobs": 2},
    )
    assert text == want.text
    lp = r.choices[0].logprobs.content
    assert [e.token for e in lp] == [ref_dec.tokenizer.decode([e["token_id"]]) for e in want.logprobs]
    assert all(abs(a.logprob - b["logprob"]) < 1e-3 and len(a.top_logprobs) == 2 for a, b in zip(lp, want.logprobs))
    # completions: a regex (vLLM's field name), logprobs as parallel lists, streamed
    st = c.completions.create(
        model="smol",
        prompt=PROMPTS[0],
        max_tokens=12,
        temperature=0,
        logprobs=1,
        stream=True,
        extra_body={
            "guided_regex": " [A-Z][a-z]+, [A-Z][a-z]+\\.",
            "frequency_penalty": 0.5,
            "spec": {"method": "draft_model", "k": 3},
        },
    )
    chunks = list(st)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    want = ref_dec.generate(
        PROMPTS[0],
        spec={"method": "plain"},
        sampling={
            "max_new_tokens": 12,
            "regex": " [A-Z][a-z]+, [A-Z][a-z]+\\.",
            "frequency_penalty": 0.5,
            "logprobs": 1,
        },
    )
    assert text == want.text and text.endswith(".")
    got = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert len(got) == len(want.token_ids) and all(abs(a - b["logprob"]) < 1e-3 for a, b in zip(got, want.logprobs))
