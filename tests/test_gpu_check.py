"""scripts/gpu_check.sh --smoke: the GPU check's whole path on the CPU, from the repository alone (no network,
no model files, an empty SPECDRAFT_HOME, nothing installed), as a GPU machine that receives only the
repository runs it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_NETWORK = """
import os, socket
_connect = socket.socket.connect
def _refuse(self, address, *a, **k):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        with open(os.environ["NETWORK_LOG"], "a") as f:
            f.write(repr(address) + "\\n")
        raise OSError("no network in the GPU check")
    return _connect(self, address, *a, **k)
socket.socket.connect = _refuse
open(os.environ["NETWORK_LOG"], "a").close()
"""


def test_the_gpu_check_runs_from_the_repository_alone(tmp_path):
    home, guard, out, log = tmp_path / "home", tmp_path / "guard", tmp_path / "out", tmp_path / "network.log"
    home.mkdir()
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(NO_NETWORK)  # every Python the script starts records and refuses
    env = {
        **os.environ,
        "SPECDRAFT_HOME": str(home),
        "HF_HOME": str(tmp_path / "hf"),
        "OUT": str(out),
        "SPECDRAFT_THREADS": "1",
        "PYTHON": sys.executable,
        "PYTHONPATH": str(guard),
        "NETWORK_LOG": str(log),
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--smoke"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert log.exists() and log.read_text() == ""  # the guard ran, and nothing reached for the network
    assert not any(home.iterdir())
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["environment"]["device"] == "cpu" and report["environment"]["date"]
    secs = report["sections"]
    assert list(secs) == [
        "costs",
        "prediction",
        "overhead",
        "sampling",
        "identity smollm2-135m float32",
        "identity qwen2.5-coder-1.5b float32",
        "identity qwen2.5-coder-1.5b bfloat16",
    ]
    assert all(sec["ok"] for sec in secs.values())
    assert set(secs["costs"]["ms"]) == {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert {"plain", "draft_model", "suffix"} <= set(secs["prediction"]["methods"])
    assert secs["overhead"]["same_tokens_as_bare_loop"]["engine plain"]
    broken = [c for name, c in secs["sampling"]["cases"].items() if name.startswith("BROKEN")]
    assert broken and all(c["p_value"] < 1e-3 for c in broken)
    for name, sec in secs.items():
        if name.startswith("identity"):
            assert 0 < sec["accepted"] < sec["drafted"] and all(c["exact"] for c in sec["checks"]), name
            assert {"draft_model dynamic tree (batch)", "eagle3", "medusa static tree"} <= {
                c["method"] for c in sec["checks"]
            }
    files = list(out.iterdir())  # what a GPU machine gives back: at most 8 files of at most 16 MiB
    assert len(files) <= 8 and all(f.stat().st_size <= 16 * 2**20 for f in files)
    assert "# specdraft GPU check" in done.stdout


def test_the_gpu_check_needs_only_the_repository():
    """It never installs anything, and the tracked tree a GPU machine receives stays under its 64 MiB."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert not re.search(r"\bpip3?\b|ensurepip|uv ", script)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if files.returncode:
        return  # not a git checkout (an unpacked sdist): nothing to measure
    size = sum((ROOT / f).stat().st_size for f in files.stdout.split("\0") if f and (ROOT / f).is_file())
    assert size < 48 * 2**20, f"the tracked tree is {size / 2**20:.1f} MiB; the GPU machine takes 64 MiB in all"
