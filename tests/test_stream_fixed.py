"""stream_mode "fixed" (server/pacing.py): fixed-size events at a steady cadence, whatever speculation
accepted; the same text as a normal stream; the openai client reads it; bad modes are 400s."""

import asyncio
import json
import math
import random
import time

import httpx
import numpy as np
import pytest

from conftest import tiny_llama
from server_util import running_server
from specdraft.api import SpecDecoder
from specdraft.cli import main
from specdraft.server.pacing import StreamPacing, keepalive, paced, pad
from test_server_fast import StubTok, tiny_pair


def run_paced(steps, pacing, delay_s):
    """Feed token steps of the given sizes, ``delay_s`` apart, through ``paced``; return what came
    out with its times."""

    async def source():
        t = 0
        for n in steps:
            await asyncio.sleep(delay_s)
            yield "tokens", (list(range(t, t + n)), None)
            t += n
        yield "done", "result"

    async def collect():
        t0 = time.monotonic()
        return [(time.monotonic() - t0, kind, payload) async for kind, payload in paced(source(), pacing)]

    return asyncio.run(collect())


@pytest.mark.parametrize("delay_s", [0.0, 0.03])
def test_paced_regroups_into_fixed_chunks_on_ticks(delay_s):
    """Steps of random sizes (as speculation emits them) come out as 3-token chunks, one per tick, in
    order, with keep-alives where the source is behind; then "done"."""
    rng = random.Random(0)
    steps = [rng.randint(1, 6) for _ in range(12)]
    p = StreamPacing(chunk_tokens=3, interval_s=0.02)
    out = run_paced(steps, p, delay_s)
    assert out[-1][1:] == ("done", "result")
    chunks = [payload[0] for _, kind, payload in out if kind == "tokens"]
    assert [t for c in chunks for t in c] == list(range(sum(steps)))
    assert all(len(c) == 3 for c in chunks[:-1]) and 1 <= len(chunks[-1]) <= 3
    assert (delay_s > 0) == any(kind == "keepalive" for _, kind, _ in out)
    # on the grid: never ahead of it (the i-th event not before the i-th tick after the first tokens, which
    # come delay_s in); behind it only by scheduling delays, which the grid absorbs: a late event does not
    # move the ticks after it (loose bounds: a shared 2-core CI machine)
    times = [t for t, _, _ in out]
    first_tick = math.ceil((delay_s + p.interval_s) / p.interval_s - 1e-9) * p.interval_s
    assert all(t >= first_tick + i * p.interval_s - 0.005 for i, t in enumerate(times)), times
    assert times[-1] - times[0] < (len(times) - 1) * p.interval_s + 0.1, times


def test_paced_sends_errors_on_the_grid_after_buffered_tokens():
    """An error is paced like the end: the tokens buffered before it go out first, in chunks on ticks,
    then the error on the next tick (its time must not tell when a step failed)."""

    async def source():
        yield "tokens", ([1, 2, 3, 4, 5], None)
        yield "error", "boom"

    async def collect():
        t0 = time.monotonic()
        return [(time.monotonic() - t0, kind, p) async for kind, p in paced(source(), StreamPacing(2, 0.05), t0)]

    out = asyncio.run(collect())
    assert [(k, p if k == "error" else p[0]) for _, k, p in out] == [
        ("tokens", [1, 2]),
        ("tokens", [3, 4]),
        ("tokens", [5]),
        ("error", "boom"),
    ]
    # each event on its own tick of the grid, never ahead of it (the first one interval after the tokens);
    # a late event does not move the ticks after it, so gaps between events are not checked (a late one
    # then an on-time one gave 62 ms and 43 ms on a loaded 2-core CI machine, 2026-12-03)
    times = [t for t, _, _ in out]
    assert all(t >= (i + 1) * 0.05 - 0.005 for i, t in enumerate(times)), times


def test_padding_makes_equal_sizes():
    for n in (0, 1, 100, 509, 510, 511, 512, 1500):
        ev = "data: " + "x" * n + "\n\n"
        out = pad(ev, 512)
        assert len(out.encode()) % 512 == 0 and out.endswith(ev) and out.startswith(":")
    assert len(keepalive(512)) == 512 and keepalive(512).endswith("\n\n")


@pytest.fixture(scope="module")
def fixed_server():
    pacing = StreamPacing(chunk_tokens=3, interval_s=0.05, pad_bytes=512)
    with running_server(
        tiny_pair(),
        model_name="tiny",
        default_spec={"method": "draft_model", "k": 4},
        stream_mode="fixed",
        stream_pacing=pacing,
    ) as (url, app):
        yield url


def events_of(url, body):
    """(arrival time, bytes) of each SSE event of a streamed completion, as an observer of the
    connection would see them."""
    out, buf = [], b""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        for piece in s.iter_raw():
            buf += piece
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                out.append((time.monotonic(), ev + b"\n\n"))
    return out


def test_fixed_stream_hides_step_sizes(fixed_server):
    """Every event is 512 bytes, data events carry 3 tokens (the last one fewer), the text equals the
    normal stream's and the non-streamed answer's."""
    body = {"model": "tiny", "prompt": [1, 2, 3, 1, 2], "max_tokens": 14, "temperature": 0, "ignore_eos": True}
    want = httpx.post(fixed_server + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    fixed = events_of(fixed_server, {**body, "stream": True})
    assert {len(ev) for _, ev in fixed} == {512}
    data = [ev.decode().split("\ndata: ", 1)[1].strip() for _, ev in fixed if b"\ndata: " in ev]
    assert data[-1] == "[DONE]"
    texts = [json.loads(d)["choices"][0]["text"] for d in data[:-1]]
    assert "".join(texts) == want and [len(t) for t in texts[:-1]] == [3, 3, 3, 3, 2]
    normal = events_of(fixed_server, {**body, "stream": True, "stream_mode": "normal"})
    assert len({len(ev) for _, ev in normal}) > 1  # normal events differ in size (speculation shows)
    assert "".join(json.loads(ev[6:])["choices"][0]["text"] for _, ev in normal[:-1]) == want


def test_fixed_stream_through_openai_client(fixed_server):
    from openai import OpenAI

    client = OpenAI(base_url=fixed_server + "/v1", api_key="none")
    body = {"model": "tiny", "prompt": [4, 5, 4, 5], "max_tokens": 10, "temperature": 0}
    want = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text
    got = "".join(
        c.choices[0].text for c in client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
    )
    assert got == want and len(want) == 10


def test_stream_mode_errors(fixed_server):
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2, "stream": True}
    r = httpx.post(fixed_server + "/v1/completions", json={**body, "stream_mode": "slow"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_mode", r.text
    t = tiny_llama(vocab=16)
    t.tokenizer = StubTok()
    with running_server(SpecDecoder(t, None), model_name="tiny", stream_pacing=StreamPacing(locked=True)) as (url, app):
        r = httpx.post(url + "/v1/completions", json={**body, "stream_mode": "normal"}, timeout=60)
        assert r.status_code == 400 and "only in stream_mode" in r.json()["error"]["message"], r.text


def test_serve_refuses_bad_pacing(capsys):
    assert main(["serve", "--stream-chunk", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --stream-*: the fixed stream chunk must be >= 1 token") and err.count("\n") == 1


def test_leak_classifier_sees_sizes_and_not_noise():
    """The leak measurement's observer: it tells two classes apart when their event sizes differ and
    stays near chance when they do not (so `specdraft leak` can report either)."""
    from specdraft.tools.leak import classifier_accuracy, features

    rng = np.random.default_rng(0)

    def obs(big):
        n = 20
        times = np.cumsum(rng.uniform(0.01, 0.03, n)).tolist()
        sizes = (rng.integers(200, 260, n) + (40 if big else 0)).tolist()
        return {"times": times, "sizes": sizes}

    y = np.array([0, 1] * 30)
    leaky = np.stack([features(obs(c == 1)) for c in y])
    same = np.stack([features(obs(False)) for _ in y])
    assert classifier_accuracy(leaky, y)["logistic_regression"]["mean"] > 0.9
    assert classifier_accuracy(same, y)["logistic_regression"]["mean"] < 0.75


def test_leak_refuses_too_few_prompts(capsys):
    assert main(["leak", "--per-class", "3"]) == 2
    assert capsys.readouterr().err.startswith("error: --per-class must be >= 10")
