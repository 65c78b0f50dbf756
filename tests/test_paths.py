"""--backend auto (paths.py): a model's paths (backend + weights) measured here, and the one it takes:
autotune --paths' measured pick first, else the cheapest one-token forward of doctor's curves. Bad
paths and models that are no catalog name get one clear error."""

import dataclasses
import json
from importlib.util import find_spec

import pytest

from specdraft.api import SpecDecoder
from specdraft.cli import main
from specdraft.core.errors import ConfigError
from specdraft.models import paths


def slow_llama(test):
    """A test that measures real paths (the llama one needs llama-cpp-python, which make setup builds)."""
    skip = pytest.mark.skipif(find_spec("llama_cpp") is None, reason="the llama path needs llama-cpp-python")
    return pytest.mark.slow(skip(test))


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """The paths file of each model in tmp_path (not the machine's cache)."""
    monkeypatch.setattr(paths, "file_for", lambda model: tmp_path / f"{model}.json")
    return tmp_path


@slow_llama
@pytest.mark.long
def test_autotune_paths_picks_the_fastest_measured_and_backend_auto_takes_it(kept, capsys):
    rc = main(
        [
            "autotune",
            "--target",
            "smollm2-135m",
            "--dtype",
            "float32",
            "--paths",
            "hf,llama",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--only",
            "prompt_lookup",
            "--no-tree-search",
            "-o",
            str(kept / "tune.json"),
        ]
    )
    assert rc == 0
    doc = json.loads((kept / "smollm2-135m.json").read_text())
    tried = {t["path"]: t for t in doc["pick"]["tried"]}
    assert set(tried) == {"hf", "llama"} and all(t["plain_tokens_per_s"] > 0 for t in tried.values())
    fastest = max(tried, key=lambda p: tried[p]["tokens_per_s"])
    assert doc["pick"]["path"] == fastest
    assert json.loads((kept / "tune.json").read_text())["backend"] == fastest  # tuned on the chosen path
    capsys.readouterr()
    dec = SpecDecoder.load("smollm2-135m", backend="auto")
    assert dec.backend == fastest
    assert (
        f"backend auto: --backend {fastest} --target smollm2-135m: `specdraft autotune --paths`"
        in capsys.readouterr().err
    )
    assert SpecDecoder.load("smollm2-135m", dtype="float32", backend="auto").backend == "hf"  # a dtype given: hf's
    assert "the only backend that honours --dtype float32" in capsys.readouterr().err


@slow_llama
def test_backend_auto_without_a_pick_takes_the_cheapest_one_token_curve(kept, capsys):
    paths.write("smollm2-135m", curves={"hf": {"1": 9.0, "8": 10.0}, "llama": {"1": 4.0, "8": 20.0}})
    assert paths.resolve("smollm2-135m") == ("smollm2-135m", "llama")
    paths.write("smollm2-135m", curves={"hf:w8a8": {"1": 3.0, "8": 3.5}})  # merged with the others
    assert paths.resolve("smollm2-135m") == ("smollm2-135m:w8a8", "hf")
    assert "the cheapest one-token forward" in capsys.readouterr().err


@slow_llama
def test_bad_paths_and_models_are_one_clear_error(kept, capsys):
    rc = main(["autotune", "--target", "smollm2-135m", "--paths", "hf,gpu:fast"])
    assert rc == 2 and "error: path 'gpu:fast': unknown backend 'gpu'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="is not one: name a backend"):
        paths.resolve("/some/dir")
    rc = main(["generate", "--target", "/some/model.gguf", "--backend", "auto", "x"])
    assert rc == 2 and "--backend auto chooses among a catalog model's paths" in capsys.readouterr().err


# contents of the paths file that crashed --backend auto, doctor and autotune --paths with a traceback
BAD = [
    b'{"pick":"hf"}',
    b'{"pick":["hf"]}',
    b'{"pick":{"path":"hf"}}',
    b'{"pick":{"path":7,"tokens_per_s":1}}',
    b'{"pick":{"path":"hf","tokens_per_s":"fast"}}',
    b'{"curves":["hf"]}',
    b'{"curves":{"hf":5}}',
    b'{"hf":5}',
    b'{"curves":{"hf":{"one":3}}}',
    b'{"curves":{"hf":{"4":3}}}',
    b'{"curves":{"hf":{"1":null}}}',
    b"\xff\xfe{}",
    # digits str.isdigit() takes and int() refuses
    '{"curves":{"hf":{"1":3,"8":4,"²":5}}}'.encode(),
    '{"curves":{"llama":{"1":3,"8":4,"¹":5}}}'.encode(),
]
COMMANDS = [
    ["generate", "--target", "smollm2-135m", "--backend", "auto", "x"],
    ["doctor", "--model", "smollm2-135m"],
    ["autotune", "--target", "smollm2-135m", "--paths", "hf,llama"],
]


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("content", BAD)
def test_a_bad_paths_file_is_one_error_line_naming_it(home, content, capsys):
    f = paths.file_for("smollm2-135m")
    f.parent.mkdir(parents=True)
    f.write_bytes(content)
    for argv in COMMANDS:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: the paths file {f}: ") and err.count("\n") == 1, err
    with pytest.raises(ConfigError, match="the paths file"):  # and a write merges into it only when it is sound
        paths.write("smollm2-135m", curves={"hf": {"1": 1.0, "4": 1.0, "8": 1.0, "16": 1.0}})


def test_an_unwritable_home_is_said_before_measuring(home, capsys):
    """With $SPECDRAFT_HOME/paths a file, autotune --paths measured every path, then died (FileExistsError)."""
    (home / "paths").write_text("a file where the folder goes")
    for argv in COMMANDS:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot write the paths file in {home / 'paths'}") and err.count("\n") == 1, err


# --- a request's shape: prefill against decoding -----------------------------------------------------
# llama.cpp decodes faster (35 ms a token against 52), OpenVINO prefills 1.76x faster: the shape decides
CURVES = {"llama": {"1": 35.0, "4": 60.0, "8": 80.0}, "openvino": {"1": 52.0, "4": 55.0, "8": 60.0}}
PREFILL = {"llama": {"32": 100.0, "512": 1600.0}, "openvino": {"32": 57.0, "512": 910.0}}
RAG, CHAT = paths.RequestShape(2000, 32), paths.RequestShape(40, 512)


def test_backend_auto_takes_the_path_fastest_end_to_end_for_the_requests_shape(kept, capsys):
    paths.write("smollm2-135m", curves=CURVES, prefill=PREFILL)
    assert paths.resolve("smollm2-135m", shape=RAG) == ("smollm2-135m", "openvino")  # a long prompt, a short answer
    err = capsys.readouterr().err
    assert "the fastest path end to end for 2000 prompt tokens and 32 new tokens: about 5.2 s" in err
    assert "`specdraft doctor`'s one-token forward); llama 7.4 s" in err
    assert paths.resolve("smollm2-135m", shape=CHAT) == ("smollm2-135m", "llama")  # a short prompt, a long answer
    assert paths.resolve("smollm2-135m") == ("smollm2-135m", "llama")  # no shape: the cheapest one-token forward


def test_autotune_paths_decoding_speeds_count_for_the_shape(kept):
    """autotune --paths measured whole requests: its decode phase (auto's, where it drafts) and prefill per
    token stand in for doctor's curves."""
    tried = [
        {"path": "llama", "tokens_per_s": 20.0, "decode_tokens_per_s": 20.0, "prefill_ms_per_token": 3.0},
        {"path": "openvino", "tokens_per_s": 21.0, "decode_tokens_per_s": 40.0, "prefill_ms_per_token": 1.7},
    ]
    paths.write("smollm2-135m", pick={"path": "openvino", "tokens_per_s": 21.0, "tried": tried})
    assert paths.resolve("smollm2-135m", shape=CHAT) == ("smollm2-135m", "openvino")  # auto's 40 tok/s there
    costs = paths.path_costs(paths.read("smollm2-135m"))
    assert costs["llama"].seconds(paths.RequestShape(1000, 100)) == pytest.approx((3.0, 5.0))


def test_a_file_without_prefill_costs_chooses_as_before_and_says_so(kept, capsys):
    paths.write("smollm2-135m", curves=CURVES)  # written before prefill was measured
    assert paths.resolve("smollm2-135m", shape=RAG) == ("smollm2-135m", "llama")
    err = capsys.readouterr().err
    assert "no prefill costs kept for llama, openvino (`specdraft doctor --model smollm2-135m` measures them)" in err
    paths.write("smollm2-135m", prefill={"llama": PREFILL["llama"]})  # merged per path; openvino's still missing
    assert paths.read("smollm2-135m")["curves"] == CURVES
    assert paths.resolve("smollm2-135m", shape=RAG) == ("smollm2-135m", "llama")
    assert "no prefill costs kept for openvino" in capsys.readouterr().err


def test_the_cli_and_the_library_pass_the_requests_shape(kept, monkeypatch):
    """generate knows its prompt and max_new_tokens; SpecDecoder.load takes a shape and loads the path it picks."""
    from conftest import tiny_llama

    paths.write("smollm2-135m", curves=CURVES, prefill=PREFILL)
    loaded = []
    monkeypatch.setattr(
        "specdraft.models.backends.load_model",
        lambda name, dtype="bfloat16", num_layers=None, backend="hf": loaded.append(backend) or tiny_llama(vocab=16),
    )
    assert SpecDecoder.load("smollm2-135m", shape=RAG).backend == "hf" and loaded == ["openvino"]  # (a tiny stand-in)
    seen = {}

    def load(**kw):
        seen.update(kw)
        raise ConfigError("stop here")

    monkeypatch.setattr(SpecDecoder, "load", staticmethod(load))
    assert main(["generate", "--target", "smollm2-135m", "--chat", "--max-new-tokens", "300", "x" * 400]) == 2
    assert seen["shape"] == paths.RequestShape(100 + paths.CHAT_TOKENS, 300)


def test_autotune_paths_keeps_each_paths_decode_phase_and_prefill(kept, monkeypatch):
    from conftest import tiny_llama
    from specdraft.api import ModelSettings
    from specdraft.commands.autotune import AutotuneOptions, screen_paths
    from specdraft.core.config import SamplingParams

    monkeypatch.setattr(ModelSettings, "load", lambda self, **kw: SpecDecoder(tiny_llama(vocab=16)))
    opts = AutotuneOptions(models=ModelSettings("smollm2-135m"), paths="hf,llama")
    rows = [{"id": i, "prompt": [1, 2, 3, 4] * (i + 1)} for i in range(2)]
    screen_paths(opts, rows, SamplingParams(max_new_tokens=6), threads=1)
    tried = paths.read("smollm2-135m")["pick"]["tried"]
    assert [t["path"] for t in tried] == ["hf", "llama"]
    assert all(t["decode_tokens_per_s"] > 0 and t["prefill_ms_per_token"] > 0 for t in tried)
    assert set(paths.path_costs(paths.read("smollm2-135m"))) == {"hf", "llama"}  # what a request's shape is weighed by


# --- the first run: what --backend auto measures when nothing was kept ----------------------------------
def test_nothing_kept_measures_briefly_and_converts_nothing(kept, monkeypatch):
    """A fresh models' home: each backend's first path measured briefly (no 512-token prefill, one repeat),
    and the paths whose weights would first be converted (transformers' dense copy, OpenVINO's IR) left out
    while another path runs without converting."""
    from specdraft.models import backends

    calls = []

    def fake_measure(model, todo, dtype=None, say=print, fail=None, repeats=3, **kw):
        calls.append((list(todo), repeats, kw))
        return {p: {1: 30.0, 4: 60.0, 8: 90.0} for p in todo}

    monkeypatch.setattr(paths, "measure_curves", fake_measure)
    monkeypatch.setattr(paths, "read", lambda model: {})
    monkeypatch.setattr(paths, "check_writable", lambda model: {})
    for name, converts in (("hf", True), ("openvino", True), ("llama", False)):
        monkeypatch.setitem(
            backends.BACKENDS, name, dataclasses.replace(backends.BACKENDS[name], converts=lambda m, c=converts: c)
        )
    said = []
    paths.ranked("qwen2.5-coder-1.5b", say=said.append)
    ((todo, repeats, kw),) = calls
    assert todo == ["llama"] and repeats == 1
    assert max(kw["prefill_tokens"]) < 512 and kw["tokens"] == paths.QUICK_CURVE_TOKENS
    assert any("not measuring hf, openvino" in s for s in said), said
    calls.clear()  # nothing runs without converting: then every path is measured (briefly) rather than none
    monkeypatch.setitem(
        backends.BACKENDS, "llama", dataclasses.replace(backends.BACKENDS["llama"], converts=lambda m: True)
    )
    paths.ranked("qwen2.5-coder-1.5b", say=said.append)
    assert calls[0][0] == ["hf", "llama", "openvino"]


def test_the_gguf_backends_never_make_the_dense_copy(tmp_path, monkeypatch):
    """A catalog model on llama.cpp / OpenVINO reads its GGUF file and a tokenizer directory: transformers'
    dense copy (minutes for the 1.5B) is made only when --backend hf loads the model."""
    from specdraft.models import backends, catalog

    asked = []
    monkeypatch.setattr(catalog, "pull", lambda name, convert=True: asked.append(convert) or tmp_path / "x.gguf")
    monkeypatch.setattr(catalog, "tokenizer_dir", lambda name: asked.append("tokenizer") or tmp_path / "tok")
    gguf, tok = backends.resolve_gguf("qwen2.5-coder-1.5b")
    assert tok == str(tmp_path / "tok") and gguf.name.endswith(".gguf")
    assert asked == ["tokenizer"], asked  # the tokenizer directory only: no pull, so no dense conversion


def test_models_pull_takes_dense_before_or_after_the_names(monkeypatch, capsys):
    from specdraft.models import catalog

    asked = []
    monkeypatch.setattr(catalog, "tokenizer_dir", lambda name: None)
    monkeypatch.setattr(catalog, "pull", lambda name, convert=True: asked.append((name, convert)) or name)
    for argv in (["models", "pull", "--dense", "smollm2-135m"], ["models", "pull", "smollm2-135m", "--dense"]):
        asked.clear()
        assert main(argv) == 0 and asked == [("smollm2-135m", True)], argv
    asked.clear()
    assert main(["models", "pull", "smollm2-135m"]) == 0 and asked == [("smollm2-135m", False)]
    with pytest.raises(SystemExit):  # an unknown flag is still argparse's error
        main(["models", "pull", "smollm2-135m", "--bogus"])
