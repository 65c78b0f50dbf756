"""``make demo``: the Qwen2.5-Coder 1.5B target with its 0.5B draft on a chat question and a code edit, plain
decoding and three methods after a warm-up, each run's tok/s (end to end and after the prompt), MAT,
acceptance and whether its tokens are plain decoding's, then one line per prompt on what paid."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace

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
    n_prompts: int = 2
    k: int = 3


def add_parser(sub):
    d = sub.add_parser("demo", help="the Qwen pair on a chat question and a code edit: what pays here")
    add_model_args(d, default_draft="qwen2.5-coder-0.5b")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--n-prompts", type=int, default=2, choices=(1, 2), help="1: the chat question only")
    d.add_argument("--k", type=int, default=3, help="draft_model's draft tokens per step")
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


# A generic chat question (where a drafter's guesses are mostly wrong) and a code edit (the answer copies
# the code it was given: prompt lookup's guesses are mostly right), so the demo shows both sides.
DEMO_PROMPTS = (("qa", None), ("code_edit", "edit2"))
METHODS = {
    "plain": SpecConfig(method="plain"),
    "auto": SpecConfig(method="auto"),  # chooses per step among plain decoding and the drafters
    "prompt_lookup": SpecConfig(method="prompt_lookup", k=6, schedule="cost_aware"),
    "draft_model": SpecConfig(method="draft_model", k=3),
}
PAYS = 1.05  # a speedup below this is within a rerun's spread on these machines: not called a gain


def demo_prompts(n: int) -> list[dict]:
    """The first ``n`` of DEMO_PROMPTS: a Spec-Bench question and a code edit of the headline's set."""
    from .core.prompts import PRESET_FILES

    spec_bench = data.load_prompts()
    edits = data.load_prompts(PRESET_FILES["code_edit"])
    out = []
    for task, pid in DEMO_PROMPTS[:n]:
        rows = edits if task == "code_edit" else spec_bench
        out.append(next(r for r in rows if r["task"] == task and pid in (None, r["id"])))
    return out


def run_demo(opts: DemoOptions) -> int:
    from .models.cost_curve import cpu_name

    models = opts.models
    t0 = time.time()
    print(f"loading {models.target} (target) and {models.draft} (draft) ...", file=sys.stderr, flush=True)
    dec = models.load()
    what = models.weights(dec.backend)
    print(f"loaded in {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    prompts = demo_prompts(opts.n_prompts)
    methods = {m: (replace(s, k=opts.k) if m == "draft_model" else s) for m, s in METHODS.items()}
    sp = SamplingParams(max_new_tokens=opts.max_new_tokens)
    ids = {r["id"]: dec.encode(r["prompt"], chat=True) for r in prompts}
    print("warm-up: each method once, 4 tokens", file=sys.stderr, flush=True)
    for spec in methods.values():
        dec.generate(dec.encode("Hi", chat=True), sampling=SamplingParams(max_new_tokens=4), spec=spec)
    verdicts = []
    for r in prompts:
        print(f"\n=== [{r['task']}] {r['prompt'][:90]!r} ({len(ids[r['id']])} prompt tokens)", flush=True)
        runs = {}
        for m, spec in methods.items():
            dec.forget_prefixes()  # every method prefills the prompt, as the first would
            out = dec.generate(ids[r["id"]], sampling=sp, spec=spec)
            runs[m] = out
            s = out.stats
            same = same_as_plain(dec.target, ids[r["id"]], runs["plain"].token_ids, out.token_ids)
            rate = "-" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}"
            print(
                f"  {m:14s} {s.tokens_per_s:6.2f} tok/s end to end, {_decode_rate(s):6.2f} after the prompt  "
                f"MAT {s.mat:.2f}  acc {rate:>4s}  {same}",
                flush=True,
            )
        print(f"  text: {runs['plain'].text[:160]!r}")
        verdicts.append((r["task"], _verdict(runs)))
    print(f"\nWhat paid here ({cpu_name()}; {what} on {dec.backend}, greedy, {opts.max_new_tokens} new tokens):")
    for task, line in verdicts:
        print(f"  {task}: {line}")
    print(NEXT_STEPS.format(py=sys.executable))
    return 0


def _decode_rate(s: GenerationStats) -> float:
    """Tokens per second after the prompt's prefill: what speculation speeds up (prefill costs the same)."""
    return s.new_tokens / max(s.wall_s - s.prefill_s, 1e-9)


def _verdict(runs: dict) -> str:
    """One line: which methods beat plain decoding end to end on this prompt, by how much, or that none did."""
    base = runs["plain"].stats
    ratio = {
        m: speedup(o.stats.new_tokens, o.stats.wall_s, base.new_tokens, base.wall_s) or 0.0
        for m, o in runs.items()
        if m != "plain"
    }
    paid = sorted((m for m in ratio if ratio[m] >= PAYS), key=lambda m: -ratio[m])
    rest = ", ".join(f"{m} {ratio[m]:.2f}x" for m in ratio if m not in paid)
    if not paid:
        return f"nothing paid: plain decoding was fastest or as fast ({rest})"
    return "paid: " + ", ".join(f"{m} {ratio[m]:.2f}x plain" for m in paid) + (f"; did not pay: {rest}" if rest else "")


NEXT_STEPS = """
Next:
  {py} -m specdraft.cli serve --target smollm2-135m --port 8000  # then open http://127.0.0.1:8000/ (the playground)
  make bench                                                      # the README's results table, measured on this machine
  {py} -m specdraft.cli doctor                                    # this CPU, what runs here, the fastest path
  make test                                                       # the test suite"""
