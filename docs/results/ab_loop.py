"""Single-request speed of two versions of specdraft in ONE process, interleaved per prompt.

Used for the one-decode-loop change (docs/benchmark-log.md, "One loop: batch-1 speed before/after").
Both versions wrap the same loaded torch modules, so only the engine code differs.

    git archive 8c216e2 specdraft | tar -x -C /tmp/before && mv /tmp/before/specdraft /tmp/before/specdraft_before
    .venv/bin/python docs/results/ab_loop.py --before /tmp/before --out docs/results/ab_loop_qwen_bf16.json

Every method runs on the same chat-templated prompts (core18, first prompt of each of the 6 tasks by
default), old and new alternately (the order flips every prompt), after one warm-up of each. Greedy
outputs of the two versions are compared token by token.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time

METHODS = {
    "plain": {"method": "plain"},
    "draft_model": {"method": "draft_model", "k": 4},
    "prompt_lookup": {"method": "prompt_lookup", "k": 4},
    "suffix": {"method": "suffix", "k": 6},
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def divergence(target, prompt, x, y) -> dict:
    """Where two greedy outputs first differ, and the target's top-2 logit gap there (a near-tie is a
    legitimate bf16 difference between kernels; a wide gap is a bug)."""
    import torch

    j = next(i for i, (u, v) in enumerate(zip(x, y)) if u != v) if x[: len(y)] != y[: len(x)] else min(len(x), len(y))
    target.reset()
    top = torch.topk(target.forward(torch.tensor(prompt + x[:j]), keep=1)[-1], 2).values
    return {"position": j, "top2_gap": float(top[0] - top[1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="folder holding the package specdraft_before")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.path.insert(0, a.before)
    import specdraft
    from specdraft.core import prompts as data
    from specdraft.models.backends import load_model
    from specdraft.models.loading import set_threads

    old = importlib.import_module("specdraft_before")
    old_api = importlib.import_module("specdraft_before.api")
    old_adapter = importlib.import_module("specdraft_before.models.adapter")
    threads = set_threads(None)
    t, d = load_model(a.target, a.dtype), load_model(a.draft, a.dtype)
    new_dec = specdraft.SpecDecoder(t, d)
    old_dec = old_api.SpecDecoder(
        old_adapter.HFModel(t.model, t.tokenizer, t.name), old_adapter.HFModel(d.model, d.tokenizer, d.name)
    )
    rows = data.select(data.load_prompts(), preset="core18")
    by_task: dict[str, dict] = {}
    for r in rows:
        by_task.setdefault(r["task"], r)
    prompts = [new_dec.encode(r["prompt"], chat=True) for r in list(by_task.values())[: a.prompts]]
    methods = a.methods.split(",")
    versions = {
        "before": (old_dec, old.SamplingParams, old.SpecConfig),
        "after": (new_dec, specdraft.SamplingParams, specdraft.SpecConfig),
    }

    def run(v, m, ids):
        dec, SP, SC = versions[v]
        t0 = time.perf_counter()
        res = dec.generate(ids, sampling=SP(max_new_tokens=a.max_new_tokens, ignore_eos=True), spec=SC(**METHODS[m]))
        return res.token_ids, time.perf_counter() - t0

    for m in methods:  # warm-up
        for v in versions:
            run(v, m, prompts[0][:32])
    tot = {(v, m): [0, 0.0] for v in versions for m in methods}
    same = {m: 0 for m in methods}
    gaps: list[dict] = []
    for i, ids in enumerate(prompts):
        for m in methods:
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            out = {}
            for v in order:
                toks, s = run(v, m, ids)
                out[v] = toks
                tot[v, m][0] += len(toks)
                tot[v, m][1] += s
            same[m] += out["before"] == out["after"]
            if out["before"] != out["after"]:
                gaps.append({"method": m, "prompt": i, **divergence(t, ids, out["before"], out["after"])})
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr)
    res = {
        "cpu": cpu_name(),
        "threads": threads,
        "target": a.target,
        "draft": a.draft,
        "dtype": a.dtype,
        "max_new_tokens": a.max_new_tokens,
        "prompts": len(prompts),
        "rows": [],
    }
    print(f"CPU: {res['cpu']}, {threads} threads, {a.dtype}, {len(prompts)} prompts x {a.max_new_tokens} tokens")
    print("| method | before tok/s | after tok/s | after / before | identical outputs |")
    print("|---|---|---|---|---|")
    for m in methods:
        b, n = tot["before", m], tot["after", m]
        rb, rn = b[0] / b[1], n[0] / n[1]
        res["rows"].append(
            {
                "method": m,
                "before_tok_s": rb,
                "after_tok_s": rn,
                "ratio": rn / rb,
                "identical": same[m],
                "before": b,
                "after": n,
            }
        )
        print(f"| {m} | {rb:.2f} | {rn:.2f} | {rn / rb:.3f} | {same[m]}/{len(prompts)} |")
    for g in gaps:
        print(
            f"divergence: {g['method']} prompt {g['prompt']} at token {g['position']}, target top-2 logit gap "
            f"{g['top2_gap']:.4f}"
        )
    res["divergences"] = gaps
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
