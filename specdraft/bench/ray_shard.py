"""``bench --ray``: prompts sharded over Ray worker actors (specdraft.raycluster).

bench: each worker loads the models once, warms every method up, and runs whole prompts through
``harness.run_prompt``, so every method of a prompt runs interleaved on one worker (the fairness
rules of docs/benchmarks.md). The driver merges the records into one results file, saved after each
finished prompt, and records each worker's machine, per record and under "workers". A shard is
timed on its own worker only, so the report computes speedups per worker, then aggregates them.

``train --ray`` shards its batches the same way (train.data_builder); the workers, their CPUs and the
cluster are raycluster.py's."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import raycluster


# --- bench --------------------------------------------------------------------------------------
class BenchWorker:
    """A Ray actor: the bench's models, loaded once; runs whole prompts (every repeat, every method)."""

    def __init__(self, wid: str):
        self.wid = wid

    def load(self, plan, threads: int) -> dict:
        from .harness import load_bench

        self.bench = load_bench(plan, threads)
        return {**raycluster.node_info(), "threads": threads, "skipped": self.bench.skipped}

    def run(self, r: dict, done: set, ref: dict) -> tuple[str, list[dict]]:
        from .harness import run_prompt

        recs: list[dict] = []
        for rep in range(self.bench.plan.opts.repeats):
            rns = [rn for rn in self.bench.runners if (r["id"], rn.name, rep) not in done]
            if rns:
                run_prompt(self.bench, r, rep, rns, ref, recs.append)
        return self.wid, recs


def run_sharded(plan, doc: dict, out: Path) -> None:
    """The prompts not yet in ``doc``, sharded over Ray workers; ``doc`` is saved after each prompt."""
    from tqdm import tqdm

    from .harness import _save, done_keys, interrupted, reference_outputs

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
    actors, infos = raycluster.start_workers(ray, BenchWorker, ids, cpus, plan, cpus)
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
        for wid, recs in raycluster.drain(ray, actors, False, submit, jobs):
            node = {k: workers[wid][k] for k in ("host", "cpu", "cores")}
            doc["records"] += [{**rec, "worker": wid, "node": node} for rec in recs]
            _save(out, doc)
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        interrupted(doc, out)
        raise
    finally:
        raycluster.stop_workers(ray, actors)
    bar.close()
