"""The package's dependencies: pyproject.toml's ranges admit the exact pins `make setup` installs
(requirements*.txt), each optional dependency's extra is the one core/extras.py names, and a missing
optional package is one line naming the extra to install, wherever it is first needed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import smol_files
from specdraft.core.extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins() -> dict[str, str]:
    """{package: version} of every ``name==version`` line of requirements*.txt."""
    out = {}
    for f in ROOT.glob("requirements*.txt"):
        for line in f.read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
            if m:
                out[canonicalize_name(m[1])] = m[2]
    return out


def declared() -> list[Requirement]:
    reqs = PROJECT["dependencies"] + [r for extra in PROJECT["optional-dependencies"].values() for r in extra]
    return [Requirement(r) for r in reqs if not r.startswith("specdraft[")]


def test_every_range_admits_its_pin():
    pinned = pins()
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req.name} is declared in pyproject.toml but pinned in no requirements*.txt"
        assert req.specifier.contains(pinned[name]), f"{req} does not admit the pin {req.name}=={pinned[name]}"


def test_extras_are_the_ones_the_messages_name():
    extras = PROJECT["optional-dependencies"]
    assert set(EXTRAS) <= set(extras), set(EXTRAS) - set(extras)
    for name, extra in EXTRAS.items():
        for r in extras[name]:
            if not r.startswith("specdraft["):
                assert canonicalize_name(Requirement(r).name) in canonicalize_name(extra.packages), (name, r)


def _cli_line(capsys, *argv) -> str:
    from specdraft.cli import main

    assert main(list(argv)) == 2
    return capsys.readouterr().err


def _raised(fn) -> str:
    from specdraft.core.errors import SpecDraftError

    with pytest.raises(SpecDraftError) as e:
        fn()
    return str(e.value)


def _llama(capsys):
    from specdraft.models.llama import lib

    return _raised(lib)


def _openvino(capsys):
    from specdraft.models.openvino import runtime

    return _raised(runtime)


def _ray(capsys):
    from specdraft.scale.cluster import require_ray

    return _raised(require_ray)


def _serve(capsys):
    return _cli_line(capsys, "serve", "--target", str(smol_files()), "--backend", "hf")


def _leak(capsys):
    return _cli_line(capsys, "leak", "--target", str(smol_files()), "--backend", "hf")


def _loadtest(capsys):
    return _cli_line(capsys, "loadtest", "--url", "http://127.0.0.1:9")


CASES = {  # what fails, without which module -> the extra its message must name
    "llama backend": (_llama, "llama_cpp", "llama"),
    "openvino backend": (_openvino, "openvino", "openvino"),
    "ray": (_ray, "ray", "ray"),
    "serve": (_serve, "uvicorn", "server"),
    "leak": (_leak, "sklearn", "leak"),
    "loadtest": (_loadtest, "httpx", "server"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_missing_optional_package_names_its_extra(case, monkeypatch, capsys):
    fn, module, extra = CASES[case]
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ModuleNotFoundError
    msg = fn(capsys).strip()
    assert f"pip install 'specdraft[{extra}]'" in msg and "\n" not in msg, msg
