"""The wheel is what a user installs: built from a copy of the sources, resolved with its extras and
installed into a fresh venv with no index (nothing downloaded: the dependencies are this venv's, seen
through a .pth line), it runs `specdraft --help`, `generate` on SmolLM2's directory and `serve`
(/health), importing the installed copy, not the checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import httpx
import pytest

from conftest import smol_files
from server_util import free_port, wait_until

pytestmark = pytest.mark.slow  # the CLI loads SmolLM2 twice, in processes of its own

ROOT = Path(__file__).resolve().parent.parent
FILES = ["pyproject.toml", "README.md", "LICENSE"]  # and specdraft/
# the extras resolved: requirements.txt's, and llama (make setup's build) and ray (make setup-ray) when installed
OPTIONAL = {"llama": "llama_cpp", "ray": "ray"}
EXTRAS = ["openvino", "server", "leak", "test"] + [extra for extra, module in OPTIONAL.items() if find_spec(module)]


SMOL_ARGS = "--backend hf --dtype float32 --target".split()  # followed by SmolLM2's directory


@dataclass(frozen=True)
class Installed:
    venv: Path
    resolved: dict  # pip's --dry-run report of the wheel with EXTRAS
    env: dict  # the environment to run the venv's programs in (no PYTHONPATH to the checkout)

    def program(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, name: str, *args: str) -> subprocess.CompletedProcess:
        argv = [self.program(name), *args]
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=self.venv, timeout=120)


def _run(*argv) -> str:
    """``argv``'s output; its errors in the assertion when it fails."""
    p = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _pip(venv: Path, *args) -> str:
    """pip, run by this venv's pip for ``venv`` (which has none), never reaching an index."""
    return _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", *args, "--no-index")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    # a copy: building in the checkout would leave build/ and *.egg-info there
    shutil.copytree(ROOT / "specdraft", src / "specdraft", ignore=shutil.ignore_patterns("__pycache__"))
    for name in FILES:
        shutil.copy(ROOT / name, src / name)
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", dist, src)
    wheel = next(dist.glob("specdraft-*.whl"))
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    purelib = _run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    deps = sysconfig.get_paths()["purelib"]  # this venv's packages, on the path after the fresh venv's own
    (Path(purelib.strip()) / "deps.pth").write_text(deps + "\n")
    report = _pip(venv, "install", "--dry-run", "--quiet", "--report", "-", f"{wheel}[{','.join(EXTRAS)}]")
    _pip(venv, "install", "--quiet", "--no-deps", wheel)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return Installed(venv, json.loads(report), env)


def test_the_extras_resolve_offline(installed):
    """Every extra's requirements are met by the pins `make setup` installs: pip's resolver, given the wheel
    with its extras and no index, has nothing but the wheel itself to install."""
    (only,) = installed.resolved["install"]
    meta = only["metadata"]
    assert meta["name"] == "specdraft" and set(only["requested_extras"]) == set(EXTRAS)
    assert {"llama", "openvino", "server", "ray", "leak", "test"} <= set(meta["provides_extra"])
    assert any(r.startswith("fastapi") and 'extra == "server"' in r for r in meta["requires_dist"])
    assert any(r.startswith("torch") and "extra" not in r for r in meta["requires_dist"])


def test_the_installed_wheel_runs(installed):
    origin = installed.run("python", "-c", "import importlib.util as u; print(u.find_spec('specdraft').origin)")
    assert Path(origin.stdout.strip()).is_relative_to(installed.venv), origin.stdout + origin.stderr
    helped = installed.run("specdraft", "--help")
    assert helped.returncode == 0 and "lossless speculative decoding" in helped.stdout, helped.stderr
    args = ["--method", "prompt_lookup", "--max-new-tokens", "4", "def add(a, b):"]
    gen = installed.run("specdraft", "generate", *SMOL_ARGS, str(smol_files()), *args)
    assert gen.returncode == 0 and "4 tokens" in gen.stderr, gen.stderr


def test_the_installed_wheel_serves(installed):
    port = free_port()
    argv = [installed.program("specdraft"), "serve", *SMOL_ARGS, str(smol_files()), "--method", "plain"]
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p = subprocess.Popen([*argv, "--port", str(port)], env=installed.env, cwd=installed.venv, **out)

    def up():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
        except httpx.HTTPError:
            assert p.poll() is None, p.stdout.read()
            return None

    try:
        assert wait_until(up, timeout=120, every=0.2)["status"] == "ok"
    finally:
        p.terminate()
        assert p.wait(60) == 0
