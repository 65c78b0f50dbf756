"""Ray: the connection to more than one process or machine (docs/scale.md). Ray is an optional
dependency (requirements-ray.txt, ``make setup-ray``).

- ``cluster``: the one place that connects to Ray (a local instance or a cluster), ``RayOptions`` (--ray,
  --ray-workers, --ray-worker-cpus), worker actors' start / stop;
- ``remote``: a model in a Ray actor of its own: the draft side of method ``remote_draft``
  (drafters/remote_draft.py: drafting the next block while the engine's target verifies).

What is scaled out lives with what it scales: ``bench/shard.py`` (prompts of ``bench --ray`` and
``train --ray`` sharded over workers), ``bench/overlap.py`` (``specdraft overlap``, the time model of
``remote_draft``'s runs) and ``server/replicas.py`` (``serve --replicas N``); they build on ``cluster``.
"""
