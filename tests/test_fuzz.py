"""Fuzzing both generation endpoints over HTTP (a tiny model behind the real server on 127.0.0.1):
2,000 generated bodies (every field with wrong types, huge numbers, NaN / inf, empty and long strings,
nested objects, unknown fields; mostly on top of a valid request so that the checks past the first
one are reached too), plus hostile raw bodies (invalid UTF-8, deep nesting, a 50 MB body, a prompt of
a million tokens), plus 300 with such strings in one text field each. Strings include lone surrogates
(valid JSON escapes, no text) and digits int() refuses. Every answer must be a 2xx or a 4xx, never a
5xx or a hang, and every 400 about a request field must name it.

The ``spec`` object (issue 29): every SpecConfig field with wrong types, huge values, file paths and
method / tree / schedule names, alone and next to a normal request decoding concurrently in the same
batch (the normal one's text must equal decoding alone); on SmolLM2, structured-output constraints that
dead-end (a grammar complete before min_tokens) next to a normal request."""

import json
import os
import pickle
import tempfile
import threading
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_util import REQUEST_COUNTS, metric_samples, running_server
from specdraft.core.config import spec_keys
from specdraft.core.methods import REGISTRY
from test_server_fast import tiny_pair

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "n",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "structured_outputs",
    "spec",
    "ignore_eos",
    "stream_options",
    "echo",
    "user",
    "best_of",
    "tools",
    "no_such_field",
]
# strings that are valid JSON but no Unicode text (lone surrogates, sent as "\ud800" escapes; a generated pair
# may also make one valid character), and digits int() refuses where a number may come as a string ("²" in
# logit_bias keys: "²".isdigit() is True)
SURROGATE_TEXT = st.text(st.characters(categories=["Cs"]) | st.characters(max_codepoint=0x7F), min_size=1, max_size=6)
DIGIT_LOOKALIKES = st.sampled_from(["²", "٣", "５", "1²", "⑦", "๓", "-²"])
TEXT = st.one_of(st.text(max_size=12), SURROGATE_TEXT, DIGIT_LOOKALIKES)
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 3, -1, 2**31]),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.just(""),
    st.just("x" * 20_000),
    st.lists(st.integers(-3, 20), max_size=6),
    st.lists(TEXT, max_size=3),
    st.dictionaries(TEXT, st.one_of(st.integers(), TEXT, st.none()), max_size=3),
    st.just({"method": "draft_model", "k": 2}),
    st.just({"type": "json_object"}),
    st.just([[[[[]]]]]),
)
VALID = st.fixed_dictionaries(
    {"prompt": st.lists(st.integers(0, 15), min_size=1, max_size=6), "max_tokens": st.integers(1, 3)},
    optional={
        "temperature": st.sampled_from([0, 0.5, 1.0]),
        "stream": st.booleans(),
        "seed": st.integers(0, 9),
        "logprobs": st.integers(0, 3),
    },
)
BODIES = st.builds(
    lambda base, extra: {**base, **extra}, VALID, st.dictionaries(st.sampled_from(FIELDS), JUNK, max_size=3)
)
BODY_LEVEL = ("the request body",)  # errors about the body as a whole name no field


@pytest.fixture(scope="module")
def server():
    with running_server(
        tiny_pair(),
        model_name="tiny",
        default_spec={"method": "prompt_lookup", "k": 2},
        max_queue=64,
        timeout_s=30,
        max_batch=4,
        default_max_tokens=4,
    ) as (url, app):
        with httpx.Client(base_url=url, timeout=60, headers={"Content-Type": "application/json"}) as c:
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
        if err["message"].startswith("spec"):
            assert err["param"].startswith("spec"), err


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES)
def test_fuzz_completions(server, body):
    check(server.post("/v1/completions", content=json.dumps(body)))


@settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, content=st.one_of(st.text(max_size=8), SURROGATE_TEXT, JUNK))
def test_fuzz_chat(server, body, content):
    body = {k: v for k, v in body.items() if k != "prompt"}
    body.setdefault("messages", [{"role": "user", "content": content}])
    check(server.post("/v1/chat/completions", content=json.dumps(body)))


# every field that carries text, each with such strings (on top of a valid request: one field at a time, so
# that the text reaches what reads it: the tokenizer, the grammar compiler, the spec's checks)
TEXT_FIELDS = {
    "prompt": TEXT,
    "stop": TEXT | st.lists(TEXT, max_size=4),
    "guided_regex": TEXT,
    "guided_grammar": TEXT,
    "guided_choice": st.lists(TEXT, min_size=1, max_size=3),
    "guided_json": st.fixed_dictionaries({"type": st.just("string"), "pattern": TEXT}),
    "structured_outputs": st.dictionaries(st.sampled_from(["regex", "grammar", "choice"]), TEXT, max_size=1),
    "response_format": st.fixed_dictionaries({"type": TEXT}),
    "logit_bias": st.dictionaries(TEXT, st.integers(-100, 100), min_size=1, max_size=2),
    "model": TEXT,
    "user": TEXT,
    "stream_mode": TEXT,
    "spec": st.fixed_dictionaries({"method": TEXT}) | st.dictionaries(TEXT, st.integers(1, 4), max_size=1),
}
TEXT_BODIES = st.sampled_from(sorted(TEXT_FIELDS)).flatmap(
    lambda f: st.builds(lambda base, v: {**base, f: v}, VALID, TEXT_FIELDS[f])
)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=TEXT_BODIES)
def test_fuzz_text_fields(server, body):
    check(server.post("/v1/completions", content=json.dumps(body)))


def test_fuzz_reached_decoding():
    """Not vacuous: the generated cases include requests that decode (200) and ones refused (400)."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert STATUS[path, 400] >= 100
    assert STATUS["/v1/completions", 200] >= 100, STATUS


@pytest.mark.parametrize(
    "raw,status,fragment",
    [
        (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
        (b'{"prompt": [1, 2], "max_tokens": NaN}', 400, "max_tokens"),
        (b'{"prompt": [1, 2], "temperature": Infinity}', 400, "temperature"),
        (b"null", 400, "must be a JSON object"),
    ],
)
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


# --- the spec object (issue 29) -------------------------------------------------------------------------
SPEC_FIELDS = sorted(spec_keys() | {"params"})  # the fields and every method's own settings
SPEC_JUNK = st.one_of(
    JUNK,
    st.sampled_from([0, 1, 2, 16, 64, 65, 256, 257, 300, 4096, 10**30, -(10**30), 1e300]),
    st.sampled_from(["/dev/zero", "/etc/hostname", "/bin/ls", "/no/such/file", ".", "off", "medusa"]),
    st.lists(st.sampled_from([0, 1, 2, 3, 16, 17, 300, 4096]), max_size=5),
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=6),
    st.sampled_from(list(REGISTRY) + ["chain", "static", "dynamic", "constant", "heuristic", "cost_aware", "typical"]),
)
# valid-looking settings, so that decoding is reached too: the general ones, and each method's own for it (set
# for another method they are refused, as the junk extras, drawn from every field, still try)
PLAUSIBLE = {
    "k": st.integers(1, 8),
    "schedule": st.sampled_from(["constant", "cost_aware"]),
    "tree": st.sampled_from(["chain", "static", "dynamic"]),
}
PLAUSIBLE_OWN = {
    "prompt_lookup": {"branches": st.integers(1, 4)},
    "token_recycling": {"recycle_branching": st.just([3, 2])},
    "lookahead": {"lookahead_window": st.integers(1, 6)},
    "early_exit": {"exit_layer": st.integers(1, 2)},
    "layer_skip": {"skip_layers": st.just([1])},
}
SPECS = st.sampled_from(list(REGISTRY)).flatmap(
    lambda m: st.builds(
        lambda ok, extra: {"method": m, **ok, **extra},
        st.fixed_dictionaries({}, optional={**PLAUSIBLE, **PLAUSIBLE_OWN.get(m, {})}),
        st.one_of(st.just({}), st.dictionaries(st.sampled_from(SPEC_FIELDS), SPEC_JUNK, max_size=4)),
    )
)
SPEC_STATUS = Counter()
NORMAL = {"prompt": [1, 2, 3, 1, 2, 3, 1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(spec=SPECS, max_tokens=st.integers(1, 4), temperature=st.sampled_from([0, 1.0]))
def test_fuzz_spec(server, spec, max_tokens, temperature):
    r = server.post(
        "/v1/completions",
        content=json.dumps(
            {"prompt": [1, 2, 3, 1, 2], "max_tokens": max_tokens, "temperature": temperature, "spec": spec}
        ),
    )
    SPEC_STATUS["alone", r.status_code] += 1
    check(r)


@pytest.fixture(scope="module")
def normal_text(server):
    return server.post("/v1/completions", content=json.dumps(NORMAL)).json()["choices"][0]["text"]


def send_together(client, bodies: dict, timeout: float) -> dict:
    """POST each named body to /v1/completions at once (one thread each: they share a batch); -> responses."""
    out = {}

    def send(name, body):
        out[name] = client.post("/v1/completions", content=json.dumps(body))

    ts = [threading.Thread(target=send, args=item) for item in bodies.items()]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    return out


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(spec=SPECS, stream=st.booleans())
def test_fuzz_spec_next_to_a_normal_request(server, normal_text, spec, stream):
    """A hostile spec and a normal request sent together (same batch): the normal one decodes exactly as alone."""
    out = send_together(
        server,
        {
            "hostile": {"prompt": [4, 5, 4, 5], "max_tokens": 4, "spec": spec, "stream": stream, "temperature": 0.7},
            "normal": NORMAL,
        },
        timeout=60,
    )
    SPEC_STATUS["pair", out["hostile"].status_code] += 1
    check(out["hostile"])
    assert out["normal"].status_code == 200 and out["normal"].json()["choices"][0]["text"] == normal_text


def test_fuzz_spec_reached_decoding():
    """Not vacuous: generated specs both decode and get refused."""
    assert SPEC_STATUS["alone", 200] >= 50 and SPEC_STATUS["alone", 400] >= 100, SPEC_STATUS
    assert SPEC_STATUS["pair", 200] >= 10, SPEC_STATUS
    print("spec fuzz statuses:", dict(SPEC_STATUS))


# every field x every hostile value, each under the method that reads the field, with and without the
# cost-aware schedule (which timed a (k + 1)-token forward for any k)
FIELD_METHOD = {
    "lookahead": "lookahead",
    "recycle": "token_recycling",
    "tree_": "draft_model",
    "branches": "prompt_lookup",
    "skip_": "layer_skip",
    "exit_layer": "early_exit",
    "head": "medusa",
    "datastore": "suffix",
    "tree_nodes": "suffix",
    "max_occurrences": "suffix",
    "min_token_prob": "suffix",
    "max_spec_factor": "suffix",
    "retrieval_k": "hybrid",
    "hybrid_": "hybrid",
    "cascade_k": "cascade",
    "auto_arms": "auto",
    "autotune": "auto",
    "confidence_threshold": "draft_model",
}
HOSTILE = [
    10**30,
    -1,
    0,
    65,
    300,
    4096,
    1e300,
    True,
    None,
    "",
    "x",
    {},
    [4096],
    [300, 300],
    [[0]] * 300,
    "/dev/zero",
    "/etc/hostname",
    "/no/such/file",
    "FIFO",
]


def test_spec_field_sweep(server, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for field in SPEC_FIELDS:
        method = next((m for prefix, m in FIELD_METHOD.items() if field.startswith(prefix)), "prompt_lookup")
        for value in HOSTILE:
            value = str(fifo) if value == "FIFO" else value
            for extra in ({}, {"schedule": "cost_aware"}, {"tree": "dynamic"}):
                spec = {"method": method, **extra, field: value}
                r = server.post(
                    "/v1/completions", content=json.dumps({"prompt": [1, 2, 3, 1, 2], "max_tokens": 2, "spec": spec})
                )
                SPEC_STATUS["sweep", r.status_code] += 1
                check(r)
    assert SPEC_STATUS["sweep", 200] >= 40 and SPEC_STATUS["sweep", 400] >= 1000, SPEC_STATUS
    print("spec sweep statuses:", {k: v for k, v in SPEC_STATUS.items() if k[0] == "sweep"})


DEAD_ENDS = st.fixed_dictionaries(
    {
        "guided_choice": st.sampled_from([["yes", "no"], ["a"], ["maybe", "yes"]]),
        "min_tokens": st.integers(0, 6),
        "max_tokens": st.integers(1, 6),
        "temperature": st.sampled_from([0, 0.7, 1.5]),
    },
    optional={
        "logit_bias": st.sampled_from([{"2": -100}, {"2": 100}, {"²": 5}]),
        "seed": st.integers(0, 3),
        "spec": st.sampled_from(
            [{"method": "prompt_lookup"}, {"method": "suffix"}, {"method": "lookahead"}, {"method": "token_recycling"}]
        ),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
    },
)


@pytest.fixture(scope="module")
def smol_server(smol_f32):
    from specdraft.api import SpecDecoder

    with running_server(
        SpecDecoder(smol_f32, None),
        model_name="smol",
        max_batch=4,
        timeout_s=120,
        default_spec={"method": "prompt_lookup"},
    ) as (url, app):
        with httpx.Client(base_url=url, timeout=120, headers={"Content-Type": "application/json"}) as c:
            normal = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            want = c.post("/v1/completions", json=normal).json()["choices"][0]["text"]
            yield c, normal, want


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=DEAD_ENDS)
def test_fuzz_dead_end_constraints_on_smol(smol_server, body):
    """Constraints that leave no token (a choice complete before min_tokens, EOS biased away) next to a
    normal request: never a 5xx, and the normal request's text is unchanged."""
    c, normal, want = smol_server
    out = send_together(c, {"hostile": {"prompt": "Is the sky blue? Answer:", **body}, "normal": normal}, timeout=120)
    SPEC_STATUS["dead_end", out["hostile"].status_code] += 1
    check(out["hostile"])
    assert out["normal"].json()["choices"][0]["text"] == want


# --- the fixed-mode /metrics observer ---------------------------------------------------------------------
VICTIMS = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.lists(st.integers(0, 15), min_size=1, max_size=12), st.integers(1, 4).map(lambda n: [1, 2, 3] * n)
        ),
        "max_tokens": st.integers(1, 10),
        "temperature": st.sampled_from([0, 0.8]),
    },
    optional={
        "stream": st.booleans(),
        "ignore_eos": st.booleans(),
        "seed": st.integers(0, 3),
        "spec": st.sampled_from(
            [{"method": m} for m in ("prompt_lookup", "draft_model", "suffix", "plain", "lookahead")]
            + [{"method": "draft_model", "k": 6}]
        ),
    },
)
METRICS_STATUS = Counter()


@pytest.fixture(scope="module")
def fixed_only():
    from specdraft.server.pacing import StreamPacing

    pacing = StreamPacing(chunk_tokens=3, interval_s=0.01, pad_bytes=0, locked=True)
    with running_server(
        tiny_pair(), model_name="tiny", default_spec={"method": "prompt_lookup", "k": 4}, stream_pacing=pacing
    ) as (url, app):
        with httpx.Client(base_url=url, timeout=60, headers={"Content-Type": "application/json"}) as c:
            yield c


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=VICTIMS)
def test_fuzz_fixed_mode_metrics_observer(fixed_only, body):
    """An observer reading /metrics before and after each victim's request, on a keyless fixed-only server:
    only the request counters move (nothing that counts its steps, drafts or decoding time)."""
    before = metric_samples(fixed_only.get("/metrics").text)
    r = fixed_only.post("/v1/completions", content=json.dumps(body))
    r.read()
    after = metric_samples(fixed_only.get("/metrics").text)
    moved = {k for k in after if after[k] != before.get(k)}
    METRICS_STATUS[r.status_code] += 1
    assert r.status_code < 500 and {name for name, _ in moved} <= REQUEST_COUNTS, moved


# --- the files kept under $SPECDRAFT_HOME: wrong shapes and bytes ------------------------------------------
CURVE = {"1": 9.0, "4": 9.5, "8": 10.0, "16": 12.0}
VALID_PATHS = {
    "model": "smollm2-135m",
    "cpu": "x",
    "curves": {"hf": CURVE, "llama:Q4_0": {**CURVE, "1": 4.0}},
    "prefill": {"hf": {"32": 50.0, "512": 600.0}, "llama:Q4_0": {"32": 40.0, "512": 500.0}},
    "pick": {
        "path": "llama",
        "tokens_per_s": 30.0,
        "tried": [{"path": "llama", "tokens_per_s": 30.0, "decode_tokens_per_s": 31.0, "prefill_ms_per_token": 1.5}],
        "prompts": ["a"],
        "sampling": {"temperature": 0.0},
    },
}
SLOTS = [
    (),
    ("model",),
    ("curves",),
    ("curves", "hf"),
    ("curves", "hf", "1"),
    ("curves", "hf", "8"),
    ("curves", "hf", "²"),
    ("curves", "llama:Q4_0"),
    ("curves", "gpu"),
    ("extra",),
    ("pick",),
    ("pick", "path"),
    ("pick", "tokens_per_s"),
    ("pick", "tried"),
    ("pick", "tried", 0),
    ("pick", "sampling"),
    ("prefill",),
    ("prefill", "hf"),
    ("prefill", "hf", "32"),
    ("prefill", "gpu"),
    ("pick", "tried", 0, "decode_tokens_per_s"),
    ("pick", "tried", 0, "prefill_ms_per_token"),
    ("pick", "tried", 0, "path"),
]
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["hf", "llama:Q4_0", "gpu:fast", "1", ""]),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(
            st.sampled_from(["1", "4", "8", "16", "²", "¹", "one", "hf", "path", "tokens_per_s"]) | st.text(max_size=3),
            c,
            max_size=4,
        )
    ),
    max_leaves=10,
)
DELETE = object()
HOME_STATUS = Counter()


def _replaced(doc, slot, value):
    doc = json.loads(json.dumps(doc))
    if not slot:
        return value
    *up, last = slot
    at = doc
    for k in up:
        at = at[k]
    if value is DELETE:
        del at[last]
    else:
        at[last] = value
    return doc


@pytest.fixture(scope="module")
def paths_file(tmp_path_factory):
    """The paths file of every model in a temporary directory (not the machine's cache)."""
    from specdraft.models import paths

    d = tmp_path_factory.mktemp("paths")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "file_for", lambda model: d / f"{model}.json")
        yield d / "smollm2-135m.json"


def use_paths_file(f, raw: bytes) -> str:
    """What --backend auto, doctor and autotune --paths do with the file: it is "read" whole, or "refused" in
    one line naming it; any other exception fails the test."""
    from specdraft.commands import doctor
    from specdraft.core.errors import ConfigError
    from specdraft.models import paths

    f.write_bytes(raw)
    try:
        doc = paths.read("smollm2-135m")
    except ConfigError as e:
        assert str(e).startswith(f"the paths file {f}: ") and "\n" not in str(e), e
        return "refused"
    curves = paths.curves_of(doc)
    if curves or doc.get("pick"):  # (with neither, --backend auto measures: not here)
        paths.resolve("smollm2-135m", say=lambda s: None)
        paths.resolve("smollm2-135m", say=lambda s: None, shape=paths.RequestShape(2000, 64))
    if curves:
        doctor.recommend(doctor.Report(), curves, "smollm2-135m")
    paths.write("smollm2-135m", curves={"hf": CURVE})
    return "read"


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(slot=st.sampled_from(SLOTS), value=JSON | st.just(DELETE))
def test_fuzz_paths_file_shapes(paths_file, slot, value):
    if value is DELETE and (not slot or slot[-1] in ("gpu", "extra", "²")):  # (not in the valid file: junk instead)
        value = {}
    HOME_STATUS["shape", use_paths_file(paths_file, json.dumps(_replaced(VALID_PATHS, slot, value)).encode())] += 1


class _Planted:
    """A pickle that runs a shell command when it is loaded: no file under the home is unpickled."""

    def __reduce__(self):
        return os.system, (f"touch {PLANTED_MARKER}",)


def _torch_saved(obj) -> bytes:
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


PLANTED_MARKER = os.path.join(tempfile.gettempdir(), f"specdraft-fuzz-planted-{os.getpid()}")
PICKLES = [pickle.dumps(_Planted()), _torch_saved(_Planted())]
VALID_BYTES = json.dumps(VALID_PATHS).encode()
RAW = st.one_of(
    st.sampled_from(PICKLES),
    st.binary(max_size=64),
    st.integers(0, len(VALID_BYTES)).map(lambda n: VALID_BYTES[:n]),
    st.tuples(st.integers(0, len(VALID_BYTES) - 1), st.binary(min_size=1, max_size=3)).map(
        lambda t: VALID_BYTES[: t[0]] + t[1] + VALID_BYTES[t[0] + len(t[1]) :]
    ),
)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(raw=RAW)
def test_fuzz_paths_file_bytes(paths_file, raw):
    HOME_STATUS["bytes", use_paths_file(paths_file, raw)] += 1


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(doc=JSON | st.dictionaries(st.text(max_size=4), JSON, max_size=3))
def test_fuzz_other_home_files(tmp_path_factory, doc):
    """The llama.cpp probe's verdicts and the OpenVINO stamp are caches: a bad one is left out (said), never
    a crash; the quantized-variant index is read whole or refused in one line."""
    from specdraft.core.homefiles import HomeFileError, read_json
    from specdraft.models import openvino, quantize
    from specdraft.models.llama_probe import _seen

    d = tmp_path_factory.getbasetemp() / "home-files"
    d.mkdir(exist_ok=True)
    for name in ("probe.json", "stamp.json", "index.json"):
        (d / name).write_text(json.dumps(doc))
    seen = _seen(d / "probe.json")
    assert all({"extra_bufts", "crashed", "default", "fallback"} <= set(v) for v in seen.values())
    stamp = openvino._stamp(d)
    assert isinstance(stamp, dict) and ("median_diff" not in stamp or "argmax_agree" in stamp)
    try:
        read_json(d / "index.json", quantize.INDEX, "the index")
        HOME_STATUS["other", "read"] += 1
    except HomeFileError:
        HOME_STATUS["other", "refused"] += 1


def test_planted_pickles_in_home_files_do_not_run(paths_file):
    for raw in PICKLES:
        assert use_paths_file(paths_file, raw) == "refused"
    assert not os.path.exists(PLANTED_MARKER)


def test_fuzz_home_files_reached_both_outcomes():
    """Not vacuous: generated files are both read and refused; the fixed-mode victims both decode and get 400s."""
    assert HOME_STATUS["shape", "read"] >= 10 and HOME_STATUS["shape", "refused"] >= 50, HOME_STATUS
    assert HOME_STATUS["bytes", "refused"] >= 50, HOME_STATUS  # (mostly not JSON: a few decode)
    assert METRICS_STATUS[200] >= 30, METRICS_STATUS
    assert not os.path.exists(PLANTED_MARKER)  # the planted pickles among the bytes ran nothing
    print("home file fuzz:", dict(HOME_STATUS), "fixed-mode /metrics observer:", dict(METRICS_STATUS))
