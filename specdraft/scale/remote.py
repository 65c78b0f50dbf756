"""A model in a process of its own, as a Ray actor: the draft side of the ``remote_draft`` method
(drafters/remote_draft.py) and the cost probe of ``specdraft overlap``.

The actor holds sequences keyed by its caller's numbers, all rows of one ``SequenceRows`` of the model
(any backend), and drafts greedily for several of them per call, one batched forward per token. It is
threaded (``max_concurrency=2``) so that ``stop`` reaches a ``draft`` that is running: a draft made
ahead on a guess the target then rejects ends at its next token instead of holding the actor."""

from __future__ import annotations

import threading

from ..core.errors import ConfigError
from ..core.sampling import argmax_last  # numpy's argmax: torch's takes 1-7 ms over Qwen's vocabulary


class ModelSide:
    """One model (``load_model(**source)``) on ``threads`` threads in this process."""

    def __init__(self, source: dict, threads: int):
        from ..models.backends import load_model
        from ..models.loading import set_threads

        set_threads(threads)
        self.threads = threads
        self.model = load_model(**source)

    def costs(self, ns: list[int], threads: int) -> dict[int, float]:
        """ms per forward of n tokens (specdraft/models/cost_curve.py), on ``threads`` threads for this measurement."""
        from ..models.cost_curve import measure_costs
        from ..models.loading import set_threads

        set_threads(threads)
        try:
            return measure_costs(self.model, ns)
        finally:
            set_threads(self.threads)

    def vocab(self) -> int:
        return self.model.vocab_size

    def ping(self) -> str:
        """The address of the node this side runs on (a round trip's cost is what ``ping`` is timed for)."""
        import ray

        return ray.util.get_node_ip_address()


class DraftSide(ModelSide):
    """Sequences keyed by the caller: ``start`` prefills them, ``draft`` extends them, ``end`` drops them."""

    def __init__(self, source: dict, threads: int):
        super().__init__(source, threads)
        self.rows = self.model.new_rows()
        self.keys: list[int] = []  # the key of each row, in row order
        self.lock = threading.Lock()
        self.stopped = 0  # drafts of this epoch or earlier stop at their next token

    def start(self, keys: list[int], prefixes: list[list[int]]) -> None:
        with self.lock:
            self.rows.add_rows(prefixes)
            self.keys.extend(keys)

    def end(self, keys: list[int]) -> None:
        gone = set(keys)
        with self.lock:
            self.rows.remove_rows([i for i, key in enumerate(self.keys) if key in gone])
            self.keys = [key for key in self.keys if key not in gone]

    def stop(self, epoch: int) -> None:
        self.stopped = max(self.stopped, epoch)

    def draft(self, jobs: list[tuple[int, int, list[int], int]], vocab: int, epoch: int = 0) -> list[list[int]]:
        """Per job (key, keep, feed, n): keep the row's first ``keep`` cached tokens, feed ``feed``, draft n
        tokens by argmax over the first ``vocab`` logits; the last drafted token is not fed (the next call
        feeds it or drops it). A stopped epoch's call returns what it has; one stopped before it began
        touches nothing."""
        with self.lock:
            if epoch and self.stopped >= epoch:
                return [[] for _ in jobs]
            return self._draft(jobs, vocab, epoch)

    def _draft(self, jobs, vocab: int, epoch: int) -> list[list[int]]:
        rows, at = self.rows, {key: i for i, key in enumerate(self.keys)}
        if any(key not in at for key, *_ in jobs):
            raise ConfigError("remote draft: a sequence was drafted for before it started")
        for key, keep, _, _ in jobs:
            if rows.lens[at[key]] > keep:
                rows.truncate(at[key], keep)
        rows.trim()
        out = [[] for _ in jobs]
        feeds = {at[key]: (j, list(feed)) for j, (key, _, feed, n) in enumerate(jobs) if n > 0}
        while feeds and not (epoch and self.stopped >= epoch):
            seqs = [feeds[i][1] if i in feeds else [] for i in range(rows.B)]
            N = max(len(s) for s in seqs)
            keep = N - min(len(s) - 1 for s in seqs if s)  # logits from the last fed position of each row
            logits = rows.forward(seqs, keep=keep)
            rows.commit([len(s) for s in seqs])
            for i, (j, feed) in list(feeds.items()):
                t = int(argmax_last(logits[i, len(feed) - 1 - (N - keep), :vocab]))
                out[j].append(t)
                feeds[i] = (j, [t])
                if len(out[j]) == jobs[j][3]:
                    del feeds[i]
        return out
