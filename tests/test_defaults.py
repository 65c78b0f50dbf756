"""Naming no method runs ``auto`` (library, `specdraft generate`, `serve`), falling back to the old default
(draft_model with a draft, else prompt_lookup) when auto cannot run; naming no backend runs a catalog model
on the path measured fastest here (``--backend auto``); `bench` names its report and plots."""

import logging

from conftest import tiny_llama
from specdraft import api
from specdraft.drafters import registry as methods
from specdraft.models import paths
from specdraft.api import SpecDecoder
from specdraft.cli import _serve_settings, build_parser, models_from_args, spec_from_args
from specdraft.core.config import SamplingParams, SpecConfig, spec_with_default


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
        self.calls, self.failing = [], set(failing)
        monkeypatch.setattr(paths, "load_fastest", self.fastest)
        monkeypatch.setattr(api, "load_model", self.plain)

    def fastest(self, model, dtype="bfloat16", say=None, backends=None, shape=None):
        self.calls.append(("auto", model, backends))
        self.shape = shape
        return tiny_llama(vocab=16), paths.ModelPath("llama")

    def plain(self, name, dtype="bfloat16", num_layers=None, backend="hf"):
        self.calls.append((backend, name, None))
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
    models_from_args(s, methods.method("layer_skip").backends).load()  # auto among the method's backends
    assert loads.calls == [("hf", "smollm2-135m", None), ("hf", "smollm2-135m", None), ("hf", str(tmp_path), None),
                           ("auto", "smollm2-135m", ("hf",))]


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
    m, p = paths.load_fastest("smollm2-135m")
    assert tried == ["openvino", "llama"] and str(p) == "llama"
    err = capsys.readouterr().err
    assert "openvino cannot load here (No module named 'openvino'); taking the next measured path" in err
    assert "backend auto: --backend llama --target smollm2-135m: the cheapest one-token forward" in err
    assert paths.ranked("smollm2-135m", backends=("hf",))[0][0] == paths.ModelPath("hf")  # no measuring
