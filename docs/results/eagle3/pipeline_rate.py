"""EAGLE-3 data: answer tokens per second of the one-pass pipeline against the two-pass one, same prompts.

    python docs/results/eagle3/pipeline_rate.py --data DATA_DIR --prompts 32 --out pipeline_rate.json

one pass (``train eagle3`` now): the served target (llama.cpp, the Q4_0 file) answers ``--rows`` prompts at
a time and hands over the three layers' outputs of every token it feeds in the same forwards.
two passes (before): the same answers without features, then one transformers float32 forward per
prompt + answer for the features (output_hidden_states). Prompts: the first kept ones of
DATA_DIR/synth.jsonl; greedy; ``--max-new-tokens``. Run on an otherwise idle machine; nothing else is
written.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdraft.commands.train.data import FeatureRecorder, block_columns, decode_stream
from specdraft.commands.train.eagle3 import encode
from specdraft.core.config import SamplingParams
from specdraft.drafters.base import NoDrafter
from specdraft.engine import Job
from specdraft.models.backends import load_model
from specdraft.models.cost_curve import cpu_name
from specdraft.models.eagle3 import eagle3_layers


def one_pass(gen, prompts, rows, new, layers) -> tuple[float, int]:
    cols = block_columns(gen, gen.add_feature_layers(layers))
    made = []
    t0 = time.perf_counter()
    jobs = (Job(ids, SamplingParams(max_new_tokens=new), FeatureRecorder(cols), tag=i) for i, ids in enumerate(prompts))
    decode_stream(gen, jobs, rows, lambda i, ids, res, rec: made.append(len(res.token_ids)))
    return time.perf_counter() - t0, sum(made)


def two_passes(gen, dense, prompts, rows, new, layers) -> tuple[float, float, int]:
    done = {}
    t0 = time.perf_counter()
    jobs = (Job(ids, SamplingParams(max_new_tokens=new), NoDrafter(), tag=i) for i, ids in enumerate(prompts))
    decode_stream(gen, jobs, rows, lambda i, ids, res, d: done.__setitem__(i, ids + res.token_ids))
    t1 = time.perf_counter()
    with torch.inference_mode():
        for seq in done.values():
            out = dense.model.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
            torch.cat([out.hidden_states[i][0] for i in layers], -1).to(torch.bfloat16)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(len(s) for s in done.values()) - sum(len(p) for p in prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in (Path(a.data) / "synth.jsonl").open()]
    texts = [r["text"] for r in rows if r.get("kept")][: a.prompts]
    gen = load_model(f"{a.target}:Q4_0", backend="llama")
    prompts = [encode(gen.tokenizer, t, chat=True) for t in texts]
    layers = eagle3_layers(gen.num_layers)
    base = load_model(f"{a.target}:Q4_0", backend="llama")  # no layers registered: plain contexts
    answer_s, feature_s, n2 = two_passes(
        base, load_model(a.target, "float32", backend="hf"), prompts, a.rows, a.max_new_tokens, layers
    )
    one_s, n1 = one_pass(gen, prompts, a.rows, a.max_new_tokens, layers)
    out = {
        "cpu": cpu_name(),
        "date": time.strftime("%Y-%m-%d"),
        "prompts": len(prompts),
        "rows": a.rows,
        "max_new_tokens": a.max_new_tokens,
        "threads": a.threads,
        "one_pass": {"seconds": round(one_s, 1), "answer_tokens": n1, "tok_s": round(n1 / one_s, 1)},
        "two_passes": {
            "answer_s": round(answer_s, 1),
            "features_s": round(feature_s, 1),
            "answer_tokens": n2,
            "tok_s": round(n2 / (answer_s + feature_s), 1),
        },
    }
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
