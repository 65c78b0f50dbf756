"""``specdraft serve --replicas N``: N engine replicas on Ray behind one OpenAI-compatible endpoint.

Each replica is a Ray actor holding its own model and engine (the same FastAPI app as a single server,
server/app.build_server_app) behind its own uvicorn on its node; the front that routes to them is
server/front.py, in the ``serve`` process."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, replace

from fastapi import FastAPI

from ..core.errors import SpecDraftError
from ..scale.cluster import connect
from .front import create_front


class ReplicaServer:
    """One engine on its own port (a Ray actor: ``ray.remote(ReplicaServer)``): on 127.0.0.1 on a
    ``local`` instance, else on the node's address (where the replicas need the API key)."""

    def __init__(self, models, settings, method_defaulted: bool, local: bool):
        import uvicorn

        from .app import build_server_app

        app = build_server_app(models, settings, method_defaulted)
        self.host = "127.0.0.1" if local else _node_ip()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        t0 = time.monotonic()
        while not self.server.started:  # the actor is ready only once its server listens
            if time.monotonic() - t0 > 60:
                raise RuntimeError("the replica's server did not start within 60 s")
            time.sleep(0.02)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


@dataclass(frozen=True)
class ReplicaOptions:
    """``specdraft serve --replicas N``'s options."""

    replicas: int = 1
    ray_address: str | None = None  # None / "local": a local Ray instance
    replica_cpus: int | None = None  # default: the cluster's CPUs / replicas
    insecure: bool = False  # replicas on a cluster without an API key


def start_replicas(models, settings, opts: ReplicaOptions, method_defaulted: bool = False) -> FastAPI:
    """Starts ``opts.replicas`` ReplicaServer actors on Ray (a local instance or ``opts.ray_address``), each the
    server of ``models`` and ``settings`` (app.build_server_app), and returns the front app. On a cluster the
    replicas listen on their nodes' addresses, so they need an API key."""
    local = opts.ray_address in (None, "", "local")
    if not local and not settings.api_key and not opts.insecure:
        raise SpecDraftError(
            "replicas on a Ray cluster listen on their nodes' addresses: set --api-key KEY (or "
            "SPECDRAFT_API_KEY), or pass --insecure"
        )
    if opts.replica_cpus is not None and opts.replica_cpus < 1:
        raise SpecDraftError(f"--replica-cpus must be >= 1, got {opts.replica_cpus}")
    # a local instance offers at least one CPU per replica, so no replica waits forever for a CPU
    ray = connect(
        opts.ray_address, None if not local else max(os.cpu_count() or 1, opts.replicas * (opts.replica_cpus or 1))
    )
    cpus = opts.replica_cpus or max(1, int(ray.cluster_resources().get("CPU", 1)) // opts.replicas)
    models = replace(models, threads=models.threads or cpus)
    # on a cluster, one replica per node as far as they go (Ray's SPREAD), so a lost node takes one replica
    actor = ray.remote(num_cpus=cpus, scheduling_strategy="DEFAULT" if local else "SPREAD")(ReplicaServer)
    handles = [actor.remote(models, settings, method_defaulted, local) for _ in range(opts.replicas)]
    try:
        urls = ray.get([h.url.remote() for h in handles])
    except Exception as e:  # an actor that failed to load its model: its error, once, then nothing left running
        for h in handles:
            ray.kill(h)
        raise SpecDraftError(f"a replica failed to start: {_cause(e)}") from None

    def stop():
        for h in handles:
            ray.kill(h)

    front = create_front(
        urls,
        api_key=settings.api_key,
        open_metrics=settings.open_metrics,
        on_stop=stop,
        max_body_bytes=settings.max_body_bytes,
        allowed_hosts=settings.allowed_hosts,
    )
    front.state.replicas = handles
    return front


def _cause(e: Exception) -> str:
    cause = getattr(e, "cause", None)
    return str(cause) if cause is not None else str(e).strip().splitlines()[-1]
