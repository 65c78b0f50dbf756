"""Two Ray nodes on distinct addresses on this machine (scripts/two_nodes.sh: network namespaces joined by
a veth pair), for tests/test_two_nodes.py. Every command that talks to the cluster runs in a node's
namespace (``Cluster.run``); nothing leaves the two namespaces."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "two_nodes.sh"
HEAD, WORKER = "198.18.0.1", "198.18.0.2"
ADDRESS = f"{HEAD}:6379"


def why_not() -> str | None:
    """Why two network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"sdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Cluster:
    def __init__(self, env: dict):
        self.env = env

    def script(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode:
            raise AssertionError(f"two_nodes.sh {' '.join(args[:3])} failed:\n{done.stdout}\n{done.stderr}")
        return done

    def run(self, node: str, *cmd: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return self.script("run", node, *cmd, timeout=timeout, check=check)

    def popen(self, node: str, *cmd: str, **kw) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(SCRIPT), "run", node, *cmd], env=self.env, text=True, **kw)

    def python(self, node: str, code: str, *args: str, timeout: float = 300) -> str:
        """``code`` run by this Python in the node's namespace; its stdout."""
        return self.run(node, sys.executable, "-c", code, *args, timeout=timeout).stdout

    def nodes(self) -> list[dict]:
        code = (
            "import json, ray; ray.init(address='%s', log_to_driver=False, configure_logging=False); "
            "print(json.dumps([{'address': n['NodeManagerAddress'], 'alive': n['Alive']} for n in ray.nodes()]))"
        ) % ADDRESS
        return json.loads(self.python("A", code).strip().splitlines()[-1])


def cluster_env(tmp: Path, tag: str = "n", **extra: str) -> dict:
    """The environment of scripts/two_nodes.sh for a cluster named by this process and ``tag`` (namespaces and
    links of different tags never meet; interface names stay under 16 bytes)."""
    return {
        **os.environ,
        "TWO_NODES_DIR": str(tmp / "cluster"),
        "TWO_NODES_NAME": f"sd{os.getpid() % 10000}{tag}",
        "PYTHON": sys.executable,
        **extra,
    }


@contextlib.contextmanager
def two_nodes(tmp: Path, **extra: str):
    """Both nodes up (Ray lists both alive) for the block; everything torn down by PID after it, also after
    a failure."""
    cluster = Cluster(cluster_env(tmp, **extra))
    try:
        cluster.script("up", timeout=180)
        yield cluster
    finally:
        cluster.script("down", check=False)
