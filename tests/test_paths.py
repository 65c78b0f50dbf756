"""--backend auto (paths.py): a model's paths (backend + weights) measured here, and the one it takes:
autotune --paths' measured pick first, else the cheapest one-token forward of doctor's curves. Bad
paths and models that are no catalog name get one clear error."""

import json

import pytest

from specdraft import paths
from specdraft.api import SpecDecoder
from specdraft.cli import main
from specdraft.errors import ConfigError

pytest.importorskip("llama_cpp", reason="the llama path needs llama-cpp-python (make setup builds it)")
pytestmark = pytest.mark.slow


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """The paths file of each model in tmp_path (not the machine's cache)."""
    monkeypatch.setattr(paths, "file_for", lambda model: tmp_path / f"{model}.json")
    return tmp_path


def test_autotune_paths_picks_the_fastest_measured_and_backend_auto_takes_it(kept, capsys):
    rc = main(["autotune", "--target", "smollm2-135m", "--dtype", "float32", "--paths", "hf,llama", "--n", "2",
               "--max-new-tokens", "8", "--only", "prompt_lookup", "--no-tree-search", "-o", str(kept / "tune.json")])
    assert rc == 0
    doc = json.loads((kept / "smollm2-135m.json").read_text())
    tried = {t["path"]: t for t in doc["pick"]["tried"]}
    assert set(tried) == {"hf", "llama"} and all(t["plain_tokens_per_s"] > 0 for t in tried.values())
    fastest = max(tried, key=lambda p: tried[p]["tokens_per_s"])
    assert doc["pick"]["path"] == fastest
    assert json.loads((kept / "tune.json").read_text())["backend"] == fastest  # tuned on the chosen path
    capsys.readouterr()
    dec = SpecDecoder.load("smollm2-135m", dtype="float32", backend="auto")
    assert dec.backend == fastest
    assert f"backend auto: --backend {fastest} --target smollm2-135m: `specdraft autotune --paths`" in capsys.readouterr().err


def test_backend_auto_without_a_pick_takes_the_cheapest_one_token_curve(kept, capsys):
    paths.write("smollm2-135m", curves={"hf": {"1": 9.0, "8": 10.0}, "llama": {"1": 4.0, "8": 20.0}})
    assert paths.resolve("smollm2-135m") == ("smollm2-135m", "llama")
    paths.write("smollm2-135m", curves={"hf:w8a8": {"1": 3.0, "8": 3.5}})  # merged with the others
    assert paths.resolve("smollm2-135m") == ("smollm2-135m:w8a8", "hf")
    assert "the cheapest one-token forward" in capsys.readouterr().err


def test_bad_paths_and_models_are_one_clear_error(kept, capsys):
    rc = main(["autotune", "--target", "smollm2-135m", "--paths", "hf,gpu:fast"])
    assert rc == 2 and "error: path 'gpu:fast': unknown backend 'gpu'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="is not one: name a backend"):
        paths.resolve("/some/dir")
    rc = main(["generate", "--target", "/some/model.gguf", "--backend", "auto", "x"])
    assert rc == 2 and "--backend auto chooses among a catalog model's paths" in capsys.readouterr().err
