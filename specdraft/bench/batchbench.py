"""``specdraft batchbench``: where does speculation stop paying as the batch grows?

For each batch size b the decode loop (specdraft.engine) decodes the same sequences once per method
(plain included, through the same loop), interleaved and after a warm-up, in one process: max(b,
--prompts) sequences (the prompts cycled), at most b rows at a time, every row generating exactly
--max-new-tokens tokens (``ignore_eos``), greedy unless --temperature. Per (batch size, method) it
reports total generated tokens / total wall seconds (prefill included), the speedup against plain
at the same batch size, MAT and acceptance rate (all from specdraft.core.metrics), and, when greedy,
how many rows equal plain's rows token for token. The batch policy is off unless --policy is given,
so the raw crossover is what is measured; its defaults (config.SPEC_SHRINK_AT, config.SPEC_OFF_AT) are set from
``crossover`` in the JSON: per method the batch sizes where speculation pays (speedup >= 1) and ``loses_from``, the
smallest measured size from which it loses at every larger measured size.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..commands.flags import add_backend_arg, add_device_args, add_draft_backend_arg
from ..core.errors import SpecDraftError


@dataclass(frozen=True)
class BatchBenchOptions:
    """``specdraft batchbench``'s flags."""

    target: str
    draft: str | None = None
    draft_layers: int | None = None
    dtype: str | None = None  # None: not given (bfloat16 on transformers)
    threads: int | None = None
    backend: str = "hf"
    draft_backend: str | None = None  # None: --backend's
    methods: str = "plain,draft_model"  # a comma list of methods or labels of --specs
    specs: str | None = None  # JSON file {label: SpecConfig}
    config: str | None = None  # SpecConfig JSON merged under every method
    k: int | None = None
    tree: str | None = None
    exit_layer: int | None = None
    skip_config: str | None = None
    batch_sizes: str = "1,2,4,8,16"
    prompts: int = 8
    max_new_tokens: int = 64
    temperature: float = 0.0
    repeats: int = 1
    policy: str | None = None  # SHRINK,OFF
    dataset: str | None = None
    no_chat: bool = False
    out: str = "batchbench.json"
    plot: str | None = None
    device: str = "auto"  # core/device.py
    draft_device: str | None = None  # None: --device's


def add_parser(sub):
    p = sub.add_parser("batchbench", help="batch engine: speculation vs plain across batch sizes (the crossover)")
    p.add_argument("--target", required=True, help="model name, transformers directory or .gguf file")
    p.add_argument("--draft", default=None, help="draft model (for draft_model)")
    p.add_argument("--draft-layers", type=int, default=None, help="keep only the first N layers of the draft")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="transformers' weights (default bfloat16)",
    )
    add_backend_arg(p, default="hf")
    add_draft_backend_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--methods",
        default="plain,draft_model",
        help="comma list of methods (plain is always run: it is the baseline), or labels defined in --specs",
    )
    p.add_argument(
        "--specs",
        default=None,
        help='JSON file {label: SpecConfig} for variants, e.g. {"tree": {"method": "draft_model", "tree": "static"}}',
    )
    p.add_argument("--config", default=None, help="SpecConfig JSON merged under every method (flags override it)")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step")
    p.add_argument("--tree", default=None, choices=["chain", "static", "dynamic"])
    p.add_argument("--exit-layer", type=int, default=None, help="early_exit: draft with the first N layers")
    p.add_argument("--skip-config", default=None, help="layer_skip: the JSON written by `specdraft tune-skip`")
    p.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma list of batch sizes (rows at once)")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts (cycled to fill a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1, help="measured runs per (batch size, method)")
    p.add_argument("--policy", default=None, help="SHRINK,OFF: apply policy.BatchRule (default: no policy)")
    p.add_argument("--dataset", default=None, help="prompts jsonl (default: Spec-Bench)")
    p.add_argument("--no-chat", action="store_true", help="feed raw prompts instead of the chat template")
    p.add_argument("--out", default="batchbench.json", help="JSON results file (rewritten after every run)")
    p.add_argument("--plot", default=None, help="PNG: tokens/s against batch size, one line per method")
    add_device_args(p)
    return p


def _ints(s: str, what: str) -> list[int]:
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SpecDraftError(f"--{what} must be a comma list of integers, got {s!r}") from None
    if not v or any(x < 1 for x in v):
        raise SpecDraftError(f"--{what} must list integers >= 1, got {s!r}")
    return v


def _read_json(path: str, flag: str):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecDraftError(f"cannot read {flag} {path}: {e}") from e


def _specs(opts: BatchBenchOptions) -> dict[str, dict]:
    from ..core.config import SpecConfig, for_method, unread

    base = _read_json(opts.config, "--config") if opts.config else {}
    for key in ("k", "tree", "exit_layer", "skip_config"):
        if getattr(opts, key) is not None:
            base[key] = getattr(opts, key)
    variants = {}
    if opts.specs:
        variants = _read_json(opts.specs, "--specs")
        if not isinstance(variants, dict):
            raise SpecDraftError("--specs must hold a JSON object {label: SpecConfig}")
    labels = [m.strip() for m in opts.methods.split(",") if m.strip()]
    if "plain" not in labels:
        labels = ["plain"] + labels
    problem = unread(base, [lab for lab in labels if lab not in variants])  # base configures the methods listed
    if problem:
        raise SpecDraftError(problem)
    out = {}
    for lab in labels:
        d = dict(variants[lab]) if lab in variants else for_method(base, lab)  # each keeps the keys it reads
        if lab not in variants and lab == "plain":
            d = {"method": "plain"}
        out[lab] = SpecConfig.from_dict(d).to_dict()  # validated here, before any model loads
    return out


def _interleave(rows: list[dict], n: int) -> list[dict]:
    """n prompts taken round-robin over the dataset's tasks (varied lengths and kinds)."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["task"], []).append(r)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by.values()):
        out += [v[i] for v in by.values() if i < len(v)]
        i += 1
    return out[:n]


def summarize(records: list[dict], labels: list[str], sizes: list[int]) -> tuple[list[dict], dict]:
    from ..core.metrics import StepRecord, acceptance_rate, mean_accepted_tokens, speedup, tokens_per_second

    rows, crossover = [], {}
    for b in sizes:
        agg = {}
        for lab in labels:
            rs = [r for r in records if r["batch_size"] == b and r["method"] == lab]
            if not rs:
                continue
            steps = [StepRecord(d, acc, 0) for r in rs for d, acc in r["steps"]]
            agg[lab] = (sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs), steps, rs)
        if "plain" not in agg:
            continue
        pt, pw = agg["plain"][0], agg["plain"][1]
        for lab, (tok, wall, steps, rs) in agg.items():
            exact = [r["greedy_exact"] for r in rs if r.get("greedy_exact") is not None]
            s = {
                "batch_size": b,
                "method": lab,
                "tokens": tok,
                "wall_s": wall,
                "tokens_per_s": tokens_per_second(tok, wall),
                "speedup_vs_plain": speedup(tok, wall, pt, pw),
                "mat": mean_accepted_tokens(steps),
                "acceptance_rate": acceptance_rate(steps),
                "greedy_exact_rows": f"{sum(e[0] for e in exact)}/{sum(e[1] for e in exact)}" if exact else None,
            }
            rows.append(s)
    for lab in labels:
        if lab == "plain":
            continue
        sp = [(r["batch_size"], r["speedup_vs_plain"]) for r in rows if r["method"] == lab]
        pays = [b for b, x in sp if x is not None and x >= 1.0]
        off_from = None  # the smallest size from which it loses at every larger measured size too
        for b, x in reversed(sp):
            if x is None or x >= 1.0:
                break
            off_from = b
        crossover[lab] = {"speedup_by_batch_size": {str(b): x for b, x in sp}, "pays_at": pays, "loses_from": off_from}
    return rows, crossover


def plot(summary: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for lab in dict.fromkeys(r["method"] for r in summary):
        pts = [(r["batch_size"], r["tokens_per_s"]) for r in summary if r["method"] == lab and r["tokens_per_s"]]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows decoded together)")
    ax.set_ylabel("generated tokens / s (all rows)")
    ax.set_title("batch engine throughput: speculation vs plain")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _policy(policy: str | None):
    """--policy SHRINK,OFF -> a BatchRule (None: no policy, the raw crossover)."""
    if not policy:
        return None
    from ..core.policy import BatchRule

    v = _ints(policy, "policy")
    if len(v) != 2:
        raise SpecDraftError(f"--policy must be SHRINK,OFF (two batch sizes), got {policy!r}")
    shrink, off = v
    return BatchRule(shrink, off)


class _Runner:
    """One batch run of one method: its sequences decoded at most ``b`` rows at a time, timed."""

    def __init__(self, dec, specs: dict[str, dict], sp, policy):
        self.dec, self.specs, self.sp, self.policy = dec, specs, sp, policy

    def __call__(self, label: str, b: int, n_tokens: int, seqs: list[list[int]]):
        from ..core.config import SamplingParams, SpecConfig
        from ..engine import generate_batch

        dec, d = self.dec, self.specs[label]
        s = SamplingParams(**{**self.sp.to_dict(), "max_new_tokens": n_tokens})
        spec = SpecConfig.from_dict(d)
        jobs = [dec.prepare(p, SamplingParams(**{**s.to_dict(), "seed": i}), spec) for i, p in enumerate(seqs)]
        t0 = time.perf_counter()
        out = generate_batch(
            dec.target, jobs, eos_ids=dec.eos_ids, tokenizer=dec.tokenizer, rule=self.policy, max_batch=b
        )
        return out, time.perf_counter() - t0


def main_batchbench(opts: BatchBenchOptions) -> int:
    from ..api import SpecDecoder
    from ..core.config import SamplingParams
    from ..core.methods import method
    from ..core.prompts import load_prompts

    sizes = _ints(opts.batch_sizes, "batch-sizes")
    if opts.prompts < 1 or opts.max_new_tokens < 1 or opts.repeats < 1:
        raise SpecDraftError("--prompts, --max-new-tokens and --repeats must be >= 1")
    specs = _specs(opts)
    labels = list(specs)
    if any(method(s["method"]).needs == "draft_model" for s in specs.values()) and not opts.draft:
        raise SpecDraftError("method draft_model needs --draft NAME")
    policy = _policy(opts.policy)
    sp = SamplingParams(
        temperature=opts.temperature, max_new_tokens=opts.max_new_tokens, ignore_eos=True, seed=0
    ).validate()
    rows = _interleave(load_prompts(opts.dataset), opts.prompts)
    if len(rows) < opts.prompts:
        raise SpecDraftError(f"the dataset has only {len(rows)} prompts; asked for --prompts {opts.prompts}")
    dec = SpecDecoder.load(
        opts.target,
        draft=opts.draft,
        dtype=opts.dtype,
        draft_layers=opts.draft_layers,
        threads=opts.threads,
        backend=opts.backend,
        draft_backend=opts.draft_backend,
        device=opts.device,
        draft_device=opts.draft_device,
    )
    prompts = [dec.encode(r["prompt"], chat=not opts.no_chat) for r in rows]
    run = _Runner(dec, specs, sp, policy)
    print(f"warm-up: every method once at batch size {min(sizes)}, 8 tokens", file=sys.stderr)
    for lab in labels:
        run(lab, min(sizes), 8, prompts[: max(min(sizes), 1)])
    config = {
        "target": opts.target,
        "draft": opts.draft,
        "draft_layers": opts.draft_layers,
        "dtype": opts.dtype,
        "backend": dec.backend,
        "threads": opts.threads,
        "batch_sizes": sizes,
        "prompts": opts.prompts,
        "prompt_ids": [r["id"] for r in rows],
        "max_new_tokens": opts.max_new_tokens,
        "sampling": sp.to_dict(),
        "repeats": opts.repeats,
        "policy": opts.policy,
        "chat": not opts.no_chat,
        "specs": specs,
        "definitions": "tokens_per_s = generated tokens / wall s of the whole batch run (prefill included); "
        "speedup = tokens_per_s / plain's at the same batch size; MAT and acceptance rate over "
        "every verification step of every row (specdraft.core.metrics)",
    }
    summary, crossover = measure(
        run,
        prompts,
        labels,
        sizes,
        opts.repeats,
        opts.max_new_tokens,
        sp.greedy,
        lambda records: _save(opts.out, config, records, labels, sizes),
    )
    print_summary(summary, crossover)
    if opts.plot:
        plot(summary, opts.plot)
        print(f"plot: {opts.plot}", file=sys.stderr)
    print(f"results: {opts.out}", file=sys.stderr)
    return 0


def _save(out: str, config: dict, records: list[dict], labels: list[str], sizes: list[int]):
    summary, crossover = summarize(records, labels, sizes)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(
        json.dumps({"config": config, "records": records, "summary": summary, "crossover": crossover}, indent=1)
    )
    return summary, crossover


def measure(
    run, prompts: list[list[int]], labels: list[str], sizes: list[int], repeats: int, n_tokens: int, greedy: bool, save
) -> tuple[list[dict], dict]:
    """Every batch size, every repeat, every method (rotated: no fixed position); ``save(records)`` after
    each repeat, and at the end (what it returns is returned)."""
    records = []
    for b in sizes:
        seqs = [prompts[i % len(prompts)] for i in range(max(b, len(prompts)))]
        for rep in range(repeats):
            order = labels[rep % len(labels) :] + labels[: rep % len(labels)]  # rotate: no fixed position
            outs = {}
            for lab in order:
                out, wall = run(lab, b, n_tokens, seqs)
                outs[lab] = out
                records.append(
                    {
                        "batch_size": b,
                        "method": lab,
                        "repeat": rep,
                        "sequences": len(seqs),
                        "tokens": sum(r.stats.new_tokens for r in out),
                        "wall_s": wall,
                        "steps": [[s.drafted, s.accepted] for r in out for s in r.stats.steps],
                    }
                )
            plain_ids = [r.token_ids for r in outs["plain"]]
            for rec in records[-len(order) :]:
                if greedy:
                    got = [r.token_ids for r in outs[rec["method"]]]
                    rec["greedy_exact"] = [sum(x == y for x, y in zip(got, plain_ids)), len(got)]
            summary, _ = save(records)
            line = ", ".join(f"{r['method']} {r['tokens_per_s']:.1f} tok/s" for r in summary if r["batch_size"] == b)
            print(f"batch {b} (repeat {rep + 1}/{repeats}): {line}", file=sys.stderr)
    return save(records)


def print_summary(summary: list[dict], crossover: dict) -> None:
    print(f"{'batch':>5} {'method':<20} {'tok/s':>8} {'speedup':>8} {'MAT':>5} {'accept':>6} {'exact':>7}")
    for r in summary:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        su = "-" if r["speedup_vs_plain"] is None else f"{r['speedup_vs_plain']:.2f}x"
        print(
            f"{r['batch_size']:>5} {r['method']:<20} {r['tokens_per_s']:>8.2f} {su:>8} {r['mat']:>5.2f} {acc:>6} "
            f"{r['greedy_exact_rows'] or '-':>7}"
        )
    for lab, c in crossover.items():
        tail = (
            "still pays at the largest batch size"
            if c["loses_from"] is None
            else f"loses from batch size {c['loses_from']} on (a candidate for --spec-off-at)"
        )
        print(f"{lab}: pays (speedup >= 1) at batch sizes {c['pays_at'] or 'none'}; {tail}")
