"""The server's side of online learning (specdraft/learning): who may teach the head, and what the learner
shows (/metrics, /health, /v1/specdraft/learning for the playground's acceptance curve).

Who may teach it. The head is shared: what one client's requests teach it changes how fast every other
client's requests decode, which a client can time (docs/server.md, "Speculation side channel"); and a
head that learned a client's texts drafts them well, which another client can probe by timing its own
requests. So on a server that serves several clients apart (several ``--api-key`` keys, or fixed stream
mode, which an operator chooses to hide acceptance) the head learns only from the requests of the keys
named by ``--learn-keys``; naming none there is an error, not a silent "off"."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def api_keys(api_key) -> tuple[str, ...]:
    """ServerSettings.api_key (None, one key, or several) as a tuple."""
    if not api_key:
        return ()
    return (api_key,) if isinstance(api_key, str) else tuple(api_key)


def tenancy_problem(keys: tuple[str, ...], fixed: bool, learn_keys: tuple[str, ...] | None) -> str | None:
    """Why a server with these keys and stream mode may not learn as asked (module doc), or None."""
    if learn_keys is not None:
        unknown = [k for k in learn_keys if k not in keys]
        if not keys:
            return "--learn-keys names API keys, but the server has none (give them with --api-key)"
        if unknown:
            return f"--learn-keys names {len(unknown)} key(s) that are not among the server's --api-key keys"
        return None
    if len(keys) > 1:
        return (
            "with several API keys, --learn learns only from the requests of the keys named by --learn-keys "
            "(a head taught by one client changes the others' timing: docs/server.md)"
        )
    if fixed:
        return (
            "in fixed stream mode, --learn learns only from the requests of the API keys named by --learn-keys "
            "(a head taught by one client changes the others' timing: docs/server.md)"
            + ("" if keys else "; this server has no --api-key")
        )
    return None


def learns_from(key: str | None, learn_keys: tuple[str, ...] | None) -> bool:
    """Whether a request made with ``key`` (None: the server has no key) may teach the head."""
    return learn_keys is None or key in learn_keys


def health_view(learner) -> dict:
    """/health's details on the learner."""
    s = learner.status()
    p = s.progress
    return {
        "state": s.state,
        "head": s.head,
        "adapted": s.adapted,
        "updates": s.updates,
        "kept": s.kept,
        "rollbacks": s.rollbacks,
        "on_trial": s.on_trial,
        "acceptance": s.acceptance,
        "acceptance_before_update": s.acceptance_before,
        "buffer_tokens": p.buffer_tokens,
        "optimizer_steps": p.steps,
        "loss": p.loss,
        "busy_share": p.busy_share,
        "sequences_sent": s.sent,
        "sequences_dropped": s.dropped,
        "served_tokens": s.served_tokens,
        "warning": p.warning,
    }


def curve_view(learner) -> dict:
    """GET /v1/specdraft/learning: whether the server learns, its acceptance curve and its counts."""
    if learner is None:
        return {"learning": False}
    s = learner.status()
    return {
        "learning": True,
        **health_view(learner),
        "window": learner.cfg.window,
        "curve": [{"t": t, "acceptance": a} for t, a in s.curve],
    }


class LearnCollector:
    """The learner's series for /metrics (in the engine's registry: a fixed-mode server shows them to the
    key's holders only)."""

    def __init__(self, learner):
        self.learner = learner

    def collect(self):
        s = self.learner.status()
        p = s.progress
        counters = {
            "updates": (s.updates, "weight updates copied into the head"),
            "kept": (s.kept, "updates kept after their acceptance window"),
            "rollbacks": (s.rollbacks, "updates rolled back: their window's acceptance fell too far"),
            "optimizer_steps": (p.steps, "optimizer steps of the training process"),
        }
        for name, (v, doc) in counters.items():
            c = CounterMetricFamily(f"specdraft_learn_{name}", doc)
            c.add_metric([], v)
            yield c
        seqs = CounterMetricFamily(
            "specdraft_learn_sequences", "served sequences for the learner, by outcome", labels=["outcome"]
        )
        seqs.add_metric(["sent"], s.sent)
        seqs.add_metric(["dropped"], s.dropped)
        yield seqs
        gauges = {
            "buffer_tokens": (p.buffer_tokens, "tokens in the replay buffer"),
            "served_tokens": (s.served_tokens, "tokens of recent outputs the suffix drafters search"),
            "acceptance": (s.acceptance, "accepted / drafted of the head's steps over the latest window"),
            "busy_share": (p.busy_share, "the training process's share of the machine's CPU time so far"),
            "up": (1 if s.state == "learning" else 0, "1 while the learner learns"),
        }
        for name, (v, doc) in gauges.items():
            g = GaugeMetricFamily(f"specdraft_learn_{name}", doc)
            g.add_metric([], float(v or 0.0))
            yield g
