"""An OpenAI-compatible HTTP server over the specdraft engine (``specdraft serve``).

- ``protocol``: OpenAI request bodies -> SamplingParams / SpecConfig, responses and stream chunks;
- ``scheduler``: the worker that runs requests (one at a time, or the continuous batch engine);
- ``metrics``: Prometheus metrics (prometheus_client);
- ``app``: the FastAPI application.
"""

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
