"""Bad input gets a precise error naming the problem, never a stack trace or silent garbage."""

import json
import subprocess
import sys
import zipfile

import pytest

from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.core.errors import ConfigError, ModelFileError, TokenizerMismatchError
from specdraft.models import catalog
from specdraft.models.backends import load_model
from specdraft.models.loading import check_same_tokenizer


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
    ],
)
def test_invalid_sampling_params(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        SamplingParams(**kw).validate()


@pytest.mark.parametrize(
    "d,msg",
    [
        ({"method": "medusa2"}, "unknown method 'medusa2'; choose one of: plain, draft_model, prompt_lookup"),
        ({"k": 0}, r"k \(draft tokens per step\) must be >= 1"),
        ({"k": 8, "max_k": 4}, "max_k must be >= k"),
        ({"method": "prompt_lookup", "min_ngram": 3, "max_ngram": 2}, "need 1 <= min_ngram <= max_ngram"),
        ({"kk": 3}, r"unknown SpecConfig field\(s\) \['kk'\]"),
    ],
)
def test_invalid_spec_config(d, msg):
    with pytest.raises(ConfigError, match=msg):
        SpecConfig.from_dict(d)


def test_spec_config_json_roundtrip():
    c = SpecConfig(method="prompt_lookup", k=6, max_ngram=4).validate()
    assert SpecConfig.from_json(json.dumps(c.to_dict())) == c
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpecConfig.from_json("{method: plain")


def _fake_wheel(path, member, payload):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)


def test_sha256_mismatch_is_refused(tmp_path):
    spec = catalog.ModelSpec(
        name="fake",
        description="",
        packages=("a==1", "b==1"),
        members=("a/data/part01.bin", "b/data/part02.bin"),
        gguf_name="fake.gguf",
        sha256="0" * 64,
        size=6,
    )
    _fake_wheel(tmp_path / "a.whl", "a/data/part01.bin", b"abc")
    _fake_wheel(tmp_path / "b.whl", "b/data/part02.bin", b"def")
    out = tmp_path / "fake.gguf"
    with pytest.raises(ModelFileError, match="SHA-256 mismatch for assembled fake.gguf"):
        catalog.assemble_gguf(spec, [tmp_path / "a.whl", tmp_path / "b.whl"], out)
    assert not out.exists() and not out.with_suffix(".partial").exists()
    import hashlib

    good = catalog.ModelSpec(**{**spec.__dict__, "sha256": hashlib.sha256(b"abcdef").hexdigest()})
    catalog.assemble_gguf(good, [tmp_path / "a.whl", tmp_path / "b.whl"], out)
    assert out.read_bytes() == b"abcdef"
    out.write_bytes(b"abcdeX")
    with pytest.raises(ModelFileError, match="SHA-256 mismatch"):
        catalog.verify_sha256(out, good.sha256)


def test_broken_wheel_is_refused(tmp_path):
    spec = catalog.ModelSpec(
        name="fake",
        description="",
        packages=("a==1",),
        members=("a/data/x.bin",),
        gguf_name="fake.gguf",
        sha256="0" * 64,
        size=1,
    )
    (tmp_path / "a.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelFileError, match="broken or lacks"):
        catalog.assemble_gguf(spec, [tmp_path / "a.whl"], tmp_path / "fake.gguf")


def test_broken_model_files(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelFileError, match="has no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{ this is not json")
    with pytest.raises(ModelFileError, match="could not load model"):
        load_model(str(tmp_path))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelFileError, match="could not load model"):
        load_model(str(bad))
    with pytest.raises(Exception, match="unknown model 'gpt-17'"):
        catalog.get_spec("gpt-17")


class _Tok:
    def __init__(self, vocab):
        self.v = vocab

    def get_vocab(self):
        return dict(self.v)


class _M:
    def __init__(self, name, vocab, rows):
        self.name, self.tokenizer, self.vocab_size = name, _Tok(vocab), rows


def test_tokenizer_mismatch_unit():
    a = _M("t", {"a": 0, "b": 1, "c": 2}, 4)
    b = _M("d", {"a": 0, "c": 1, "b": 2}, 4)  # same tokens, other ids, same embedding rows
    with pytest.raises(TokenizerMismatchError, match="different tokenizers.*same token, other id"):
        check_same_tokenizer(a, b)
    check_same_tokenizer(a, _M("d2", {"a": 0, "b": 1, "c": 2}, 8))  # padded rows are fine


@pytest.mark.slow
def test_tokenizer_mismatch_real(smol_f32):
    from transformers import AutoTokenizer

    qtok = AutoTokenizer.from_pretrained(str(catalog.pull("qwen2.5-coder-0.5b")))
    with pytest.raises(TokenizerMismatchError, match="different tokenizers"):
        check_same_tokenizer(smol_f32, _M("qwen2.5-coder-0.5b", qtok.get_vocab(), 151936))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "specdraft.cli", *args], capture_output=True, text=True, timeout=600)


def test_cli_errors_are_one_line():
    r = _cli("generate", "--target", "smollm2-135m", "--backend", "hf", "--method", "nope", "hi")
    assert r.returncode == 2 and r.stderr.strip().startswith("error: unknown method 'nope'")
    assert "Traceback" not in r.stderr
    r = _cli("generate", "--target", "smollm2-135m", "--backend", "hf", "--temperature", "-1", "hi")
    assert r.returncode == 2 and "temperature must be" in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", "--target", "smollm2-135m", "--backend", "hf", "--method", "draft_model", "hi")
    assert r.returncode == 2 and "needs --draft" in r.stderr


@pytest.mark.slow
@pytest.mark.long
def test_cli_cross_tokenizer_tree_and_long_prompt():
    r = _cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--backend",
        "hf",
        "--draft",
        "qwen2.5-coder-0.5b",
        "--method",
        "draft_model",
        "--tree",
        "dynamic",
        "hi",
    )
    assert r.returncode == 2 and "drafts chains through text" in r.stderr and "Traceback" not in r.stderr
    r = _cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--backend",
        "hf",
        "--method",
        "plain",
        "--max-new-tokens",
        "2",
        "word " * 9000,
    )
    assert r.returncode == 2 and "context is 8192 tokens" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.long
def test_cli_generate_json():
    r = _cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--backend",
        "hf",
        "--method",
        "prompt_lookup",
        "--k",
        "3",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
        "--chat",
        "--json",
        "Name three colors.",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert isinstance(d["text"], str) and len(d["token_ids"]) == d["stats"]["new_tokens"] <= 12
    for key in ("new_tokens", "steps", "drafted", "accepted", "mat", "acceptance_rate", "tokens_per_s", "wall_s"):
        assert key in d["stats"]
    r2 = _cli(
        "generate",
        "--target",
        "smollm2-135m",
        "--backend",
        "hf",
        "--method",
        "plain",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
        "--chat",
        "--json",
        "Name three colors.",
    )
    assert json.loads(r2.stdout)["token_ids"] == d["token_ids"]


def test_bad_dataset_is_one_error_line(tmp_path):
    empty, no_prompt, missing = tmp_path / "empty.jsonl", tmp_path / "rows.jsonl", tmp_path / "missing.jsonl"
    empty.write_text("\n")
    no_prompt.write_text('{"turns": ["fine"]}\n{"category": "qa", "turns": "not a list"}\n')
    for path, want in [
        (empty, f"dataset {empty} has no rows"),
        (no_prompt, f"{no_prompt}:2: no prompt"),
        (missing, f"dataset {missing} not found"),
    ]:
        r = _cli("bench", "--target", "smollm2-135m", "--methods", "plain", "--dataset", str(path))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {want}"), r.stderr


def test_a_file_that_is_not_gguf_is_named_so_and_never_kept_as_the_builds_verdict(tmp_path, monkeypatch):
    """A quantized-variant record pointing at a file of the right size that is no GGUF file was blamed on the
    llama.cpp build ("cannot decode multi-token batches on this CPU"), and that verdict kept by file name and
    size for the real file later."""
    from specdraft.models import llama_probe, quantize

    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))
    fake = tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf"
    fake.write_bytes(b"<html>not a model</html>")
    (tmp_path / "quantized.json").write_text(json.dumps({"smollm2-135m:Q8_0": {"path": str(fake), "size": 24}}))
    with pytest.raises(ModelFileError, match=f"{fake}, registered as smollm2-135m:Q8_0, is not a GGUF file"):
        quantize.variant_path("smollm2-135m", "Q8_0")
    with pytest.raises(ModelFileError, match=f"{fake} is not a GGUF file"):
        llama_probe.probe_record(fake)
    assert not llama_probe.cache_dir().exists()  # nothing probed, nothing kept


def test_two_quantizes_of_one_variant_at_once_both_get_the_file(tmp_path, monkeypatch):
    """Both wrote NAME.Q8_0.partial and renamed it: the second rename died with FileNotFoundError. Now the
    second waits for the first and takes its file (llama.cpp's quantizer and loader faked: no llama.cpp)."""
    import ctypes
    import threading
    import time

    from specdraft.models import llama, quantize

    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))
    src = tmp_path / "gguf" / catalog.MODELS["smollm2-135m"].gguf_name
    src.parent.mkdir()
    src.write_bytes(b"GGUF source")
    monkeypatch.setattr(catalog, "pull", lambda name, convert=True: tmp_path / "dense")
    monkeypatch.setattr(catalog, "gguf_path", lambda name: src)
    runs = []

    class Params(ctypes.Structure):
        _fields_ = [("ftype", ctypes.c_int), ("nthread", ctypes.c_int), ("allow_requantize", ctypes.c_bool)]

    class FakeLib:
        llama_model_quantize_default_params = Params

        def llama_model_quantize(self, src_path, dst_path, params):
            runs.append(dst_path)
            with open(dst_path, "wb") as f:  # opened first, written for minutes, as llama.cpp's is
                time.sleep(0.3)  # (both callers inside at once)
                f.write(b"GGUF quantized")
            return 0

    monkeypatch.setattr(llama, "lib", FakeLib)
    monkeypatch.setattr(llama, "LlamaModel", lambda path, tok, name=None: None)
    got, errors = [], []

    def one():
        try:
            got.append(quantize.quantize("smollm2-135m", "Q8_0"))
        except Exception as e:  # noqa: BLE001 (the test reports whatever escaped)
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 2 and got[0] == got[1] and got[0].read_bytes() == b"GGUF quantized"
    assert len(runs) == 1  # the second took the first's file
    assert quantize.variant_path("smollm2-135m", "Q8_0") == got[0]
    assert not list(src.parent.glob("*.partial"))
