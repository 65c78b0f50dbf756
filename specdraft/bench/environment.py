"""What a benchmark run records about where it ran: versions, the git commit, the CPU, threads, date."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

import torch


def environment(dtype: str, threads: int) -> dict:
    import transformers

    from .. import __version__

    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parents[2]
            ).stdout.strip()
        except Exception:
            return None

    from ..models.cost_curve import cpu_name

    try:
        from importlib.metadata import version

        llama_version = version("llama_cpp_python")
    except Exception:
        llama_version = None
    cpu = cpu_name()
    return {
        "specdraft": __version__,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": llama_version,
        "python": platform.python_version(),
        "cpu": cpu,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": threads,
        "dtype": dtype,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
