"""Overlapped drafting and verification across processes (PEARL's post-verify; SwiftSpec, DSI): the
draft model and the target are separate Ray actors, and while the target verifies block i the drafter
already drafts block i+1 on the guess that block i is accepted whole.

Each step the target scores [pending] + drafts (k tokens) and keeps the longest prefix equal to its
argmax, plus its own next token (``verify.greedy_verify``: lossless, greedy only). Meanwhile the
drafter feeds its last draft and drafts k + 1 more tokens ahead. If the target kept all k and its own
token equals the first ahead token, the other k ahead tokens are the next block, drafted while the
target worked (a hit); otherwise they are dropped and the drafter drafts the next block from the
corrected context while the target waits (a miss). ``overlap=False`` runs the same pair in turns
(draft, then verify): the serial reference for the same processes.

On one 2-core machine the two actors take a core each; with a machine (or GPU) each, they do not
compete: ``model_time`` predicts that case from the per-forward costs and the run's trace of hits."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, SpecDraftError


class _Side:
    """One model and one sequence's KV state, in its own process (a Ray actor)."""

    def __init__(self, name: str, dtype: str, threads: int, num_layers: int | None = None):
        from ..models.loading import load_model, set_threads

        set_threads(threads)
        self.threads = threads
        self.model = load_model(name, dtype, num_layers=num_layers)
        self.rows = None

    def start(self, prefix: list[int]) -> None:
        """Prefill ``prefix`` (the prompt but its last token) as the only sequence."""
        self.rows = self.model.new_rows()
        self.rows.add_rows([prefix])

    def costs(self, ns: list[int], threads: int) -> dict[int, float]:
        """ms per forward of n tokens (specdraft/costs.py), on ``threads`` threads for this measurement."""
        from ..costs import measure_costs
        from ..models.loading import set_threads

        set_threads(threads)
        try:
            return measure_costs(self.model, ns)
        finally:
            set_threads(self.threads)

    def eos(self) -> set[int]:
        return self.model.eos_token_ids()

    def ping(self) -> None:
        return None


class VerifySide(_Side):
    def verify(self, pending: int, drafts: list[int]) -> tuple[int, int]:
        """(drafts kept, the target's next token); the cache keeps pending + the kept drafts."""
        from ..verify import greedy_verify

        logits = self.rows.forward([[pending] + drafts])
        n, nxt = greedy_verify(torch.tensor([drafts]), logits)
        self.rows.commit([1 + int(n)])
        return int(n), int(nxt)


class DraftSide(_Side):
    """A threaded actor (two calls at once), so that ``stop`` reaches a ``draft`` that is running."""

    def __init__(self, *args):
        super().__init__(*args)
        self.lock = threading.Lock()
        self.stopped = 0  # drafts of this epoch or earlier stop at their next token

    def stop(self, epoch: int) -> None:
        self.stopped = max(self.stopped, epoch)

    def draft(self, keep: int, feed: list[int], k: int, epoch: int = 0) -> list[int]:
        """Keep the first ``keep`` cached tokens, feed ``feed``, draft k tokens greedily (the last one is
        not fed: the next call feeds it or drops it). A stopped epoch's draft returns what it has; one
        stopped before it began touches nothing."""
        with self.lock:
            return self._draft(keep, feed, k, epoch)

    def _draft(self, keep: int, feed: list[int], k: int, epoch: int) -> list[int]:
        rows = self.rows
        if epoch and self.stopped >= epoch:
            return []
        if rows.lens[0] > keep:
            rows.truncate(0, keep)
            rows.trim()
        out, x = [], feed
        for _ in range(k):
            if epoch and self.stopped >= epoch:
                break
            t = int(rows.forward([x])[0, -1].argmax())
            rows.commit([len(x)])
            out.append(t)
            x = [t]
        return out


@dataclass
class PairResult:
    token_ids: list[int]
    wall_s: float  # prefill included, as every bench method's
    decode_s: float  # from the first block's drafting to the end
    steps: list[tuple[int, bool]] = field(default_factory=list)  # (drafts kept, drafted while verifying)


class OverlapPair:
    """A target actor and a draft actor on Ray (a local instance, or the cluster at ``address``), each
    with ``threads`` threads. ``generate(ids, max_new, overlap)``: greedy, token-identical to the
    target's plain greedy decoding. ``k`` None: measured here by ``ratio_k``."""

    def __init__(self, target: str, draft: str, dtype: str = "bfloat16", k: int | None = None, threads: int = 1,
                 address: str | None = None, draft_layers: int | None = None):
        from ..models.loading import load_tokenizer
        from .cluster import connect

        if k is not None and k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        if load_tokenizer(target).get_vocab() != load_tokenizer(draft).get_vocab():
            raise ConfigError(f"the overlapped pair needs one tokenizer; {draft!r} and {target!r} differ")
        self.ray = connect(address)
        self.threads = threads
        self.target = self.ray.remote(num_cpus=threads)(VerifySide).remote(target, dtype, threads)
        self.drafter = self.ray.remote(num_cpus=threads, max_concurrency=2)(DraftSide).remote(
            draft, dtype, threads, draft_layers)
        self.epoch = 0
        self.eos = self.ray.get(self.target.eos.remote())
        self.k = k or ratio_k(self.costs([2, 3, 4, 5, 6], threads))
    def generate(self, ids: list[int], max_new: int, overlap: bool = True) -> PairResult:
        get, k = self.ray.get, self.k
        t0 = time.perf_counter()
        get([self.target.start.remote(ids[:-1]), self.drafter.start.remote(ids[:-1])])
        t1 = time.perf_counter()
        ctx, out, steps = list(ids), [], []
        drafts = get(self.drafter.draft.remote(len(ids) - 1, ctx[-1:], k))
        # tokens the drafter's cache holds: ctx + all or all but one of the drafts, + what it drafted
        # ahead, so it agrees with the new ctx up to min(cached, len(ctx) - 1) (a stopped block may hold less)
        cached = len(ctx) + k - 1
        hit = False
        while True:
            v = self.target.verify.remote(ctx[-1], drafts)
            if overlap:
                self.epoch += 1
                ahead = self.drafter.draft.remote(cached, drafts[-1:], k + 1, self.epoch)
                cached += 1
            n, nxt = get(v)
            steps.append((n, hit))
            new = drafts[:n] + [nxt]
            out += new
            ctx += new
            done = len(out) >= max_new or any(t in self.eos for t in new)
            hit = False
            if overlap:
                if n < k or done:  # the guess was wrong (or not needed): stop drafting ahead
                    self.drafter.stop.remote(self.epoch)
                ahead_tokens = get(ahead) if n == k or done else []
                cached += len(ahead_tokens[:k])
                hit = not done and n == k and ahead_tokens[:1] == [nxt]
            if done:
                break
            if hit:
                drafts = ahead_tokens[1:]
                continue
            keep = min(cached, len(ctx) - 1)
            drafts = get(self.drafter.draft.remote(keep, ctx[keep:], k))
            cached = len(ctx) + k - 1
        end = time.perf_counter()
        return PairResult(_cut(out, max_new, self.eos), end - t0, end - t1, steps)

    def costs(self, ns_target: list[int], threads: int) -> dict:
        """ms per forward: the target at ``ns_target`` tokens and the drafter at 1, and a Ray round trip."""
        t = self.ray.get(self.target.costs.remote(ns_target, threads))
        d = self.ray.get(self.drafter.costs.remote([1], threads))
        self.ray.get(self.target.ping.remote())
        rtt = []
        for _ in range(20):
            t0 = time.perf_counter()
            self.ray.get(self.target.ping.remote())
            rtt.append(time.perf_counter() - t0)
        return {"target_ms": t, "draft_ms": d[1], "rtt_ms": 1000 * sorted(rtt)[len(rtt) // 2]}

    def close(self) -> None:
        self.ray.kill(self.target)
        self.ray.kill(self.drafter)


def ratio_k(costs: dict) -> int:
    """PEARL's rule for k when nothing is known of acceptance: the drafter's k + 1 ahead tokens should
    take about as long as verifying k + 1 tokens, so neither side waits for the other on a hit."""
    fits = [n - 1 for n, ms in costs["target_ms"].items() if n >= 2 and n * costs["draft_ms"] <= 1.15 * ms]
    return max(fits, default=1)


def _cut(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    """What plain greedy decoding would return: up to the first EOS (included) and ``max_new`` tokens."""
    tokens = tokens[:max_new]
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:end]


def model_time(steps: list[tuple[int, bool]], k: int, costs: dict, overlap: bool) -> float:
    """Predicted decode seconds of a run with this trace of (drafts kept, hit) steps, given per-forward
    ms ``costs`` (``OverlapPair.costs``) and processes that do not compete for cores. A step verifies
    k drafts (the target scores k + 1 tokens); its drafts were made either while the previous step
    verified (a hit: hidden) or after it (k draft forwards on the critical path). Overlapped, a step
    that keeps all k drafts waits for the drafter's k + 1 ahead forwards (the longer of the two); one
    that keeps fewer stops them, waiting on average half a draft forward if they were still running."""
    verify, draft = costs["target_ms"][k + 1], costs["draft_ms"]
    stop_wait = draft / 2 if (k + 1) * draft > verify else 0.0
    ms = 0.0
    for n, hit in steps:
        ms += 0.0 if hit else k * draft
        if not overlap:
            ms += verify
        else:
            ms += max(verify, (k + 1) * draft) if n == k else verify + stop_wait
        ms += costs["rtt_ms"]
    return ms / 1000


def explain(doc: dict, costs_here: dict, costs_apart: dict, k: int) -> dict:
    """Measured against modelled, from a bench results ``doc`` with pair_serial / pair_overlap (and plain)
    records: the model with ``costs_here`` (the actors' own thread counts, as they ran) should match
    the measured decode time; with ``costs_apart`` (each process on a machine of its own) it predicts
    the speedup over plain decoding there (plain = one target forward per token at those costs)."""
    from ..metrics import speedup

    out = {"k": k, "costs_here": costs_here, "costs_apart": costs_apart, "methods": {}}
    for method, overlap in (("pair_serial", False), ("pair_overlap", True)):
        recs = [r for r in doc["records"] if r["method"] == method and "steps" in r]
        if not recs:
            continue
        steps = [(s[1], h) for r in recs for s, h in zip(r["steps"], r.get("hits") or [False] * len(r["steps"]))]
        tokens = sum(r["new_tokens"] for r in recs)
        apart = model_time(steps, k, costs_apart, overlap)
        plain_apart = tokens * costs_apart["target_ms"][1] / 1000
        out["methods"][method] = {
            "prompts": len(recs), "tokens": tokens, "steps": len(steps), "hits": sum(h for _, h in steps),
            "decode_s_measured": sum(r["decode_s"] for r in recs),
            "decode_s_model_here": model_time(steps, k, costs_here, overlap),
            "decode_s_model_apart": apart,
            "speedup_model_apart": speedup(tokens, apart, tokens, plain_apart)}
    return out


def render_explain(e: dict) -> str:
    ch, ca = e["costs_here"], e["costs_apart"]
    k = e["k"]
    lines = [f"k = {k}; per forward, ms: target {k + 1} tokens {ch['target_ms'][k + 1]:.1f} here / "
             f"{ca['target_ms'][k + 1]:.1f} apart, target 1 token {ca['target_ms'][1]:.1f} apart, draft 1 token "
             f"{ch['draft_ms']:.1f} here / {ca['draft_ms']:.1f} apart, Ray round trip {ch['rtt_ms']:.2f}", "",
             "| method | steps | drafted while verifying | decode s measured | model here | error | "
             "model apart | speedup apart (model) |", "|---|---|---|---|---|---|---|---|"]
    for name, m in e["methods"].items():
        err = m["decode_s_model_here"] / m["decode_s_measured"] - 1
        lines.append(f"| {name} | {m['steps']} | {m['hits']} | {m['decode_s_measured']:.2f} | "
                     f"{m['decode_s_model_here']:.2f} | {err:+.0%} | {m['decode_s_model_apart']:.2f} | "
                     f"{m['speedup_model_apart']:.2f}x |")
    return "\n".join(lines)


# --- specdraft overlap ---------------------------------------------------------------------------
@dataclass(frozen=True)
class OverlapOptions:
    """``specdraft overlap``'s flags."""
    results: str  # bench results JSON with pair_serial / pair_overlap records
    target: str | None = None  # default: the results' target
    draft: str | None = None  # default: the results' draft
    threads_apart: int | None = None  # threads each model gets on a machine of its own (default: this one's cores)
    ray_address: str | None = None
    out: str | None = None  # write the figures as JSON


def add_parser(sub):
    ov = sub.add_parser("overlap", help="model the overlapped draft/verify pair from a bench run (measured vs "
                        "modelled here; predicted with a machine per model)")
    ov.add_argument("results", help="bench results JSON with pair_serial / pair_overlap records")
    ov.add_argument("--target", default=None, help="default: the results' target")
    ov.add_argument("--draft", default=None, help="default: the results' draft")
    ov.add_argument("--threads-apart", type=int, default=None,
                    help="threads each model gets on a machine of its own (default: this machine's cores)")
    ov.add_argument("--ray-address", default=None)
    ov.add_argument("-o", "--out", default=None, help="write the figures as JSON")
    return ov


def main_overlap(opts: OverlapOptions) -> int:
    """Model the overlapped draft/verify pair from a bench run of pair_serial / pair_overlap (docs/scale.md)."""
    path = Path(opts.results)
    if not path.exists():
        raise SpecDraftError(f"no results file {path} (run specdraft bench --methods plain,pair_serial,pair_overlap)")
    doc = json.loads(path.read_text())
    settings = doc.get("settings", {})
    target, draft = opts.target or settings.get("target"), opts.draft or settings.get("draft")
    if not draft:
        raise SpecDraftError("the results name no draft model: pass --draft NAME")
    ran = next((m for n, m in settings.get("methods", {}).items() if n in ("pair_overlap", "pair_serial")), None)
    if ran is None:
        raise SpecDraftError(f"{path} has no pair_serial / pair_overlap results")
    threads = ran["threads"]
    k = ran["k"] or next((r["steps"][0][0] for r in doc["records"] if r["method"].startswith("pair_") and r["steps"]),
                         None)  # the k the run measured for itself
    if k is None:
        raise SpecDraftError(f"{path} has no pair steps yet")
    pair = OverlapPair(target, draft, settings.get("dtype", "bfloat16"), k, threads=threads, address=opts.ray_address,
                       draft_layers=settings.get("draft_layers"))
    apart = opts.threads_apart or os.cpu_count()
    e = explain(doc, pair.costs([1, k + 1], threads), pair.costs([1, k + 1], apart), k)
    pair.close()
    e.update(results=str(path), threads_apart=apart, pair_threads=threads)
    if opts.out:
        Path(opts.out).write_text(json.dumps(e, indent=1))
    print(render_explain(e))
    return 0
