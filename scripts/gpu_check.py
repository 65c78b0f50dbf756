"""The GPU check: what specdraft claims for a CUDA GPU, measured on one (scripts/gpu_check.sh runs it).

    python scripts/gpu_check.py [--out DIR] [--device cuda] [--eagle3-head DIR] [--budget-s 450]
    python scripts/gpu_check.py --smoke      # on the CPU, tiny settings: the script itself, end to end

Sections, each written to the report as soon as it is done (a run cut short keeps what it finished):

1. identity: greedy decoding on the device is token-identical to plain decoding on the device. SmolLM2-135M
   (a 4-layer copy drafts) and the Qwen2.5-Coder pair (1.5B target, 0.5B draft) in float32; every method
   must match exactly (a divergence only where plain's top-2 logit gap is under metrics.near_tie_bound, 1e-3
   in float32). The Qwen pair again in bfloat16: every divergence is reported with the target's top-2
   logit gap there, and passes only under the bfloat16 bound (0.25). Methods: draft-model chains and
   dynamic trees, prompt lookup, suffix, EAGLE-3 when a head is given, and three requests as one batch.
2. sampling: the first two tokens of seeded sampling requests on the device follow the target's exact
   distribution (chi-square, as tests/stat_util.py; a tiny random Llama, 2000 requests per case): a draft
   model's chain, its dynamic tree, an EAGLE-3 head's chain.
3. bench: plain decoding against draft_model, suffix and eagle3 (with a head) on the Qwen pair in
   bfloat16, interleaved per prompt (`specdraft bench`'s harness): tokens/s and speedup in the decode phase
   and end to end.

The models load from SPECDRAFT_HOME (default ~/.cache/specdraft), as `make models` left them there:
dense/smollm2-135m, dense/qwen2.5-coder-1.5b and dense/qwen2.5-coder-0.5b, each with its specdraft.json
(nothing is downloaded). The report: DIR/gpu_check.json and DIR/gpu_check.md (DIR: --out, else $OUT, else
./gpu_check_out), with the GPU's name and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

SMOL, QWEN, QWEN_DRAFT = "smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,",
]
TREE = {"tree": "dynamic", "k": 4, "tree_topk": 4, "tree_budget": 16}


class Settings:
    """How much the run does: the full check on a GPU, or --smoke's tiny one on the CPU."""

    def __init__(self, a):
        self.smoke = a.smoke
        self.device = "cpu" if a.smoke else a.device
        self.prompts = PROMPTS[1:] if a.smoke else PROMPTS
        self.new_tokens = 8 if a.smoke else 48
        self.samples = 200 if a.smoke else 2000
        self.bench_tasks = "qa" if a.smoke else "mt_bench,qa,summarization"
        self.bench_prompts = 1 if a.smoke else 2  # per task
        self.bench_tokens = 8 if a.smoke else 128
        self.pair = (SMOL, SMOL, 4) if a.smoke else (QWEN, QWEN_DRAFT, None)  # target, draft, draft layers
        self.dtypes = ["float32"] if a.smoke else ["float32", "bfloat16"]
        self.head = a.eagle3_head or (None if a.smoke else _default_head())
        self.deadline = time.time() + a.budget_s


def _default_head() -> str | None:
    """An EAGLE-3 head for Qwen2.5-Coder-1.5B under SPECDRAFT_HOME (eagle3/qwen2.5-coder-1.5b/head), if any."""
    from specdraft.models.catalog import home

    d = home() / "eagle3" / QWEN / "head"
    return str(d) if (d / "config.json").is_file() else None


# --- 1. greedy identity -------------------------------------------------------------------------------------
def method_specs(head: str | None) -> dict[str, dict]:
    specs = {
        "draft_model": {"method": "draft_model", "k": 4},
        "draft_model_tree": {"method": "draft_model", **TREE},
        "prompt_lookup": {"method": "prompt_lookup", "k": 4},
        "suffix": {"method": "suffix"},
    }
    if head is not None:
        specs["eagle3"] = {"method": "eagle3", "head": head, "k": 4}
    return specs


def identity(s: Settings, target: str, draft: str, layers, dtype: str, head=None) -> dict:
    """Each method's greedy tokens against plain decoding's, one request at a time and three as a batch."""
    from specdraft.api import SpecDecoder
    from specdraft.core.metrics import near_tie_bound
    from specdraft.engine import Job, generate_batch

    dec = SpecDecoder.load(target, draft=draft, draft_layers=layers, dtype=dtype, backend="hf", device=s.device)
    sp = {"max_new_tokens": s.new_tokens, "ignore_eos": True}
    ids = [dec.encode(p) for p in s.prompts]
    plain = [dec.generate(i, sampling=sp, spec={"method": "plain"}).token_ids for i in ids]
    got = [
        (name, i, dec.generate(ids[i], sampling=sp, spec=spec).token_ids)
        for name, spec in method_specs(head).items()
        for i in range(len(ids))
    ]
    jobs = [Job(prompt, sp, dec.make_drafter(_spec(method_specs(None)["draft_model"]))) for prompt in ids]
    got += [
        ("batch_of_3", i, out.token_ids)
        for i, out in enumerate(generate_batch(dec.target, jobs, dec.eos_ids, dec.tokenizer))
    ]
    bound = near_tie_bound(dec.target)
    checks = [checked(dec.target, name, i, ids[i], plain[i], tokens, bound) for name, i, tokens in got]
    return {
        "target": target,
        "draft": draft_label(draft, layers),
        "dtype": dtype,
        "device": str(dec.target.device),
        "near_tie_bound": bound,
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
    }


def checked(target, method: str, i: int, ids, plain: list[int], tokens: list[int], bound: float) -> dict:
    """One output against plain's: exact, or its first divergence with plain's top-2 logit gap there
    (bench.harness.compare), passing only under the near-tie bound."""
    from specdraft.bench.harness import compare

    c = compare(target, ids, plain, tokens)
    return {"method": method, "prompt": i, **c, "ok": c["exact"] or c.get("top2_gap", float("inf")) < bound}


def draft_label(draft: str, layers: int | None) -> str:
    return f"{draft}[:{layers} layers]" if layers else draft


def _spec(d: dict):
    from specdraft.core.config import SpecConfig

    return SpecConfig.from_dict(d)


# --- 2. sampling --------------------------------------------------------------------------------------------
def sampling(s: Settings) -> dict:
    """The first two tokens' joint distribution against the exact one, per drafter, on the device."""
    from conftest import logits_of, tiny_llama
    from head_util import head_spec, random_eagle3_head
    from specdraft.core.config import SamplingParams, SpecConfig
    from specdraft.core.device import torch_device
    from specdraft.core.sampling import probs_from_logits
    from specdraft.drafters.draft_model import DraftModelDrafter
    from specdraft.drafters.draft_tree import DraftTreeDrafter
    from specdraft.drafters.eagle3 import Eagle3Drafter
    from specdraft.models.hf import HFModel
    from stat_util import fit_pvalue, sample_first_tokens

    V, prompt, dev = 6, [1, 2, 3, 1, 2], torch_device(s.device)
    on = lambda m: HFModel(m.model.to(dev), None, name=m.name)  # noqa: E731  (HFModel reads its device once)
    target, draft = on(tiny_llama(vocab=V, layers=4)), on(tiny_llama(vocab=V, layers=4, noise_seed=5, noise=0.25))
    head = random_eagle3_head(target, torch.arange(V)).to(dev)
    sp = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    p = lambda ctx: probs_from_logits(logits_of(target, ctx)[-1], sp).double().cpu()  # noqa: E731
    p1 = p(prompt)
    exact = np.stack([(p1[a] * p(prompt + [a])).numpy() for a in range(V)])
    cases = {
        "draft_model chain": lambda: DraftModelDrafter(draft, SpecConfig(method="draft_model", k=3).validate(), V),
        "draft_model dynamic tree": lambda: DraftTreeDrafter(
            draft, SpecConfig(method="draft_model", tree="dynamic", k=3, tree_topk=2, tree_budget=6).validate(), V
        ),
        "eagle3 chain": lambda: Eagle3Drafter(target, head, head_spec("eagle3", k=3)),
    }
    out = {}
    for name, make in cases.items():
        counts, drafted, accepted = sample_first_tokens(target, make, prompt, sp, 3, 2, s.samples, V, seed0=50_000)
        out[name] = {"p_value": fit_pvalue(counts, exact), "drafted": drafted, "accepted": accepted}
    return {
        "device": str(dev),
        "samples": s.samples,
        "cases": out,
        "ok": all(c["p_value"] > 1e-3 and 0 < c["accepted"] < c["drafted"] for c in out.values()),
    }


# --- 3. bench -----------------------------------------------------------------------------------------------
def bench(s: Settings, out: Path) -> dict:
    """Plain against the methods, interleaved per prompt, through `specdraft bench`'s harness."""
    from specdraft.bench.harness import BenchOptions, run_bench
    from specdraft.bench.report import aggregate, render

    target, draft, layers = s.pair
    methods = ["plain", "draft_model", "suffix"] + (["eagle3"] if s.head else [])
    config = out / "bench_config.json"
    config.write_text(
        json.dumps({"variants": {"eagle3": {"method": "eagle3", "head": s.head, "k": 4}}} if s.head else {})
    )
    results = out / "bench.json"
    results.unlink(missing_ok=True)  # a fresh run, never a resumed one
    opts = BenchOptions(
        target=target,
        draft=draft,
        draft_layers=layers,
        dtype="bfloat16",
        backend="hf",
        device=s.device,
        methods=",".join(methods),
        tasks=s.bench_tasks,
        n_per_task=s.bench_prompts,
        max_new_tokens=s.bench_tokens,
        out=str(results),
        no_plots=True,
        config=str(config),
    )
    doc, _ = run_bench(opts)
    render(doc, results, plots=False)
    agg = aggregate(doc)
    rows = {
        m: {
            k: agg["rows"][m].get(k)
            for k in ("decode_tokens_per_s", "decode_speedup", "tokens_per_s", "speedup", "mat", "exact")
        }
        for m in agg["methods"]
    }
    return {
        "target": target,
        "draft": draft_label(draft, layers),
        "dtype": "bfloat16",
        "device": s.device,
        "prompts": agg["n_prompts"],
        "new_tokens": s.bench_tokens,
        "methods": rows,
        "results": str(results),
        "report": str(results.with_name("bench_report.md")),
        "ok": bool(rows),
    }


# --- the run ------------------------------------------------------------------------------------------------
def environment(s: Settings) -> dict:
    from specdraft.core.device import torch_device
    from specdraft.models.cost_curve import cpu_name

    dev = torch_device(s.device)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": s.smoke,
    }


def sections(s: Settings, out: Path) -> list[tuple[str, object]]:
    target, draft, layers = s.pair
    todo = [
        ("identity smollm2-135m float32", lambda: identity(s, SMOL, SMOL, 4, "float32")),
        ("sampling", lambda: sampling(s)),
    ]
    if not s.smoke:
        todo += [
            (f"identity {target} {dt}", lambda dt=dt: identity(s, target, draft, layers, dt, s.head)) for dt in s.dtypes
        ]
    return todo + [("bench", lambda: bench(s, out))]


def run(s: Settings, out: Path) -> dict:
    report = {"environment": environment(s), "sections": {}}
    for name, fn in sections(s, out):
        if time.time() > s.deadline:
            report["sections"][name] = {"ok": None, "skipped": "the time budget ran out"}
            continue
        t0 = time.time()
        try:
            report["sections"][name] = fn()
        except Exception as e:  # a failed section is reported; the others still run
            report["sections"][name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=8),
            }
        report["sections"][name]["seconds"] = round(time.time() - t0, 1)
        write(report, out)
        print(
            f"gpu_check: {name}: ok={report['sections'][name]['ok']} ({report['sections'][name]['seconds']} s)",
            file=sys.stderr,
            flush=True,
        )
    report["ok"] = all(v["ok"] for v in report["sections"].values())
    write(report, out)
    return report


def write(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# specdraft GPU check, {env['date'][:10]}",
        "",
        f"Device {env['device']} ({env['gpu'] or 'no GPU'}), host CPU {env['cpu']}, torch {env['torch']} "
        f"(CUDA {env['cuda']}){', smoke run' if env['smoke'] else ''}.",
        "",
    ]
    for name, sec in report["sections"].items():
        lines.append(f"## {name}: {'skipped' if sec['ok'] is None else 'ok' if sec['ok'] else 'FAILED'}")
        lines += _section_lines(sec) + [""]
    return "\n".join(lines)


def _section_lines(sec: dict) -> list[str]:
    if "error" in sec or "skipped" in sec:
        return [sec.get("error") or sec["skipped"]]
    if "checks" in sec:
        bad = [c for c in sec["checks"] if not c["exact"]]
        lines = [
            f"{sec['target']} with {sec['draft']}, {sec['dtype']} on {sec['device']}: "
            f"{len(sec['checks']) - len(bad)} of {len(sec['checks'])} outputs token-identical to plain"
        ]
        return lines + [
            f"- {c['method']}, prompt {c['prompt']}: first divergence at token {c['first_divergence']}, "
            f"plain's top-2 logit gap {c.get('top2_gap')} ({'under' if c['ok'] else 'OVER'} the "
            f"near-tie bound {sec['near_tie_bound']})"
            for c in bad
        ]
    if "cases" in sec:
        return [
            f"- {n}: p = {c['p_value']:.3g} ({c['accepted']} of {c['drafted']} drafts accepted)"
            for n, c in sec["cases"].items()
        ]
    lines = [
        f"{sec['target']} with {sec['draft']}, {sec['dtype']} on {sec['device']}, {sec['prompts']} prompts x "
        f"{sec['new_tokens']} tokens, interleaved (speedups over plain)",
        "",
        "| method | decode tok/s | decode speedup | tok/s | speedup | MAT |",
        "|---|---|---|---|---|---|",
    ]
    f = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    return lines + [
        f"| {m} | {f(r['decode_tokens_per_s'])} | {f(r['decode_speedup'])} | {f(r['tokens_per_s'])} | "
        f"{f(r['speedup'])} | {f(r['mat'])} |"
        for m, r in sec["methods"].items()
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (--smoke: cpu)")
    p.add_argument(
        "--eagle3-head",
        default=None,
        help="an EAGLE-3 head for Qwen2.5-Coder-1.5B (default: "
        "$SPECDRAFT_HOME/eagle3/qwen2.5-coder-1.5b/head when it holds one)",
    )
    p.add_argument("--budget-s", type=float, default=450.0, help="start no section after this many seconds")
    p.add_argument("--smoke", action="store_true", help="on the CPU, tiny settings: the script end to end")
    a = p.parse_args(argv)
    s, out = Settings(a), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = run(s, out)
    print(f"gpu_check: {'ok' if report['ok'] else 'FAILED'}; report {out / 'gpu_check.md'}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
