"""``bench --ray`` and ``train --ray``: prompts sharded over Ray worker actors (specdraft.raycluster).

bench: each worker loads the models once, warms every method up, and runs whole prompts through
``harness.run_prompt``, so every method of a prompt runs interleaved on one worker (the fairness
rules of docs/benchmarks.md). The driver merges the records into one results file, saved after each
finished prompt, and records each worker's machine, per record and under "workers". A shard is
timed on its own worker only, so the report computes speedups per worker, then aggregates them.

train: each worker loads the target once and answers whole batches of prompts (``train.answer_batch``);
the driver cuts the batches as a local run does and gathers the answers through Ray's object store
in the local order, so the data file is the one a local run writes."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from .. import raycluster
from ..errors import ConfigError, SpecDraftError


def add_ray_args(p, ray_help: str) -> None:
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS", help=ray_help)
    p.add_argument("--ray-workers", type=int, default=None, metavar="N",
                   help="with --ray: worker actors (default: the cluster's CPUs // --ray-worker-cpus, at least 1)")
    p.add_argument("--ray-worker-cpus", type=int, default=None, metavar="C",
                   help="with --ray: CPUs each worker reserves = its torch thread count (default: --threads, else 1)")


def check_ray_args(a) -> None:
    """Option errors before anything loads; with --ray, Ray must be installed."""
    if a.ray is None:
        if a.ray_workers is not None or a.ray_worker_cpus is not None:
            raise ConfigError("--ray-workers / --ray-worker-cpus need --ray")
        return
    if a.ray_workers is not None and a.ray_workers < 1:
        raise ConfigError(f"--ray-workers must be >= 1, got {a.ray_workers}")
    if a.ray_worker_cpus is not None and a.ray_worker_cpus < 1:
        raise ConfigError(f"--ray-worker-cpus must be >= 1, got {a.ray_worker_cpus}")
    raycluster.require_ray()


def worker_cpus(a) -> int:
    return a.ray_worker_cpus or a.threads or 1


def start_ray(a, jobs: int):
    """Connect; -> (ray, workers): --ray-workers, else the cluster's CPUs // CPUs per worker, at
    most one per job. A local instance gets at least the CPUs the options ask for."""
    cpus = worker_cpus(a)
    local = a.ray in ("local", "")
    want = (a.ray_workers or 1) * cpus
    ray = raycluster.connect(a.ray, num_cpus=max(os.cpu_count() or 1, want) if local else None)
    total = raycluster.cluster_cpus()
    n = min(a.ray_workers or max(1, total // cpus), jobs)
    if n * cpus > total:  # the actors would wait for CPUs forever
        raise SpecDraftError(f"{n} Ray worker(s) x {cpus} CPU(s) need {n * cpus} CPUs; the cluster has {total}")
    return ray, n


def _plain_args(a) -> argparse.Namespace:
    """The options without the CLI's handler function (workers need only the values)."""
    return argparse.Namespace(**{k: v for k, v in vars(a).items() if not callable(v)})


@contextlib.contextmanager
def _worker_errors(ray):
    """A worker's SpecDraftError raised here as itself (one line, CLI exit 2)."""
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, SpecDraftError):
            raise e.cause from None
        raise


def _get(ray, refs):
    with _worker_errors(ray):
        return ray.get(refs)


def start_workers(ray, cls, ids: list[str], cpus: int, *load_args) -> tuple[list, dict]:
    """One actor of ``cls`` per id, each reserving ``cpus`` CPUs; -> (actors, {id: its load() info})."""
    remote = ray.remote(cls)
    actors = [remote.options(num_cpus=cpus).remote(wid) for wid in ids]
    try:
        infos = _get(ray, [act.load.remote(*load_args) for act in actors])
    except BaseException:
        stop_workers(ray, actors)
        raise
    return actors, dict(zip(ids, infos))


def stop_workers(ray, actors: list) -> None:
    for act in actors:
        ray.kill(act)


def _drain(ray, actors: list, ordered: bool, fn, jobs):
    """ActorPool.map(_unordered), with workers' errors translated as in _get."""
    from ray.util import ActorPool

    pool = ActorPool(actors)
    with _worker_errors(ray):
        yield from (pool.map if ordered else pool.map_unordered)(fn, jobs)


# --- bench --------------------------------------------------------------------------------------
class BenchWorker:
    """A Ray actor: the bench's models, loaded once; runs whole prompts (every repeat, every method)."""

    def __init__(self, wid: str):
        self.wid = wid

    def load(self, a, plan, threads: int) -> dict:
        from .harness import load_bench

        self.bench = load_bench(a, plan, threads)
        return {**raycluster.node_info(), "threads": threads, "skipped": self.bench.skipped}

    def run(self, r: dict, done: set, ref: dict) -> tuple[str, list[dict]]:
        from .harness import run_prompt

        recs: list[dict] = []
        for rep in range(self.bench.a.repeats):
            rns = [rn for rn in self.bench.runners if (r["id"], rn.name, rep) not in done]
            if rns:
                run_prompt(self.bench, r, rep, rns, ref, recs.append)
        return self.wid, recs


def run_sharded(a, plan, doc: dict, out: Path) -> None:
    """The prompts not yet in ``doc``, sharded over Ray workers; ``doc`` is saved after each prompt."""
    from tqdm import tqdm

    from .harness import _save, done_keys, interrupted, reference_outputs

    done, ref = done_keys(doc["records"]), reference_outputs(doc["records"])
    keys = [(n, rep) for n in plan.settings["methods"] for rep in range(a.repeats)]
    jobs = [r for r in plan.rows if any((r["id"], n, rep) not in done for n, rep in keys)]
    if not jobs:
        return
    ray, n = start_ray(a, len(jobs))
    workers = doc.setdefault("workers", {})
    ids = [f"w{len(workers) + i}" for i in range(n)]  # new ids on every run, so resumed runs stay apart
    cpus = worker_cpus(a)
    actors, infos = start_workers(ray, BenchWorker, ids, cpus, _plain_args(a), plan, cpus)
    for wid, info in infos.items():
        doc["skipped"].update(info.pop("skipped"))
        workers[wid] = info
    print(f"bench on Ray: {len(jobs)} prompt(s) over {n} worker(s): "
          + ", ".join(f"{w} on {i['host']}" for w, i in infos.items()), file=sys.stderr)

    def submit(act, r):
        mine = {k for k in done if k[0] == r["id"]}
        return act.run.remote(r, mine, {k: v for k, v in ref.items() if k[1] == r["id"]})

    bar = tqdm(total=len(jobs), desc="bench (ray)", unit="prompt", file=sys.stderr, dynamic_ncols=True)
    try:
        for wid, recs in _drain(ray, actors, False, submit, jobs):
            node = {k: workers[wid][k] for k in ("host", "cpu", "cores")}
            doc["records"] += [{**rec, "worker": wid, "node": node} for rec in recs]
            _save(out, doc)
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        interrupted(doc, out)
        raise
    finally:
        stop_workers(ray, actors)
    bar.close()


# --- train --------------------------------------------------------------------------------------
class DataWorker:
    """A Ray actor: the target, loaded once; answers batches of prompts for the training data."""

    def __init__(self, wid: str):
        self.wid = wid

    def load(self, target: str, threads: int) -> dict:
        from ..api import SpecDecoder

        self.dec = SpecDecoder.load(target, dtype="float32", threads=threads)
        return {**raycluster.node_info(), "threads": threads}

    def answer(self, chunk: list[list[int]], max_new_tokens: int) -> tuple[str, list[dict]]:
        from ..train import answer_batch

        return self.wid, answer_batch(self.dec, chunk, max_new_tokens)


def data_builder(a):
    """train.build_data's stand-in for ``train --ray``: the same batches, answered on Ray workers."""

    def build(dec, prompts: list[str], max_new_tokens: int, chat: bool, max_prompt_tokens: int | None = None):
        from ..train import DATA_BATCH, _tqdm, encode_prompts

        encoded = encode_prompts(dec, prompts, max_new_tokens, chat, max_prompt_tokens)
        chunks = [encoded[i: i + DATA_BATCH] for i in range(0, len(encoded), DATA_BATCH)]
        if not chunks:
            return []
        ray, n = start_ray(a, len(chunks))
        cpus = worker_cpus(a)
        actors, infos = start_workers(ray, DataWorker, [f"w{i}" for i in range(n)], cpus, a.target, cpus)
        count = dict.fromkeys(infos, 0)
        seqs = []
        bar = _tqdm(total=len(encoded), desc="target answers (ray)", unit="prompt")
        try:
            for wid, got in _drain(ray, actors, True,
                                   lambda act, c: act.answer.remote(c, max_new_tokens), chunks):
                seqs += got
                count[wid] += 1
                if hasattr(bar, "update"):
                    bar.update(len(got))
        finally:
            stop_workers(ray, actors)
            if hasattr(bar, "close"):
                bar.close()
        print("training data on Ray: " + ", ".join(f"{w} on {infos[w]['host']}: {count[w]} batch(es)" for w in infos),
              file=sys.stderr)
        return seqs

    return build
