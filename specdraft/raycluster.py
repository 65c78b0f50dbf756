"""Ray: how specdraft runs on more than one process or machine (serve --replicas, bench --ray,
train --ray, the overlapped draft/verify pair; docs/scale.md).

Ray is an optional dependency (requirements-ray.txt, ``make setup-ray``); everything else runs
without it. ``connect`` starts a local Ray instance (``address`` None or "local") or joins a running
cluster ("auto" or "HOST:PORT" as ``ray start --head`` prints it). Every node of a cluster needs
specdraft and its models installed at the same paths (docs/scale.md)."""

from __future__ import annotations

import os
import platform

from .errors import SpecDraftError

def require_ray():
    """The ray module, or a SpecDraftError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SpecDraftError("this needs Ray, an optional dependency: run `make setup-ray` (or "
                             "`pip install -r requirements-ray.txt`)") from None
    return ray


def connect(address: str | None = None, num_cpus: int | None = None):
    """The ray module, initialized once per process: a local instance with ``num_cpus`` CPUs (default:
    all), or the cluster at ``address``. Usage statistics stay off (these machines have no network)."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kw = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    try:
        if address in (None, "", "local"):
            ray.init(num_cpus=num_cpus, **kw)
        else:
            ray.init(address=address, **kw)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise SpecDraftError(f"cannot reach the Ray cluster at {address!r}: {e}") from None
    return ray


def node_info() -> dict:
    """Where this process runs: recorded with every result a Ray worker produces."""
    from .costs import cpu_name

    return {"host": platform.node(), "cpu": cpu_name(), "cores": os.cpu_count()}


def cluster_cpus() -> int:
    """CPUs the connected cluster has in all."""
    return int(require_ray().cluster_resources().get("CPU", 0))
