"""An OpenAI-compatible HTTP server over the specdraft engine (``specdraft serve``).

- ``protocol``: OpenAI request bodies -> SamplingParams / SpecConfig, responses and stream chunks;
- ``scheduler``: the worker that runs requests (one at a time, or the continuous batch engine: ``batch_worker``);
- ``metrics``: Prometheus metrics (prometheus_client);
- ``app``: the FastAPI application (``create_app(decoder, ServerSettings)``);
- ``front``: the routing front of ``serve --replicas`` (the replicas themselves: scale/replicas.py).

The client tools that drive a server (loadtest, soak, leak) are in specdraft/tools/.
"""

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
