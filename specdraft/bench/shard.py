"""Prompts sharded over Ray worker actors (scale/cluster.py starts and stops them): ``bench --ray`` and
``train --ray``. The CLI hands these to the bench (harness.run_bench's ``run_sharded``) and to training
(commands/train's ``train_main``, its ``ray_builder``), which sit below this package.

bench: each worker loads the models once, warms every method up, and runs whole prompts through
``harness.run_prompt``, so every method of a prompt runs interleaved on one worker (the fairness
rules of docs/benchmark-log.md). The driver merges the records into one results file, saved after each
finished prompt, and records each worker's machine, per record and under "workers". A shard is
timed on its own worker only, so the report computes speedups per worker, then aggregates them.

train: the training data's batches, each answered by a worker holding the target (``data_builder``),
the same batches a local run answers (commands/train/data.py's build_data); for EAGLE-3, chunks of the
prompts not answered yet (``eagle3_answerer``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..commands.train import data as train_data
from ..commands.train.loop import progress
from ..core.errors import SpecDraftError
from ..scale import cluster
from .harness import _save, done_keys, interrupted, load_bench, reference_outputs, run_prompt


# --- bench --------------------------------------------------------------------------------------
class BenchWorker:
    """A Ray actor: the bench's models, loaded once; runs whole prompts (every repeat, every method)."""

    def __init__(self, wid: str):
        self.wid = wid

    def load(self, plan, threads: int) -> dict:
        self.bench = load_bench(plan, threads)
        return {**cluster.node_info(), "threads": threads, "skipped": self.bench.skipped}

    def run(self, r: dict, done: set, ref: dict) -> tuple[str, list[dict]]:
        recs: list[dict] = []
        for rep in range(self.bench.plan.opts.repeats):
            rns = [rn for rn in self.bench.runners if (r["id"], rn.name, rep) not in done]
            if rns:
                run_prompt(self.bench, r, rep, rns, ref, recs.append)
        return self.wid, recs


def run_sharded(plan, doc: dict, out: Path) -> None:
    """The prompts not yet in ``doc``, sharded over Ray workers; ``doc`` is saved after each prompt."""
    from tqdm import tqdm

    done, ref = done_keys(doc["records"]), reference_outputs(doc["records"])
    keys = [(n, rep) for n in plan.settings["methods"] for rep in range(plan.opts.repeats)]
    jobs = [r for r in plan.rows if any((r["id"], n, rep) not in done for n, rep in keys)]
    if not jobs:
        return
    ray_opts = plan.opts.ray_options()
    ray, n = ray_opts.start(len(jobs))
    workers = doc.setdefault("workers", {})
    ids = [f"w{len(workers) + i}" for i in range(n)]  # new ids on every run, so resumed runs stay apart
    cpus = ray_opts.cpus
    actors, infos = cluster.start_workers(ray, BenchWorker, ids, cpus, plan, cpus)
    for wid, info in infos.items():
        doc["skipped"].update(info.pop("skipped"))
        workers[wid] = info
    print(
        f"bench on Ray: {len(jobs)} prompt(s) over {n} worker(s): "
        + ", ".join(f"{w} on {i['host']} ({i['address']})" for w, i in infos.items()),
        file=sys.stderr,
    )

    def submit(act, r):
        mine = {k for k in done if k[0] == r["id"]}
        return act.run.remote(r, mine, {k: v for k, v in ref.items() if k[1] == r["id"]})

    bar = tqdm(total=len(jobs), desc="bench (ray)", unit="prompt", file=sys.stderr, dynamic_ncols=True)
    try:
        for wid, recs in cluster.drain(ray, actors, False, submit, jobs):
            node = {k: workers[wid][k] for k in ("host", "address", "cpu", "cores")}
            doc["records"] += [{**rec, "worker": wid, "node": node} for rec in recs]
            _save(out, doc)
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        interrupted(doc, out)
        raise
    finally:
        cluster.stop_workers(ray, actors)
    bar.close()


# --- train --------------------------------------------------------------------------------------
class DataWorker:
    """A Ray actor: the target, loaded once; answers batches of prompts for the training data."""

    def __init__(self, wid: str):
        self.wid = wid

    def load(self, target: str, threads: int) -> dict:
        from ..api import SpecDecoder

        # features need transformers; the heads' data is made on the CPU (train's)
        self.dec = SpecDecoder.load(target, dtype="float32", threads=threads, backend="hf", device="cpu")
        return {**cluster.node_info(), "threads": threads}

    def answer(self, chunk: list[list[int]], max_new_tokens: int) -> tuple[str, list[dict]]:
        return self.wid, train_data.answer_batch(self.dec, chunk, max_new_tokens)


def data_builder(ray_opts: cluster.RayOptions, target: str):
    """train.build_data's stand-in for ``train --ray``: the same batches, answered on Ray workers."""

    def build(dec, prompts: list[str], max_new_tokens: int, chat: bool, max_prompt_tokens: int | None = None):
        encoded = train_data.encode_prompts(dec, prompts, max_new_tokens, chat, max_prompt_tokens)
        chunks = [encoded[i : i + train_data.DATA_BATCH] for i in range(0, len(encoded), train_data.DATA_BATCH)]
        if not chunks:
            return []
        ray, n = ray_opts.start(len(chunks))
        cpus = ray_opts.cpus
        actors, infos = cluster.start_workers(ray, DataWorker, [f"w{i}" for i in range(n)], cpus, target, cpus)
        count = dict.fromkeys(infos, 0)
        seqs = []
        bar = progress(total=len(encoded), desc="target answers (ray)", unit="prompt")
        try:
            for wid, got in cluster.drain(
                ray, actors, True, lambda act, c: act.answer.remote(c, max_new_tokens), chunks
            ):
                seqs += got
                count[wid] += 1
                if hasattr(bar, "update"):
                    bar.update(len(got))
        finally:
            cluster.stop_workers(ray, actors)
            if hasattr(bar, "close"):
                bar.close()
        print(
            "training data on Ray: " + ", ".join(f"{w} on {infos[w]['host']}: {count[w]} batch(es)" for w in infos),
            file=sys.stderr,
        )
        return seqs

    return build


# --- train eagle3 -------------------------------------------------------------------------------
class Eagle3Worker:
    """A Ray actor: EAGLE-3's generation model (train's --gen-backend), loaded once; answers chunks of prompts."""

    def __init__(self, wid: str):
        self.wid = wid

    def load(self, opts, threads: int) -> dict:
        from ..commands.train.eagle3 import generation_model
        from ..models.loading import set_threads

        set_threads(threads)
        self.gen = generation_model(opts)
        return {**cluster.node_info(), "threads": threads, "backend": self.gen.backend}

    def answer(self, chunk: list[tuple[int, list[int]]], rows: int, max_new_tokens: int, seed: int):
        from ..commands.train import eagle3_data

        return self.wid, eagle3_data.answer_rows(self.gen, chunk, rows, max_new_tokens, seed)


def eagle3_answerer(ray_opts: cluster.RayOptions, opts):
    """eagle3_data.answer_with_features's stand-in for ``train eagle3 --ray``: the prompts not answered yet, in
    chunks of ``rows``, answered on Ray workers and appended to answers.jsonl as each chunk arrives (a chunk
    whose worker was lost is redone on another: none lost, none twice); the driver's stage 3 adds their
    features. The answers are those of one process: the same seeds, greedy rows batch-invariant in float32."""
    from ..commands.train import eagle3_data
    from ..core.jsonl import AppendedJsonl

    def answer(gen, encoded, data: Path, layers, rows: int, max_new_tokens: int, seed: int) -> dict:
        todo = eagle3_data.unanswered(data, encoded)
        chunks = [todo[j : j + rows] for j in range(0, len(todo), rows)]
        made, t0 = 0, time.perf_counter()
        if not chunks:
            return {"tokens": 0, "seconds": 0.0}
        answers = AppendedJsonl(data / "answers.jsonl", need=eagle3_data.ANSWER_FIELDS)
        ray, n = ray_opts.start(len(chunks))
        ids = [f"w{i}" for i in range(n)]
        actors, infos = cluster.start_workers(ray, Eagle3Worker, ids, ray_opts.cpus, opts, ray_opts.cpus)
        backends = {i["backend"] for i in infos.values()}
        count = dict.fromkeys(infos, 0)
        bar = progress(total=len(todo), desc="eagle3 answers (ray)", unit="prompt")
        try:
            if backends != {gen.backend}:
                raise SpecDraftError(f"the Ray workers answer on {sorted(backends)}, this run on {gen.backend}")
            work = lambda act, c: act.answer.remote(c, rows, max_new_tokens, seed)  # noqa: E731
            for wid, got in cluster.drain(ray, actors, False, work, chunks):
                answers.append(got)
                made += sum(len(r["tokens"]) - r["n_prompt"] for r in got)
                count[wid] += 1
                bar.update(len(got))
        finally:
            cluster.stop_workers(ray, actors)
            bar.close()
        print(
            "eagle3 answers on Ray: "
            + ", ".join(f"{w} on {infos[w]['host']} ({infos[w]['address']}): {count[w]} chunk(s)" for w in infos),
            file=sys.stderr,
        )
        return {"tokens": made, "seconds": round(time.perf_counter() - t0, 1)}

    return answer


@dataclass(frozen=True)
class RayBuilders:
    """What ``train --ray`` runs on Ray workers (commands/train's ``train_main`` takes it from the CLI)."""

    heads = staticmethod(data_builder)
    eagle3 = staticmethod(eagle3_answerer)


RAY_BUILDERS = RayBuilders()
