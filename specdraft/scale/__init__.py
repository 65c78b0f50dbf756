"""Ray: everything that runs specdraft on more than one process or machine (docs/scale.md). Ray is an
optional dependency (requirements-ray.txt, ``make setup-ray``); nothing outside this package imports it.

- ``cluster``: the one place that connects to Ray (a local instance or a cluster), ``RayOptions`` (--ray,
  --ray-workers, --ray-worker-cpus), worker actors' start / stop;
- ``shard``: prompts sharded over worker actors: ``bench --ray`` (each worker runs the bench's per-prompt
  code) and ``train --ray`` (each answers batches of the training data);
- ``replicas``: ``serve --replicas N``: whole servers as Ray actors behind the routing front (server/front.py);
- ``remote``: a model in a Ray actor of its own: the draft side of method ``remote_draft``
  (drafters/remote_draft.py: drafting the next block while the engine's target verifies);
- ``overlap``: ``specdraft overlap``, the time model of that method's bench runs (``pair_*``).

Each module sits in the layer of what it scales out (tests/test_imports.py, LAYERS): cluster and remote
with the machine facts, overlap with the commands, shard with the bench, replicas with the server.
"""
