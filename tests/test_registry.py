"""Adding a drafter is one drafter class plus one registry entry (docs/design.md, "Adding a drafter"):
a toy drafter registered at runtime, with a parameter of its own and a resource shared through the
decoder, is validated, decoded (greedy output = plain decoding), offered by the CLI, admitted by the
server and run by the bench, with no other change."""

import json
from dataclasses import dataclass

import httpx
import pytest

from conftest import tiny_llama
from server_util import running_server
from specdraft.api import SpecDecoder
from specdraft.cli import build_parser
from specdraft.commands.flags import help_text
from specdraft.core import methods
from specdraft.core.checks import Int, param
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ConfigError
from specdraft.core.tree import DraftTree
from specdraft.drafters.base import Drafter
from specdraft.drafters.prompt_lookup import PromptLookupDrafter

PROMPT = [1, 2, 3, 3, 3]


@dataclass
class RepeatLastParams:
    """repeat_last's own parameter: a flat key of its spec, refused in another method's."""

    shift: int = param(0, Int(min=0, max=1000, what="added to the last token, modulo the vocabulary"))


BUILT = []  # the shifts whose successor table was built (once per decoder and shift: shared)


def successor_table(dec, spec):
    """The drafter's resource: the token drafted after each token, (token + shift) mod V."""
    shift, vocab = spec.params.shift, dec.target.vocab_size

    def build():
        BUILT.append(shift)
        return [(t + shift) % vocab for t in range(vocab)]

    return dec.shared(("repeat_last", shift), build)


class RepeatLastDrafter(Drafter):
    """Drafts the last token's successor k times (the worked example of docs/design.md)."""

    name = "repeat_last"

    def __init__(self, spec, successor):
        self.k, self.successor = spec.k, successor

    def max_draft_depth(self):
        return self.k

    def propose(self, tokens, max_tokens):
        return DraftTree.chain([self.successor[tokens[-1]]] * min(self.k, max_tokens))


@pytest.fixture
def repeat_last():
    assert "repeat_last" not in methods.REGISTRY
    methods.REGISTRY["repeat_last"] = methods.Method(
        "repeat_last",
        "draft the last token k times (a toy)",
        lambda dec, spec: RepeatLastDrafter(spec, successor_table(dec, spec)),
        params=RepeatLastParams,
        load_resource=successor_table,
    )
    try:
        yield
    finally:
        del methods.REGISTRY["repeat_last"]


class StubTok:
    """Token i decodes to chr(ord('a') + i) (the server decodes completions)."""

    chat_template = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i)) for i in ids)


@pytest.fixture(scope="module")
def dec():
    target = tiny_llama(vocab=6)
    target.tokenizer = StubTok()
    return SpecDecoder(target, None)


def test_config_reads_the_registry(repeat_last):
    assert SpecConfig.from_dict({"method": "repeat_last", "k": 3, "schedule": "cost_aware"}).method == "repeat_last"
    # the entry's defaults: chains only, no heuristic schedule, needs nothing
    with pytest.raises(ConfigError, match="tree='static' is for methods draft_model, layer_skip"):
        SpecConfig(method="repeat_last", tree="static").validate()
    with pytest.raises(ConfigError, match="schedule 'heuristic' is not available for method 'repeat_last'"):
        SpecConfig(method="repeat_last", schedule="heuristic").validate()
    with pytest.raises(ConfigError, match="head is used by methods medusa, eagle, eagle3 and auto only, not 'repeat_l"):
        SpecConfig(method="repeat_last", head="h").validate()


def test_its_parameter(repeat_last):
    spec = SpecConfig.from_dict({"method": "repeat_last", "shift": 2})
    assert spec.params == RepeatLastParams(shift=2)
    assert spec.to_dict()["shift"] == 2 and "params" not in spec.to_dict()  # flat JSON, round-tripping
    assert SpecConfig.from_dict(spec.to_dict()) == spec
    assert SpecConfig(method="repeat_last").validate().params == RepeatLastParams()  # its default
    assert SpecConfig(method="repeat_last", params={"shift": 3}).validate().params.shift == 3
    with pytest.raises(ConfigError, match="shift .added to the last token.* must be >= 0, got -1"):
        SpecConfig.from_dict({"method": "repeat_last", "shift": -1})
    with pytest.raises(ConfigError, match="shift .* must be an integer, got 'x'"):
        SpecConfig.from_dict({"method": "repeat_last", "shift": "x"})


def test_a_foreign_or_unknown_key_is_an_error(repeat_last):
    with pytest.raises(ConfigError, match="shift is used by method 'repeat_last' only, not 'prompt_lookup'"):
        SpecConfig.from_dict({"method": "prompt_lookup", "shift": 1})
    with pytest.raises(ConfigError, match="shift is used by method 'repeat_last' only, not 'prompt_lookup'"):
        SpecConfig(method="prompt_lookup", params={"shift": 1}).validate()
    with pytest.raises(ConfigError, match="lookahead_window is used by method 'lookahead' only, not 'suffix'"):
        SpecConfig.from_dict({"method": "suffix", "lookahead_window": 6})
    with pytest.raises(ConfigError, match="lookahead_window is used by method 'lookahead' only, not 'repeat_last'"):
        SpecConfig.from_dict({"method": "repeat_last", "lookahead_window": 6})
    with pytest.raises(ConfigError, match=r"unknown SpecConfig field\(s\) \['shfit'\]"):
        SpecConfig.from_dict({"method": "repeat_last", "shfit": 1})
    with pytest.raises(ConfigError, match="params must be the parameters of method 'repeat_last', got int"):
        SpecConfig(method="repeat_last", params=5).validate()
    # at its default, another method's key is no setting: dropped (a spec's to_dict under another method)
    spec = SpecConfig.from_dict({"method": "prompt_lookup", "shift": 0})
    assert spec == SpecConfig(method="prompt_lookup").validate() and "shift" not in spec.to_dict()


def test_unregistered_is_unknown():
    with pytest.raises(ConfigError, match="unknown method 'repeat_last'; choose one of: plain, draft_model"):
        SpecConfig(method="repeat_last").validate()
    with pytest.raises(ConfigError, match=r"unknown SpecConfig field\(s\) \['shift'\]"):
        SpecConfig.from_dict({"method": "prompt_lookup", "shift": 1})


def test_greedy_output_equals_plain(repeat_last, dec):
    sp = {"max_new_tokens": 16, "ignore_eos": True}
    plain = dec.generate(PROMPT, sampling=sp, spec={"method": "plain"})
    for shift in (0, 5):
        for _ in range(2):
            out = dec.generate(PROMPT, sampling=sp, spec={"method": "repeat_last", "k": 3, "shift": shift})
            assert out.token_ids == plain.token_ids
            assert out.stats.drafted > 0
        assert BUILT.count(shift) == 1  # the resource: built once, then shared
    assert dec.shared(("repeat_last", 5), lambda: pytest.fail("rebuilt")) == [5, 0, 1, 2, 3, 4]


def test_cli_offers_it(repeat_last):
    p = build_parser()
    a = p.parse_args(["generate", "--method", "repeat_last", "hi"])
    assert a.method == "repeat_last"
    assert "repeat_last: draft the last token k times (a toy)" in help_text()
    assert "repeat_last" in p._subparsers._group_actions[0].choices["generate"].format_help()  # --method's help


def test_server_admits_it(repeat_last, dec):
    with running_server(dec, model_name="tiny", default_spec={"method": "plain"}) as (url, app):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        r = httpx.post(url + "/v1/completions", json={**body, "spec": {"method": "repeat_last", "k": 2}}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["method"] == "repeat_last"
        assert r.json()["choices"][0]["text"] == plain["choices"][0]["text"]
        r = httpx.post(
            url + "/v1/completions", json={**body, "spec": {"method": "repeat_last", "shift": 7}}, timeout=60
        )
        assert r.status_code == 200 and 7 in BUILT  # its load_resource ran before admission
        r = httpx.post(url + "/v1/completions", json={**body, "spec": {"method": "lookahead", "shift": 1}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "spec.shift", r.text
        assert "shift is used by method 'repeat_last' only" in r.json()["error"]["message"]


def test_a_default_spec_with_its_parameter_serves_other_methods(repeat_last, dec):
    with running_server(dec, model_name="tiny", default_spec={"method": "repeat_last", "k": 2, "shift": 1}) as (url, _):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        default = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert default["usage"]["method"] == "repeat_last"
        for spec in ({"method": "plain"}, {"method": "prompt_lookup", "max_ngram": 2}):  # the default's shift left out
            r = httpx.post(url + "/v1/completions", json={**body, "spec": spec}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == default["choices"][0]["text"]


def test_bench_takes_it(repeat_last):
    from specdraft.bench.harness import BenchOptions, build_variants

    opts = BenchOptions(k=3, sweep=[], methods="plain,repeat_last")
    assert [(n, k) for n, k, _ in build_variants(opts, {})] == [("plain", "plain"), ("repeat_last", "repeat_last")]
    opts = BenchOptions(k=3, sweep=["shift=0,2"], methods="plain,prompt_lookup,repeat_last")
    variants = build_variants(opts, {"spec": {"max_ngram": 2}})  # each method keeps the keys it reads
    assert [(n, s.get("shift"), s.get("max_ngram")) for n, _, s in variants] == [
        ("plain", None, None),
        ("prompt_lookup[shift=0]", None, 2),
        ("prompt_lookup[shift=2]", None, 2),
        ("repeat_last[shift=0]", 0, None),
        ("repeat_last[shift=2]", 2, None),
    ]
    with pytest.raises(ConfigError, match="lookahead_window is used by method 'lookahead' only, none of plain"):
        build_variants(BenchOptions(k=3, sweep=[], methods="plain,repeat_last"), {"spec": {"lookahead_window": 6}})


# --- the table and the spec's shape ----------------------------------------------------------------------
def test_the_table_is_filled_where_it_is_defined():
    """core/methods.py holds the whole table: no other module adds built-in entries (as an import side
    effect), and every built-in factory names a function of the drafters layer, resolved on first use."""
    import ast
    import pathlib

    import specdraft
    from test_imports import LAYERS, layer_of

    def is_table(n):
        return getattr(n, "id", None) == "REGISTRY" or getattr(n, "attr", None) == "REGISTRY"

    root = pathlib.Path(specdraft.__file__).parent
    writers = []
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            stored = isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del))
            stored = stored and is_table(node.value)
            updated = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("update", "setdefault")
                and is_table(node.func.value)
            )
            if stored or updated:
                writers.append(str(f.relative_to(root)))
    assert writers == []
    assert list(methods.REGISTRY) == list(methods.METHODS) and len(methods.METHODS) == 15
    for m in methods.REGISTRY.values():
        for ref in (m.make, m.load_resource):
            if ref is not None:
                fn = methods.resolve(ref)
                assert callable(fn) and LAYERS[layer_of(fn.__module__)][0] == "drafters", (m.name, ref)


def test_the_spec_holds_what_every_method_shares():
    """SpecConfig's fields are the settings every method reads; each method's own (its params dataclass,
    groups shared by several methods) are flat keys, by the constructor too, and never a field's name."""
    import dataclasses

    from specdraft.core.config import PATH_FIELDS, spec_keys
    from specdraft.core.methods import EarlyExitParams, PromptLookupParams

    fields = [f.name for f in dataclasses.fields(SpecConfig)]
    assert fields == ["method", "k", "schedule", "max_k", "tree", "lossy", "typical_epsilon", "typical_delta", "params"]
    assert not set(fields) & {n for m in methods.REGISTRY.values() for n in m.param_names()}
    assert {"head", "tree_branching", "min_ngram", "exit_layer", "datastore"} <= spec_keys()
    assert PATH_FIELDS == ("skip_config", "datastore", "head", "autotune")
    spec = SpecConfig(method="early_exit", exit_layer=2, tree="static", tree_branching=[2, 2]).validate()
    assert spec.params == EarlyExitParams(exit_layer=2, tree_branching=[2, 2]) and spec.get("exit_layer") == 2
    assert SpecConfig.from_dict(spec.to_dict()) == spec and spec.get("head") is None
    pl = SpecConfig.from_dict({"method": "prompt_lookup", "max_ngram": 2})
    assert pl.params == PromptLookupParams(max_ngram=2) and "head" not in pl.to_dict()
    # a setting its method does not read is refused, never ignored (remote_draft drafts argmax tokens: no threshold)
    with pytest.raises(ConfigError, match="confidence_threshold is used by methods draft_model, .* not 'remote_draft'"):
        SpecConfig.from_dict({"method": "remote_draft", "confidence_threshold": 0.5})
    methods.REGISTRY["clash"] = methods.Method("clash", "a setting named like a field", "x:y", params=Clash)
    try:
        with pytest.raises(ValueError, match=r"its settings \['k'\] are SpecConfig fields"):
            SpecConfig(method="clash").validate()
    finally:
        del methods.REGISTRY["clash"]


@dataclass
class Clash:
    k: int = param(1, Int(min=1))


def test_validation_returns_a_checked_copy():
    """validate never changes the object it checks (normalized values and the method's settings object are the
    copy's); the frozen spec cannot be changed at all."""
    import dataclasses

    from specdraft.core.config import SamplingParams

    raw = SpecConfig(method="prompt_lookup", typical_delta=1, max_ngram=2)
    checked = raw.validate()
    assert raw.typical_delta == 1 and type(raw.typical_delta) is int and raw.params == {"max_ngram": 2}
    assert type(checked.typical_delta) is float and checked.params.max_ngram == 2 and checked is not raw
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.k = 3
    # a drafter reading an unchecked spec's setting is told to validate it (not a bare error or a silent default)
    with pytest.raises(AttributeError, match="'branches' is read before the spec was validated"):
        PromptLookupDrafter(raw).propose([1, 2, 1], 2)
    sp = SamplingParams(temperature=1, stop="x")
    out = sp.validate()
    assert (sp.temperature, sp.stop) == (1, "x") and type(sp.temperature) is int
    assert (out.temperature, out.stop) == (1.0, ["x"]) and type(out.temperature) is float


def test_front_ends_reach_the_engine_only_through_prepare():
    """The library, the CLI, the server's batch worker and batchbench build a request's engine Job through
    ``SpecDecoder.prepare`` (one place checks it and builds its drafter): no other module of the package
    constructs ``Job``, except the engine itself and the training-data builders, whose rows are not requests
    (recording drafters on fixed prompts)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "specdraft"
    allowed = {"api.py", "engine.py"}
    found = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        if rel in allowed or rel.startswith("commands/train/"):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
                if name == "Job":
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"engine.Job built outside SpecDecoder.prepare: {found}"


def test_a_request_is_checked_once_and_its_drafter_built_once(tmp_path, monkeypatch, capsys):
    """``specdraft generate`` with the method left to auto, and the library with no spec: the request's spec
    is validated once (checked values pass through prepare and the drafter factories unchecked again) and the
    auto drafter is built once (the fallback decision uses the drafter it built)."""
    from conftest import tiny_model_dir
    from specdraft import cli
    from specdraft.core import config

    checks, builds = [], []
    real_checked, real_make = config.checked, SpecDecoder.make_drafter

    def counting_checked(obj):
        if isinstance(obj, SpecConfig) and obj.method == "auto":
            checks.append(obj)
        return real_checked(obj)

    def counting_make(self, spec):
        if spec.method == "auto":  # (auto builds its arms' drafters through make_drafter too)
            builds.append(spec)
        return real_make(self, spec)

    monkeypatch.setattr(config, "checked", counting_checked)
    monkeypatch.setattr(SpecDecoder, "make_drafter", counting_make)
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path / "home"))
    model = tiny_model_dir(tmp_path / "tiny")
    assert cli.main(["generate", "--target", str(model), "--max-new-tokens", "4", "--json", "x y"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "auto"
    assert (len(checks), len(builds)) == (1, 1)
    checks.clear(), builds.clear()
    dec = SpecDecoder.load(str(model), dtype="float32")
    dec.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
    assert (len(checks), len(builds)) == (1, 1)
