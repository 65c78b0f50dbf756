"""Running on every x86 CPU: the llama.cpp probe (a child process that decodes multi-token batches),
the loader's fallback when the default buffers crash, setup's rebuild without the feature that
crashed, and `specdraft doctor`.

A crash is made on purpose where the CPU does not crash by itself: the probe's child kills itself with
SIGSEGV before a multi-token batch when SPECDRAFT_LLAMA_PROBE_CRASH says so ("extra": only with the
extra buffer types on, as ggml's AMX buffers do on an Intel Xeon with AMX; "all": always)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the llama backend needs llama-cpp-python (make setup builds it)")

from specdraft.models import llama_probe, llama_setup  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf():
    from specdraft.models import catalog

    catalog.pull("smollm2-135m")
    return catalog.gguf_path("smollm2-135m")


@pytest.fixture
def fresh_probe_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_probe, "cache_dir", lambda: tmp_path / "probe")
    return tmp_path / "probe"


def test_the_real_probe_decodes_every_batch_size(gguf):
    r = llama_probe.run_probe(gguf, True)
    assert r.ok, r.detail
    assert r.detail == "decoded batches of 1, 2, 8, 32 tokens"


def test_a_crashing_child_is_reported_and_the_parent_lives(gguf, monkeypatch):
    monkeypatch.setenv(llama_probe.CRASH_HOOK, "extra")
    r = llama_probe.run_probe(gguf, True)
    assert not r.ok and r.detail == "killed by SIGSEGV at a batch of 2 tokens"
    assert llama_probe.run_probe(gguf, False).ok


def test_loader_falls_back_without_extra_buffers(gguf, fresh_probe_cache, monkeypatch, capsys):
    from specdraft.models import llama

    monkeypatch.setenv(llama_probe.CRASH_HOOK, "extra")
    monkeypatch.setattr(llama, "_warned", set())
    m = llama.LlamaModel(gguf, name="smol-fallback")
    assert m.extra_bufts is False
    err = capsys.readouterr().err
    assert "default weight buffers crash on this CPU (a probe killed by SIGSEGV at a batch of 2 tokens)" in err
    assert "loading smol-fallback without its extra buffer types" in err
    rows = m.new_rows()
    rows.add_rows([[1, 2, 3]])
    assert rows.forward([[4, 5, 6, 7, 8, 9, 10, 11]]).shape == (1, 8, m.vocab_size)  # a multi-token batch decodes
    rec = llama_probe.probe_record(gguf)  # recorded: the next load does not probe again
    assert rec["extra_bufts"] is False and (fresh_probe_cache / f"{llama_probe.build_id()}.json").exists()


def test_nothing_works_is_one_error_line(gguf, fresh_probe_cache, monkeypatch, capsys):
    from specdraft.cli import main

    monkeypatch.setenv(llama_probe.CRASH_HOOK, "all")
    rc = main(
        [
            "generate",
            "--backend",
            "llama",
            "--target",
            "smollm2-135m",
            "--method",
            "prompt_lookup",
            "--max-new-tokens",
            "4",
            "hi",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: llama.cpp cannot decode multi-token batches")
    assert "killed by SIGSEGV at a batch of 2 tokens with its default buffers" in err[0]
    assert main(["serve", "--backend", "llama", "--target", "smollm2-135m", "--port", "0"]) == 2  # refuses to start
    assert capsys.readouterr().err.startswith("error: llama.cpp cannot decode")


def test_a_file_llama_cpp_cannot_load_is_its_own_error_and_never_kept(fresh_probe_cache, tmp_path):
    """A GGUF header over junk: the probe's child cannot load it, which says nothing about the build (it was
    blamed on this CPU and kept by file name and size)."""
    from specdraft.core.errors import ModelFileError
    from specdraft.models import llama

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelFileError, match="llama.cpp cannot load broken from .*broken.gguf .a probe exited"):
        llama.LlamaModel(broken, name="broken")
    assert not fresh_probe_cache.exists() or llama_probe._key(broken) not in llama_probe._seen(
        fresh_probe_cache / f"{llama_probe.build_id()}.json"
    )


def test_a_server_serves_with_the_fallback(gguf, fresh_probe_cache, monkeypatch):
    import httpx

    from server_util import running_server
    from specdraft.api import SpecDecoder
    from specdraft.models import llama

    monkeypatch.setenv(llama_probe.CRASH_HOOK, "extra")
    dec = SpecDecoder(llama.LlamaModel(gguf, name="smol-served"))
    with running_server(dec, default_spec={"method": "prompt_lookup", "k": 6}, max_batch=2) as (url, _):
        body = {"model": "smol", "prompt": [100, 200, 300] * 4, "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12


def fake_setup(tmp_path, monkeypatch, gguf, crashing: set[str], clang: bool = False):
    """setup() with the CMake build and pip install faked: 'installing' a variant named in
    ``crashing`` makes the probe's child crash on multi-token batches, as AMX does on a real Xeon."""
    built, installed = [], []
    monkeypatch.setattr(llama_setup, "cpu_flags", lambda: ["avx", "avx2", "avx512f", "amx_tile", "amx_int8"])
    monkeypatch.setattr(llama_setup.shutil, "which", lambda name: f"/usr/bin/{name}" if clang else None)
    monkeypatch.setattr(llama_setup, "cache_root", lambda: tmp_path / "wheels")
    monkeypatch.setattr(llama_probe, "cache_dir", lambda: tmp_path / "probe")

    def build(variant, off, out):
        built.append((variant, off))
        out.mkdir(parents=True)
        (out / "llama_cpp_python-0-x.whl").write_text(variant)
        return out / "llama_cpp_python-0-x.whl"

    def install(wheel: Path):
        installed.append(wheel.read_text())
        monkeypatch.setenv(llama_probe.CRASH_HOOK, "all" if wheel.read_text() in crashing else "")

    (tmp_path / "wheels").mkdir(exist_ok=True)

    def run():
        return llama_setup.setup(tmp_path / "venv-marker", build=build, install=install, probe_model=lambda: gguf)

    return run, built, installed


def test_setup_rebuilds_without_amx_and_remembers(gguf, tmp_path, monkeypatch, capsys):
    run, built, installed = fake_setup(tmp_path, monkeypatch, gguf, crashing={"native"})
    assert run() == "no-amx"
    assert built == [("native", None), ("no-amx", {"amx"})]
    err = capsys.readouterr().err
    assert (
        "llama.cpp's native build crashed on this CPU (a probe killed by SIGSEGV at a batch of 2 tokens); "
        "trying the next build (without AMX)"
    ) in err
    assert "llama.cpp (no-amx build) decoded batches of 1, 2, 8, 32 tokens on SmolLM2" in err
    assert run() == "no-amx" and len(built) == 2  # the venv has it: nothing to do
    (tmp_path / "venv-marker").unlink()  # a new venv on this CPU: the working wheel, no build, no native
    assert run() == "no-amx" and len(built) == 2 and installed[-1] == "no-amx"


def test_setup_builds_amx_with_clang_where_clang_is_installed(gguf, tmp_path, monkeypatch, capsys):
    run, built, _ = fake_setup(tmp_path, monkeypatch, gguf, crashing={"native"}, clang=True)
    assert run() == "amx-clang" and built == [("native", None), ("amx-clang", set())]
    assert "trying the next build (with clang and ggml's AMX kernels)" in capsys.readouterr().err


def test_setup_fails_clearly_when_nothing_decodes(gguf, tmp_path, monkeypatch):
    run, built, _ = fake_setup(
        tmp_path, monkeypatch, gguf, crashing={"native", "amx-clang", "no-amx", "no-avx512"}, clang=True
    )
    with pytest.raises(SystemExit, match="no llama.cpp build decodes multi-token batches on this CPU"):
        run()
    assert [b[0] for b in built] == ["native", "amx-clang", "no-amx", "no-avx512"]


def test_cmake_args_name_every_feature(monkeypatch):
    monkeypatch.setattr(llama_setup, "cpu_flags", lambda: ["avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"])
    assert llama_setup.cmake_args(None).startswith("-DGGML_NATIVE=ON")
    no_amx = llama_setup.cmake_args({"amx"}).split()
    assert {
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX512=ON",
        "-DGGML_AVX512_BF16=ON",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AVX512_VNNI=OFF",
    } <= set(no_amx)
    assert {"-DGGML_AVX2=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF"} <= set(
        llama_setup.cmake_args({"amx", "avx512"}).split()
    )


@pytest.mark.long
def test_doctor(gguf, monkeypatch, capsys, tmp_path):
    from specdraft.cli import main
    from specdraft.models import paths

    monkeypatch.setattr(paths, "file_for", lambda model: tmp_path / f"{model}.json")  # the curves it keeps
    assert main(["doctor", "--model", "smollm2-135m", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for line in ("cpu ", "torch ", "llama ", "probe ", "models ", "costs ", "pick ", "status   ok"):
        assert line in out, out
    assert "hf " in out and "hf:w8a8 " in out and "llama " in out and "(what --backend auto takes here)" in out
    assert "openvino" in out  # measured, or the note that OpenVINO cannot convert this model
    kept = json.loads((tmp_path / "smollm2-135m.json").read_text())["curves"]
    assert {"hf", "hf:w8a8", "llama"} <= set(kept) and all(c["1"] > 0 for c in kept.values())


def test_doctor_says_when_llama_is_unusable(gguf, fresh_probe_cache, monkeypatch, capsys):
    from specdraft.cli import main

    monkeypatch.setenv(llama_probe.CRASH_HOOK, "all")
    assert main(["doctor", "--no-costs"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: SmolLM2-135M-Instruct.Q4_1.gguf: llama.cpp killed by SIGSEGV" in out
    assert "status   1 problem(s)" in out
