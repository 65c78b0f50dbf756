"""``make demo``: the Qwen2.5-Coder 1.5B target with its 0.5B draft on a few Spec-Bench prompts,
every method interleaved after a warm-up, printing an excerpt, tok/s, speedup, MAT, acceptance."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from .api import ModelSettings
from .commands.flags import add_model_args
from .core import prompts as data
from .core.config import SamplingParams, SpecConfig
from .core.metrics import GenerationStats, near_tie_bound, speedup


@dataclass(frozen=True)
class DemoOptions:
    """``specdraft demo``'s flags."""

    models: ModelSettings
    max_new_tokens: int = 64
    n_prompts: int = 3
    k: int = 3


def add_parser(sub):
    d = sub.add_parser("demo", help="the Qwen pair on a few Spec-Bench prompts, every method")
    add_model_args(d, default_draft="qwen2.5-coder-0.5b")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--n-prompts", type=int, default=3)
    d.add_argument("--k", type=int, default=3)
    return d


def same_as_plain(target, prompt_ids: list[int], plain: list[int], got: list[int]) -> str:
    """Identical, or where it departs from plain decoding and whether that is a near-tie of the
    numerics (bf16, llama.cpp: scoring several tokens at once moves logits slightly) or a bug."""
    if got == plain:
        return "same tokens as plain"
    from .bench.harness import compare

    d = compare(target, prompt_ids, plain, got)
    gap = d.get("top2_gap")
    if gap is None:
        return f"goes on past plain's {len(plain)} tokens: a bug"
    bound = near_tie_bound(target)
    verdict = "a near-tie" if gap < bound else "NOT a near-tie: a bug"
    return f"departs from plain at token {d['first_divergence']}, top-2 gap {gap:.3f}: {verdict}"


def run_demo(opts: DemoOptions) -> int:
    models = opts.models
    t0 = time.time()
    print(f"loading {models.target} (target) and {models.draft} (draft) ...", file=sys.stderr)
    dec = models.load()
    what = models.weights(dec.backend)
    print(f"loaded in {time.time() - t0:.1f}s", file=sys.stderr)
    # Short prompts: on a 2-core CPU a 700-token Spec-Bench article takes minutes to prefill in bf16.
    rows = data.select(data.load_prompts(), preset="core18")
    prompts = []
    for cat in ("coding", "qa", "math_reasoning", "translation", "reasoning", "writing"):
        prompts += [r for r in rows if r["category"] == cat][:1]
    prompts = prompts[: opts.n_prompts]
    methods = {
        "plain": SpecConfig(method="plain"),
        "draft_model": SpecConfig(method="draft_model", k=opts.k),
        "prompt_lookup": SpecConfig(method="prompt_lookup", k=opts.k),
        "prompt_lookup cost_aware": SpecConfig(method="prompt_lookup", k=6, schedule="cost_aware"),
        "auto": SpecConfig(method="auto", k=opts.k),  # chooses per step; measures this machine's cost curves first
    }
    sp = SamplingParams(max_new_tokens=opts.max_new_tokens)
    ids = {r["id"]: dec.encode(r["prompt"], chat=True) for r in prompts}
    warm = SamplingParams(max_new_tokens=4)
    for spec in methods.values():
        dec.generate(ids[prompts[0]["id"]], sampling=warm, spec=spec)
    totals = {m: GenerationStats() for m in methods}
    plain_out = {}
    for r in prompts:
        print(f"\n=== [{r['task']}] {r['prompt'][:90]!r}")
        for m, spec in methods.items():
            out = dec.generate(ids[r["id"]], sampling=sp, spec=spec)
            s = out.stats
            tot = totals[m]
            tot.new_tokens += s.new_tokens
            tot.wall_s += s.wall_s
            tot.steps += s.steps
            if m == "plain":
                plain_out[r["id"]] = out.token_ids
            same = same_as_plain(dec.target, ids[r["id"]], plain_out[r["id"]], out.token_ids)
            rate = "-" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
            print(f"  {m:25s} {s.tokens_per_s:6.2f} tok/s  MAT {s.mat:.2f}  acc {rate:>4s}  {same}")
        print(f"  text: {out.text[:160]!r}")
    base = totals["plain"]
    print("\n| method | tok/s | speedup | MAT | acceptance |\n|---|---|---|---|---|")
    for m, t in totals.items():
        rate = "-" if t.acceptance_rate is None else f"{t.acceptance_rate:.2f}"
        print(
            f"| {m} | {t.tokens_per_s:.2f} | {speedup(t.new_tokens, t.wall_s, base.new_tokens, base.wall_s):.2f}x "
            f"| {t.mat:.2f} | {rate} |"
        )
    print(f"\n(greedy, {opts.max_new_tokens} new tokens, {len(prompts)} prompts, {what} on {dec.backend})")
    print(NEXT_STEPS.format(py=sys.executable))
    return 0


NEXT_STEPS = """
Next:
  {py} -m specdraft.cli serve --target smollm2-135m --port 8000  # then open http://127.0.0.1:8000/ (the playground)
  make bench                                                      # the README's results table, measured on this machine
  {py} -m specdraft.cli doctor                                    # this CPU, what runs here, the fastest path
  make test                                                       # the test suite"""
