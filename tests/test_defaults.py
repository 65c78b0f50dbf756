"""Naming no method runs ``auto`` (library, `specdraft generate`, `serve`), falling back to the old default
(draft_model with a draft, else prompt_lookup) when auto cannot run; naming no backend runs a catalog model
on the path measured fastest here (``--backend auto``); `bench` names its report and plots."""

import json
import logging

import pytest

from conftest import tiny_llama, tiny_model_dir
from specdraft import api, cli
from specdraft.api import SpecDecoder
from specdraft.cli import _serve_settings, build_parser, models_from_args, spec_from_args
from specdraft.core import methods
from specdraft.core.config import SamplingParams, SpecConfig, spec_with_default
from specdraft.core.errors import ConfigError
from specdraft.drafters.runs_on import backends as method_backends
from specdraft.models import paths
from specdraft.models.backends import BACKENDS


def test_spec_with_default():
    assert spec_with_default(None, has_draft=False).method == "auto"
    assert spec_with_default({"k": 3}, has_draft=True).method == "auto"
    assert spec_with_default({"method": "plain"}, has_draft=True).method == "plain"
    # fields auto does not take: the method they were written for
    assert spec_with_default({"tree": "static"}, has_draft=True).method == "draft_model"


def test_cli_defaults_to_auto():
    for cmd in (["generate", "hi"], ["serve"]):
        a = build_parser().parse_args(cmd)
        spec = spec_from_args(a)
        assert spec.method == "auto" and a.method_defaulted
    a = build_parser().parse_args(["generate", "--method", "plain", "hi"])
    assert spec_from_args(a).method == "plain" and not a.method_defaulted


def test_library_defaults_to_auto_and_falls_back(tmp_path, caplog):
    dec = SpecDecoder(tiny_llama(vocab=16), None)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = dec.generate([1, 2, 3, 1, 2], sp, {"method": "plain"}).token_ids
    out = dec.generate([1, 2, 3, 1, 2], sp)  # no spec: auto, lossless
    assert out.token_ids == plain and out.stats.arms  # auto's steps name their arms
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        used = dec.usable(SpecConfig(method="auto", autotune=str(bad)))
    assert used.method == "prompt_lookup" and "auto cannot run here" in caplog.text
    with caplog.at_level(logging.WARNING, logger="specdraft"):
        assert dec.generate([1, 2, 3, 1, 2], sp, {"autotune": str(bad)}).token_ids == plain
    assert dec.usable(SpecConfig(method="plain")).method == "plain"


# --- the backend: a catalog model with no backend named takes auto's path; a named one is taken --------


class _Loads:
    """Stands in for the loaders: records what was asked, hands back a tiny model (nothing measured)."""

    def __init__(self, monkeypatch, failing=()):
        self.calls, self.failing, self.allowed, self.dtypes = [], set(failing), [], []
        monkeypatch.setattr(paths, "load_fastest", self.fastest)
        monkeypatch.setattr(api, "load_model", self.plain)

    def fastest(self, model, dtype=None, say=None, allowed=paths.Allowed(), shape=None, companion=None):
        self.calls.append(("auto", model, allowed.backends))
        self.allowed.append(allowed)
        self.shape = shape
        names = allowed.backends or tuple(BACKENDS)
        m, p = tiny_llama(vocab=16), paths.ModelPath("llama" if "llama" in names else names[0])
        return m, p, (companion(m, p) if companion is not None else None)

    def plain(self, name, dtype=None, num_layers=None, backend="hf"):
        self.calls.append((backend, name, None))
        self.dtypes.append(dtype)
        return tiny_llama(vocab=16)


def test_library_cli_and_server_default_to_backend_auto_on_a_catalog_model(monkeypatch):
    loads = _Loads(monkeypatch)
    SpecDecoder.load("smollm2-135m")
    a = build_parser().parse_args(["generate", "--target", "smollm2-135m", "hi"])
    models_from_args(a).load()
    s = build_parser().parse_args(["serve", "--target", "smollm2-135m"])
    _serve_settings(s)[0].load()
    assert [c[:2] for c in loads.calls] == [("auto", "smollm2-135m")] * 3


def test_a_named_backend_or_a_non_catalog_model_is_loaded_as_named(monkeypatch, tmp_path):
    loads = _Loads(monkeypatch)
    SpecDecoder.load("smollm2-135m", backend="hf")
    models_from_args(build_parser().parse_args(["generate", "--target", "smollm2-135m", "--backend", "hf", "x"])).load()
    SpecDecoder.load(str(tmp_path))  # a directory: transformers
    s = build_parser().parse_args(["generate", "--target", "smollm2-135m", "--method", "layer_skip", "x"])
    models_from_args(s, method_backends(methods.method("layer_skip"))).load()  # auto among the method's backends
    assert loads.calls == [
        ("hf", "smollm2-135m", None),
        ("hf", "smollm2-135m", None),
        ("hf", str(tmp_path), None),
        ("auto", "smollm2-135m", ("hf",)),
    ]


def test_backend_auto_takes_the_next_measured_path_when_one_fails_to_load(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(paths, "file_for", lambda model: tmp_path / f"{model}.json")
    curve = lambda one: {str(n): one * n for n in paths.CURVE_TOKENS}  # noqa: E731
    paths.write("smollm2-135m", curves={"openvino": curve(3.0), "llama": curve(4.0), "hf": curve(9.0)})
    tried = []

    def load(name, dtype="bfloat16", num_layers=None, backend="hf"):
        tried.append(backend)
        if backend == "openvino":
            raise ImportError("No module named 'openvino'")
        return tiny_llama(vocab=16)

    monkeypatch.setattr("specdraft.models.backends.load_model", load)
    m, p, _ = paths.load_fastest("smollm2-135m")
    assert tried == ["openvino", "llama"] and str(p) == "llama"
    err = capsys.readouterr().err
    assert "openvino cannot load here (No module named 'openvino'); taking the next measured path" in err
    assert "backend auto: --backend llama --target smollm2-135m: the cheapest one-token forward" in err
    assert paths.ranked("smollm2-135m", allowed=paths.Allowed(("hf",)))[0][0] == paths.ModelPath("hf")  # no measuring


def test_backend_auto_takes_the_next_path_when_its_backend_cannot_run_the_draft(monkeypatch, tmp_path, capsys):
    """A draft loads on the target's backend: a path whose backend cannot load it (OpenVINO and a file with
    tensor types it cannot read) is passed over for the next, with the draft loaded on that one."""
    from specdraft.core.errors import ModelFileError

    monkeypatch.setattr(paths, "file_for", lambda model: tmp_path / f"{model}.json")
    curve = lambda one: {str(n): one * n for n in paths.CURVE_TOKENS}  # noqa: E731
    paths.write("smollm2-135m", curves={"openvino": curve(3.0), "llama": curve(4.0)})
    tried = []

    def load(name, dtype="bfloat16", num_layers=None, backend="hf"):
        tried.append((backend, name))
        if backend == "openvino" and name == "the-draft":
            raise ModelFileError("OpenVINO GenAI cannot read the-draft.gguf: it holds Q5_0 tensors")
        return tiny_llama(vocab=16)

    monkeypatch.setattr(api, "load_model", load)
    monkeypatch.setattr("specdraft.models.backends.load_model", load)
    dec = api.SpecDecoder.load("smollm2-135m", draft="the-draft", backend="auto")
    assert tried == [
        ("openvino", "smollm2-135m"),
        ("openvino", "the-draft"),
        ("llama", "smollm2-135m"),
        ("llama", "the-draft"),
    ]
    assert dec.draft is not None
    err = capsys.readouterr().err
    assert "openvino cannot run the draft here (OpenVINO GenAI cannot read the-draft.gguf" in err
    assert "backend auto: --backend llama --target smollm2-135m" in err


# --- options the user gave narrow auto's choice; typed against a named backend they are one error ------


def _auto_choice(loads, argv):
    """The backends auto chose among for the command line ``argv`` (generate or serve), loading stubbed."""
    a = build_parser().parse_args(argv)
    if argv[0] == "serve":
        _serve_settings(a)[0].load()
    else:
        spec = spec_from_args(a)
        cli._check_before_loading(spec, a)
        models_from_args(a, cli._runs_on(spec)).load()
    return loads.allowed[-1]


def test_options_only_transformers_honours_make_auto_choose_transformers(monkeypatch):
    """--dtype float32 ran the 4-bit GGUF (auto took llama); --draft-layers and --draft self:int4 failed on
    llama instead of auto choosing the backend that has them."""
    loads = _Loads(monkeypatch)
    monkeypatch.setattr(api, "load_draft", lambda *a: tiny_llama(vocab=16))
    base = ["generate", "--target", "smollm2-135m"]
    cases = [
        (["--dtype", "float32", "--method", "plain"], "honours --dtype float32"),
        (["--draft", "smollm2-135m", "--draft-layers", "10", "--method", "draft_model"], "honours --draft-layers 10"),
        (["--draft", "self:int4", "--method", "draft_model"], "honours --draft self:int4"),
    ]
    for extra, because in cases:
        allowed = _auto_choice(loads, base + extra + ["x"])
        assert allowed.backends == ("hf",) and allowed.because == (because,), extra
    assert _auto_choice(loads, ["serve", "--target", "smollm2-135m", "--dtype", "bfloat16"]).backends == ("hf",)
    assert _auto_choice(loads, base + ["--draft", "self:Q4_0", "--method", "draft_model", "x"]).backends == (
        "llama",
        "openvino",
    )  # a GGUF variant: the backends that read one
    assert _auto_choice(loads, base + ["--method", "plain", "x"]).backends == tuple(BACKENDS)  # nothing given
    SpecDecoder.load("smollm2-135m", dtype="float32")  # the library: the same rule
    assert loads.allowed[-1].backends == ("hf",)
    SpecDecoder.load("smollm2-135m")
    assert loads.allowed[-1].backends == tuple(BACKENDS)
    # a --draft-backend answers for the draft's options (and a dense draft takes --dtype)
    s = ["--draft", "smollm2-135m", "--draft-layers", "2", "--draft-backend", "hf", "--method", "draft_model", "x"]
    assert _auto_choice(loads, base + s).backends == tuple(BACKENDS)
    assert _auto_choice(loads, base + ["--dtype", "float32"] + s).backends == tuple(BACKENDS)


def test_auto_says_which_option_chose_its_path(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(paths, "file_for", lambda model: tmp_path / f"{model}.json")
    got = []
    monkeypatch.setattr(
        "specdraft.models.backends.load_model",
        lambda name, dtype=None, num_layers=None, backend="hf": got.append((backend, dtype)) or tiny_llama(vocab=16),
    )
    a = build_parser().parse_args(
        ["generate", "--target", "smollm2-135m", "--dtype", "float32", "--method", "plain", "x"]
    )
    assert models_from_args(a, method_backends(methods.method("plain"))).load().backend == "hf"
    assert got == [("hf", "float32")]  # nothing measured: the one path that honours it
    err = capsys.readouterr().err
    assert err == "backend auto: --backend hf --target smollm2-135m: the only backend that honours --dtype float32\n"
    SpecDecoder.load("smollm2-135m", dtype="float32", backends=method_backends(methods.method("layer_skip")))
    assert capsys.readouterr().err.endswith("the only backend that runs this method and honours --dtype float32\n")


def test_an_option_against_the_backend_named_is_one_error_line(monkeypatch, capsys):
    loads = _Loads(monkeypatch)
    cases = [
        (
            ["--backend", "llama", "--dtype", "float32"],
            "error: --dtype float32 needs --backend hf; on llama, a GGUF file carries its own weight types",
        ),
        (
            ["--backend", "llama", "--draft", "smollm2-135m", "--draft-layers", "4", "--method", "draft_model"],
            "error: --draft-layers 4 needs --backend hf; on llama, only transformers loads a layer-truncated copy",
        ),
        (
            ["--backend", "openvino", "--draft", "self:int4", "--method", "draft_model"],
            "error: --draft self:int4 needs --backend hf; on openvino, int4 is a low-bit copy of dense weights",
        ),
        (
            [
                "--backend",
                "hf",
                "--draft",
                "x",
                "--draft-backend",
                "llama",
                "--draft-layers",
                "4",
                "--method",
                "draft_model",
            ],
            "error: --draft-layers 4 needs --draft-backend hf; on llama",
        ),
        (
            ["--dtype", "float32", "--draft", "self:Q4_0", "--method", "draft_model"],
            "error: --backend auto: no backend honours --dtype float32 and honours --draft self:Q4_0",
        ),
    ]
    for extra, want in cases:
        for cmd in (
            ["generate", "--target", "smollm2-135m", *extra, "x"],
            ["serve", "--target", "smollm2-135m", *extra],
        ):
            assert cli.main(cmd) == 2, cmd
            err = capsys.readouterr().err
            assert err.startswith(want) and err.count("\n") == 1, (cmd, err)
    assert loads.calls == []  # all before any model loads
    SpecDecoder.load("smollm2-135m", backend="llama", dtype="float32")  # the library keeps a named backend's dtype
    with pytest.raises(ConfigError, match="--draft self:int4 needs --backend hf; on llama"):  # (not: unknown type)
        SpecDecoder.load("smollm2-135m", backend="llama", draft="self:int4")


# --- a head given with the method left to auto is used, or the command fails ----------------------------


def _head_dir(d, config: dict):
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "head.safetensors").write_bytes(b"")
    return d


def test_a_head_that_cannot_run_under_auto_is_an_error_not_a_fallback(tmp_path, monkeypatch, capsys):
    """It was a warning and a prompt_lookup run (exit 0); the server started without it."""
    medusa = _head_dir(tmp_path / "medusa", {"type": "medusa", "hidden_size": 32, "heads": 2})
    for cmd in (
        ["generate", "--target", "smollm2-135m", "--head", str(medusa), "x"],
        ["serve", "--target", "smollm2-135m", "--head", str(medusa)],
    ):
        assert cli.main(cmd) == 2  # before any model loads
        assert capsys.readouterr().err.startswith(f"error: head {medusa} is a medusa head; method 'eagle3' needs")
    wrong = _head_dir(tmp_path / "eagle3", {"architectures": ["LlamaForCausalLMEagle3"]})  # no weights it reads
    dec = SpecDecoder(tiny_llama(vocab=16))
    with pytest.raises(ConfigError):
        dec.usable(SpecConfig(method="auto", head=str(wrong)))
    with pytest.raises(ConfigError):
        dec.generate([1, 2, 3], SamplingParams(max_new_tokens=2), {"head": str(wrong)})
    served = []
    monkeypatch.setattr("specdraft.server.graceful.serve", lambda app, *a: served.append(app))
    target = str(tiny_model_dir(tmp_path / "tiny"))
    for cmd in (
        ["generate", "--target", target, "--head", str(wrong), "--max-new-tokens", "2", "x"],
        ["serve", "--target", target, "--head", str(wrong)],
    ):
        assert cli.main(cmd) == 2, cmd
        err = capsys.readouterr().err  # (after the loaders' progress bars)
        assert err.splitlines()[-1].startswith("error: ") and "prompt_lookup" not in err, err
    assert not served  # the server refused to start


def test_costs_backend_auto_takes_the_dtype_given(monkeypatch, capsys):
    """`costs --backend auto --dtype float32` measured the GGUF file (auto took llama, costs then read no dtype)."""
    got = []
    monkeypatch.setattr("specdraft.bench.costs.main_costs", lambda opts: got.append(opts) or 0)
    assert cli.main(["costs", "--target", "smollm2-135m", "--backend", "auto", "--dtype", "float32"]) == 0
    assert (got[0].backend, got[0].dtype) == ("hf", "float32")
    assert "the only backend that honours --dtype float32" in capsys.readouterr().err
    assert cli.main(["costs", "--target", "smollm2-135m", "--backend", "llama", "--dtype", "float32"]) == 2
    assert capsys.readouterr().err.startswith("error: --dtype float32 needs --backend hf; on llama")
