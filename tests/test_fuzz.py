"""Fuzzing both generation endpoints over HTTP (a tiny model behind the real server on 127.0.0.1):
2,000 generated bodies (every field with wrong types, huge numbers, NaN / inf, empty and long strings,
nested objects, unknown fields; mostly on top of a valid request so that the checks past the first
one are reached too), plus hostile raw bodies (invalid UTF-8, deep nesting, a 50 MB body, a prompt of
a million tokens). Every answer must be a 2xx or a 4xx, never a 5xx or a hang, and every 400 about a
request field must name it."""

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_util import running_server
from test_server_fast import tiny_pair

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "stream", "n", "logprobs", "top_logprobs", "logit_bias", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "response_format", "guided_json", "guided_regex",
          "guided_grammar", "guided_choice", "structured_outputs", "spec", "ignore_eos", "stream_options", "echo",
          "user", "best_of", "tools", "no_such_field"]
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([0, 1, 3, -1, 2**31]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.just(""), st.just("x" * 20_000),
    st.lists(st.integers(-3, 20), max_size=6), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(), st.text(max_size=4), st.none()), max_size=3),
    st.just({"method": "draft_model", "k": 2}), st.just({"type": "json_object"}), st.just([[[[[]]]]]),
)
VALID = st.fixed_dictionaries({"prompt": st.lists(st.integers(0, 15), min_size=1, max_size=6),
                               "max_tokens": st.integers(1, 3)},
                              optional={"temperature": st.sampled_from([0, 0.5, 1.0]), "stream": st.booleans(),
                                        "seed": st.integers(0, 9), "logprobs": st.integers(0, 3)})
BODIES = st.builds(lambda base, extra: {**base, **extra}, VALID, st.dictionaries(st.sampled_from(FIELDS), JUNK, max_size=3))
BODY_LEVEL = ("the request body",)  # errors about the body as a whole name no field


@pytest.fixture(scope="module")
def server():
    with running_server(tiny_pair(), model_name="tiny", default_spec={"method": "prompt_lookup", "k": 2},
                        max_queue=64, timeout_s=30, max_batch=4, default_max_tokens=4) as (url, app):
        with httpx.Client(base_url=url, timeout=30, headers={"Content-Type": "application/json"}) as c:
            yield c


STATUS = Counter()  # (endpoint, status) over the generated cases


def check(r: httpx.Response) -> None:
    STATUS[r.request.url.path, r.status_code] += 1
    assert r.status_code < 500, r.text
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert '"server_error"' not in r.text
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if r.status_code == 400 and not err["message"].startswith(BODY_LEVEL):
        assert err["param"], err


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES)
def test_fuzz_completions(server, body):
    check(server.post("/v1/completions", content=json.dumps(body)))


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, content=st.one_of(st.text(max_size=8), JUNK))
def test_fuzz_chat(server, body, content):
    body = {k: v for k, v in body.items() if k != "prompt"}
    body.setdefault("messages", [{"role": "user", "content": content}])
    check(server.post("/v1/chat/completions", content=json.dumps(body)))


def test_fuzz_reached_decoding():
    """Not vacuous: the generated cases include requests that decode (200) and ones refused (400)."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert STATUS[path, 400] >= 100
    assert STATUS["/v1/completions", 200] >= 100, STATUS


@pytest.mark.parametrize("raw,status,fragment", [
    (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
    (b'{"prompt": [1, 2], "max_tokens": NaN}', 400, "max_tokens"),
    (b'{"prompt": [1, 2], "temperature": Infinity}', 400, "temperature"),
    (b"null", 400, "must be a JSON object"),
])
def test_hostile_raw_bodies(server, raw, status, fragment):
    for path in ("/v1/completions", "/v1/chat/completions")[: 1 if b"prompt" in raw else 2]:
        r = server.post(path, content=raw)
        assert r.status_code == status and fragment in r.json()["error"]["message"], r.text


def test_size_limits(server):
    r = server.post("/v1/completions", content=b'{"prompt": "' + b"a" * (50 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = server.post("/v1/completions", content=json.dumps({"prompt": [1] * 1_000_000}))  # 1M tokens: 3 MB
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = server.post("/v1/completions", json={"prompt": "ab" * 100_000})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    r = server.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})  # still serving
    assert r.status_code == 200
