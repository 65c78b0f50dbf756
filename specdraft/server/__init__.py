"""An OpenAI-compatible HTTP server over the specdraft engine (``specdraft serve``).

- ``protocol``: OpenAI request bodies -> SamplingParams / SpecConfig, responses and stream chunks;
- ``batch_worker`` (+ ``scheduler``): the one worker that runs requests, up to ``max_batch`` rows together
  (one at a time with ``max_batch`` 1);
- ``prometheus``: Prometheus metrics (prometheus_client);
- ``app``: the FastAPI application (``create_app(decoder, ServerSettings)``);
- ``front``: the routing front of ``serve --replicas`` (the replicas themselves: server/replicas.py);
- ``graceful`` (SIGTERM drains), ``local`` (a server in a thread), ``pacing`` (fixed-cadence streams), ``resources``
  (the files a request's spec may name).

The client tools that drive a server (loadtest, soak, leak) are in specdraft/tools/.
"""

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
