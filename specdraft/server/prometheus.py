"""Prometheus metrics of the server. Speculative metrics (MAT, acceptance rate, per-position
acceptance) are computed with specdraft.core.metrics over a window of the most recent verification
steps; counters are totals since the server started.

Two registries: ``public``, the request counters, counted when an answer's last byte leaves (paced in
fixed mode); ``engine``, everything the engine moves as it decodes (drafted / accepted / steps, the window's
gauges, tokens, queue and running, step and first-token times). Read before and after one request, the
engine's series give that request's acceptance, or its decoding time and so its acceptance: what fixed
stream mode hides, so a fixed-mode server shows them to the API key's holders only (app.prom)."""

from __future__ import annotations

import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..core.metrics import StepRecord, acceptance_rate, mean_accepted_tokens, per_position_acceptance

STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _SpecCollector:
    def __init__(self, owner: "ServerMetrics"):
        self.owner = owner

    def collect(self):
        steps = self.owner.window_steps()
        mat = GaugeMetricFamily(
            "specdraft_mean_accepted_tokens",
            "MAT (accepted drafts + 1 per verification step) over the last steps window",
        )
        mat.add_metric([], mean_accepted_tokens(steps) or 0.0)
        yield mat
        rate = GaugeMetricFamily(
            "specdraft_acceptance_rate",
            "accepted / drafted tokens over the last steps window (0 when nothing was drafted)",
        )
        rate.add_metric([], acceptance_rate(steps) or 0.0)
        yield rate
        pos = GaugeMetricFamily(
            "specdraft_position_acceptance",
            "P(draft position i accepted | drafted) over the last steps window",
            labels=["position"],
        )
        for i, p in enumerate(per_position_acceptance(steps)):
            pos.add_metric([str(i)], p)
        yield pos


class _PrefixCacheCollector:
    """The prefix cache's totals (core/prefix_cache.py), read when scraped."""

    SERIES = (
        ("lookups", "counter", "prefix cache lookups (one per admitted request)"),
        ("hits", "counter", "lookups that found a cached prefix"),
        ("hit_tokens", "counter", "prompt tokens taken from the prefix cache, not computed"),
        ("looked_up_tokens", "counter", "prompt tokens of every lookup (hit_tokens / this: the token hit rate)"),
        ("evictions", "counter", "cached prefixes evicted for memory"),
        ("entries", "gauge", "cached prefixes held"),
        ("bytes", "gauge", "bytes the cached prefixes hold"),
    )

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = self.cache.stats.to_dict()
        for name, kind, doc in self.SERIES:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"specdraft_prefix_cache_{name}", doc, value=stats[name])


class ServerMetrics:
    def __init__(self, window: int = 4096):
        self.public = CollectorRegistry()
        self.requests = Counter(
            "specdraft_requests",
            "HTTP generation requests by endpoint and outcome",
            ["endpoint", "status"],
            registry=self.public,
        )
        self.engine = r = CollectorRegistry()
        self.prompt_tokens = Counter("specdraft_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specdraft_generation_tokens", "tokens generated", registry=r)
        self.drafted = Counter("specdraft_draft_tokens", "draft tokens scored by the target", registry=r)
        self.accepted = Counter("specdraft_accepted_tokens", "draft tokens accepted by the verifier", registry=r)
        self.steps = Counter(
            "specdraft_verify_steps", "verification steps (one target forward per sequence)", registry=r
        )
        self.queue_depth = Gauge("specdraft_queue_depth", "requests waiting for the worker", registry=r)
        self.running = Gauge("specdraft_running", "requests being decoded", registry=r)
        self.step_latency = Histogram(
            "specdraft_step_seconds", "seconds per engine step (draft + verify)", buckets=STEP_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "specdraft_time_to_first_token_seconds",
            "seconds from arrival to the first token",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self._lock = threading.Lock()
        self._window: deque[StepRecord] = deque(maxlen=window)
        r.register(_SpecCollector(self))

    def watch_prefix_cache(self, cache) -> None:
        if cache is not None:
            self.engine.register(_PrefixCacheCollector(cache))

    def exposition(self, engine: bool) -> bytes:
        """The Prometheus text of the request counters, and of the engine's series when ``engine``."""
        return generate_latest(self.public) + (generate_latest(self.engine) if engine else b"")

    def window_steps(self) -> list[StepRecord]:
        with self._lock:
            return list(self._window)

    def observe_result(self, stats) -> None:
        """A finished (or cancelled) generation's GenerationStats."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.steps.inc(len(stats.steps))
        with self._lock:
            self._window.extend(stats.steps)
