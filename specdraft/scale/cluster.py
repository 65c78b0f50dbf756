"""Ray: how specdraft runs on more than one process or machine (serve --replicas, bench --ray,
train --ray, the overlapped draft/verify pair; docs/scale.md).

Ray is an optional dependency (requirements-ray.txt, ``make setup-ray``); everything else runs
without it. ``connect`` starts a local Ray instance (``address`` None or "local") or joins a running
cluster ("auto" or "HOST:PORT" as ``ray start --head`` prints it). Every node of a cluster needs
specdraft and its models installed at the same paths (docs/scale.md). ``bench --ray`` and ``train --ray``
shard prompts over worker actors: their options, CPUs and start / stop are below."""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass

from ..core.errors import ConfigError, SpecDraftError
from ..core.extras import require_module


def require_ray():
    """The ray module, or a ConfigError saying how to install it."""
    return require_module("ray", "ray", "this option (--ray, --replicas, --ray-address or remote_draft)")


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
    from ..models.cost_curve import cpu_name

    ray = require_ray()
    address = ray.util.get_node_ip_address() if ray.is_initialized() else None  # hosts may share a name
    return {"host": platform.node(), "address": address, "cpu": cpu_name(), "cores": os.cpu_count()}


def cluster_cpus() -> int:
    """CPUs the connected cluster has in all."""
    return int(require_ray().cluster_resources().get("CPU", 0))


# --- worker actors (bench --ray, train --ray) -------------------------------------------------
def add_ray_args(p, ray_help: str) -> None:
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help=ray_help)
    p.add_argument(
        "--ray-workers",
        type=int,
        default=None,
        metavar="N",
        help="with --ray: worker actors (default: the cluster's CPUs // --ray-worker-cpus, at least 1)",
    )
    p.add_argument(
        "--ray-worker-cpus",
        type=int,
        default=None,
        metavar="C",
        help="with --ray: CPUs each worker reserves = its torch thread count (default: --threads, else 1)",
    )


@dataclass(frozen=True)
class RayOptions:
    """``--ray [ADDRESS]``, ``--ray-workers``, ``--ray-worker-cpus`` of bench and train, with the command's
    ``--threads`` (the default CPUs per worker)."""

    address: str | None = None  # None: no Ray; "local" (or ""): a local instance; else a cluster's address
    workers: int | None = None
    worker_cpus: int | None = None
    threads: int | None = None

    def check(self) -> None:
        """Option errors before anything loads; with --ray, Ray must be installed."""
        if self.address is None:
            if self.workers is not None or self.worker_cpus is not None:
                raise ConfigError("--ray-workers / --ray-worker-cpus need --ray")
            return
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--ray-workers must be >= 1, got {self.workers}")
        if self.worker_cpus is not None and self.worker_cpus < 1:
            raise ConfigError(f"--ray-worker-cpus must be >= 1, got {self.worker_cpus}")
        require_ray()

    @property
    def cpus(self) -> int:
        """CPUs each worker reserves (= its torch threads)."""
        return self.worker_cpus or self.threads or 1

    def start(self, jobs: int):
        """Connect; -> (ray, workers): --ray-workers, else the cluster's CPUs // CPUs per worker, at
        most one per job. A local instance gets at least the CPUs the options ask for."""
        cpus = self.cpus
        local = self.address in ("local", "")
        want = (self.workers or 1) * cpus
        ray = connect(self.address, num_cpus=max(os.cpu_count() or 1, want) if local else None)
        total = cluster_cpus()
        n = min(self.workers or max(1, total // cpus), jobs)
        if n * cpus > total:  # the actors would wait for CPUs forever
            raise SpecDraftError(f"{n} Ray worker(s) x {cpus} CPU(s) need {n * cpus} CPUs; the cluster has {total}")
        return ray, n


@contextlib.contextmanager
def _worker_errors(ray):
    """A worker's SpecDraftError raised here as itself (one line, CLI exit 2)."""
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, SpecDraftError):
            raise e.cause from None
        raise


def _get(ray, refs):
    with _worker_errors(ray):
        return ray.get(refs)


def start_workers(ray, cls, ids: list[str], cpus: int, *load_args) -> tuple[list, dict]:
    """One actor of ``cls`` per id, each reserving ``cpus`` CPUs; -> (actors, {id: its load() info})."""
    remote = ray.remote(cls)
    actors = [remote.options(num_cpus=cpus).remote(wid) for wid in ids]
    try:
        infos = _get(ray, [act.load.remote(*load_args) for act in actors])
    except BaseException:
        stop_workers(ray, actors)
        raise
    return actors, dict(zip(ids, infos))


def stop_workers(ray, actors: list) -> None:
    for act in actors:
        ray.kill(act)


def drain(ray, actors: list, ordered: bool, fn, jobs):
    """Each job's result (``fn(actor, job)`` -> an ObjectRef) as it finishes (``ordered``: in job order), one job
    per actor at a time; workers' errors translated as in _get. A job whose actor died (its node lost) goes
    to an actor still alive: nothing a lost job began is kept, so nothing is lost or done twice. No actor
    left: an error."""
    queue, free, running, done, nxt = list(enumerate(jobs)), list(actors), {}, {}, 0
    with _worker_errors(ray):
        while queue or running:
            while queue and free:
                i, job = queue.pop(0)
                actor = free.pop(0)
                running[fn(actor, job)] = (actor, i, job)
            ref = ray.wait(list(running), num_returns=1)[0][0]
            actor, i, job = running.pop(ref)
            try:
                result = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                queue.insert(0, (i, job))
                if not free and not running:
                    raise SpecDraftError("every Ray worker was lost (their nodes left the cluster)") from None
                continue
            free.append(actor)
            if not ordered:
                yield result
                continue
            done[i] = result
            while nxt in done:
                yield done.pop(nxt)
                nxt += 1
