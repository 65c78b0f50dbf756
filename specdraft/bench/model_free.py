"""Proposal cost of the model-free drafters on synthetic tokens (no model needed).

    python -m specdraft.bench.model_free [--context 4096] [--store-tokens 10000000] [--vocab 151936]

Suffix: per-step time (extend the automaton by the step's new tokens + build the tree) at a
``--context``-token context, local automaton only and with a ``--store-tokens`` datastore; the
store's build time and size. Token Recycling: the adjacency table's memory for ``--vocab`` ids, one
table refresh from [nodes + 1, V] logits, one tree expansion.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..core.config import SamplingParams, SpecConfig
from ..drafters import datastore as ds
from ..drafters.base import StepOutcome
from ..drafters.suffix import SuffixDrafter
from ..drafters.token_recycling import AdjacencyTable, TokenRecyclingDrafter


def zipf_tokens(rng, n: int, vocab: int) -> np.ndarray:
    """Zipf-distributed ids (a natural-text-like frequency profile, so short matches are frequent)."""
    return (rng.zipf(1.2, n) % vocab).astype(np.int64)


def time_suffix(drafter: SuffixDrafter, ctx: list[int], rng, steps: int, step_new: int, max_tokens: int = 16):
    sp = SamplingParams()
    t0 = time.perf_counter()
    drafter.begin(ctx, sp, None)
    t_begin = time.perf_counter() - t0
    tokens = list(ctx)
    times, sizes = [], []
    for _ in range(steps):
        # the next tokens: mostly copied from earlier text (what speculation is for), sometimes new
        if rng.random() < 0.7:
            s = int(rng.integers(0, len(tokens) - step_new))
            tokens.extend(tokens[s : s + step_new])
        else:
            tokens.extend(int(x) for x in rng.integers(0, 1000, step_new))
        t0 = time.perf_counter()
        tree = drafter.propose(tokens, max_tokens)
        times.append(time.perf_counter() - t0)
        sizes.append(tree.size)
    a = np.array(times) * 1e3
    return {
        "begin_ms": round(t_begin * 1e3, 2),
        "propose_ms_median": round(float(np.median(a)), 3),
        "propose_ms_p90": round(float(np.percentile(a, 90)), 3),
        "propose_ms_max": round(float(a.max()), 3),
        "mean_nodes": round(float(np.mean(sizes)), 1),
        "steps": steps,
        "new_tokens_per_step": step_new,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--store-tokens", type=int, default=10_000_000)
    ap.add_argument("--doc-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--store", default=None, help="reuse/keep the synthetic store at this directory")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    out: dict = {"context": a.context, "store_tokens": a.store_tokens, "vocab": a.vocab}
    spec = SpecConfig(method="suffix", k=16, tree_nodes=24).validate()

    # local automaton at a 4k context: half natural-like tokens, half copies of earlier spans
    base = zipf_tokens(rng, a.context, a.vocab).tolist()
    for _ in range(a.context // 64):
        s, d = rng.integers(0, a.context - 32, 2)
        base[d : d + 32] = base[s : s + 32]
    ctx = base[: a.context]
    out["suffix_local"] = time_suffix(SuffixDrafter(spec), ctx, np.random.default_rng(1), a.steps, 3)
    out.update(time_store(spec, ctx, rng, a.store, a.store_tokens, a.doc_len, a.vocab, a.steps))
    out.update(time_token_recycling(a.vocab))
    print(json.dumps(out, indent=1))
    return 0


def time_store(
    spec: SpecConfig,
    ctx: list[int],
    rng,
    store_path: str | None,
    store_tokens: int,
    doc_len: int,
    vocab: int,
    steps: int,
) -> dict:
    """The global store (built once, synthetic): the suffix drafter on a long global match, and a lookup of
    the worst case, a short very frequent match (a huge suffix array range)."""
    out = {}
    store_dir = Path(store_path) if store_path else Path(tempfile.mkdtemp(prefix="specdraft-store-"))
    if not (store_dir / "meta.json").exists():
        n_docs = store_tokens // doc_len
        flat = zipf_tokens(rng, n_docs * doc_len, vocab)
        docs = np.split(flat, n_docs)
        t0 = time.perf_counter()
        ds.build(docs, store_dir, {"target": "synthetic", "vocab_size": vocab})
        out["store_build_s"] = round(time.perf_counter() - t0, 1)
    store = ds.Datastore(store_dir)
    out["store_disk_mb"] = round(sum(f.stat().st_size for f in store_dir.iterdir()) / 2**20, 1)
    out["store_n_tokens"] = store.n_tokens
    # contexts whose last 24 tokens come from the corpus (a long global match) ...
    s = int(rng.integers(0, store.n_tokens - 100))
    ctx_hit = ctx[:-24] + [int(x) for x in store.tokens[s : s + 24] if x >= 0]
    out["suffix_global_long_match"] = time_suffix(
        SuffixDrafter(spec, store), ctx_hit, np.random.default_rng(2), steps, 3
    )
    # ... and the worst case: only a short, very frequent match (a huge suffix array range)
    ctx_short = ctx[:-1] + [0]
    m, _ = store.lookup(ctx_short, 256)
    t0 = time.perf_counter()
    for _ in range(20):
        store.lookup(ctx_short, 256)
    out["store_lookup_short_match_ms"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    out["store_lookup_short_match_len"] = m
    return out


def time_token_recycling(vocab: int) -> dict:
    """Token recycling's table size, its update from 58 rows of logits, and a full tree's expansion."""
    out = {}
    tab = AdjacencyTable(vocab, 8)
    out["token_recycling_table_mb_top8"] = round(tab.nbytes / 2**20, 2)
    out["token_recycling_table_bytes_top8"] = tab.nbytes
    spec = SpecConfig.from_dict({"method": "token_recycling", "recycle_branching": [8, 2, 2, 1]})
    d = TokenRecyclingDrafter(spec, vocab, tab)
    logits = torch.randn(58, vocab)
    rows = torch.randint(0, vocab, (58,))
    step = StepOutcome(rows, logits)
    d.observe(step)
    t0 = time.perf_counter()
    for _ in range(20):
        d.observe(step)
    out["token_recycling_update_ms_58_rows"] = round((time.perf_counter() - t0) / 20 * 1e3, 3)
    tab.table.copy_(torch.randint(0, vocab, tab.table.shape, dtype=torch.int32))  # every row known: full tree
    t0 = time.perf_counter()
    for _ in range(200):
        tree = d.propose([int(rows[0])], 16)
    out["token_recycling_expand_ms"] = round((time.perf_counter() - t0) / 200 * 1e3, 3)
    out["token_recycling_tree_nodes"] = tree.size
    return out


if __name__ == "__main__":
    raise SystemExit(main())
