"""``specdraft autotune``: measures the drafting configurations a target, draft, backend and machine can
run on sample prompts and writes what it found, the arms that ``method="auto"`` reads (arms.py).

The autotune file (JSON; by default ``$SPECDRAFT_HOME/autotune/<target>__<draft>__<backend>__<cpu>.json``,
where ``auto`` finds it by itself):

    {"target", "draft", "backend", "cpu", "sampling", "prompts",
     "best": SpecConfig of the fastest fixed configuration,
     "arms": [{"name", "spec", "mat", "scored", "model_tokens", "speedup"}, ...]   # auto's arms + priors
     "tried": [{"name", "spec", "speedup", "tokens_per_s", "mat", "acceptance", ...}, ...],
     "tree": the hardware-aware tree search's inputs and choice (hf draft only)}
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..api import ModelSettings
from ..core import homefiles, prompts
from ..core.config import SamplingParams, SpecConfig
from ..core.errors import SpecDraftError
from ..core.methods import method
from ..core.metrics import FirstToken, decode_phase, tokens_per_second
from ..drafters.arms import DEFAULT_ARMS, default_path, uses_model
from ..drafters.runs_on import unavailable
from .flags import add_model_args


@dataclass(frozen=True)
class AutotuneOptions:
    """``specdraft autotune``'s flags."""

    models: ModelSettings
    prompts: str | None = None  # calibration prompts jsonl (default: _prompts' mix)
    n: int = 8
    max_new_tokens: int = 64
    temperature: float = 0.0
    only: str | None = None  # a comma list of configuration names or methods
    arms: int = 3
    no_tree_search: bool = False
    drafts: str | None = None  # a comma list of candidate drafts, screened first; the fastest is tuned
    paths: str | None = (
        None  # a comma list of paths (paths.py: BACKEND[:VARIANT]), screened first; the fastest is tuned
    )
    out: str | None = None  # default: where method=auto looks for it (arms.default_path)


def add_parser(sub):
    at = sub.add_parser(
        "autotune", help="measure drafting configurations here; write the best (and method=auto's arms)"
    )
    add_model_args(at)
    at.add_argument(
        "--prompts",
        default=None,
        help="calibration prompts jsonl (default: Spec-Bench's last prompt per task + the last code edits)",
    )
    at.add_argument("--n", type=int, default=8, help="calibration prompts")
    at.add_argument("--max-new-tokens", type=int, default=64)
    at.add_argument("--temperature", type=float, default=0.0, help="calibrate for this temperature (seed 0)")
    at.add_argument("--only", default=None, help="comma list: try only these configurations (names or methods)")
    at.add_argument("--arms", type=int, default=3, help="how many of the best configurations method=auto chooses among")
    at.add_argument("--no-tree-search", action="store_true", help="skip the hardware-aware tree search")
    at.add_argument(
        "--drafts",
        default=None,
        metavar="A,B,...",
        help="candidate drafts (names as --draft takes, e.g. "
        "self:Q4_0,qwen2.5-coder-0.5b:Q4_0): each drafts on the calibration prompts at k = 4 and 6, against "
        "plain; the fastest becomes --draft and is tuned (its measured acceptance x cost decides)",
    )
    at.add_argument(
        "--paths",
        default=None,
        metavar="A,B,...",
        help="candidate backends and weights of --target "
        "(BACKEND[:VARIANT], e.g. llama,llama:Q4_0,openvino,hf,hf:w8a8): each decodes the calibration prompts "
        "plainly and with auto; the fastest (tokens/s) is tuned, and --backend auto takes it from then on",
    )
    at.add_argument("-o", "--out", default=None, help="output JSON (default: where method=auto looks for it)")
    return at


# --- specdraft autotune ------------------------------------------------------------------------------
def candidates(dec, k_list=(2, 3, 4, 6)) -> dict[str, SpecConfig]:
    """The configurations autotune tries (each where this decoder can run it)."""
    c = {"plain": {"method": "plain"}}
    for k in (4, 8, 16):
        c[f"prompt_lookup[k={k}]"] = {
            "method": "prompt_lookup",
            "k": k,
            "max_k": max(k, 16),
            "min_ngram": 2,
            "max_ngram": 4,
        }
    c["suffix"] = DEFAULT_ARMS["suffix"]
    c["token_recycling"] = {"method": "token_recycling"}
    if dec.draft is not None:
        for k in k_list:
            c[f"draft_model[k={k}]"] = {"method": "draft_model", "k": k}
        c["hybrid[k=4]"] = {"method": "hybrid", "k": 4}
    if dec.draft is not None and not dec.cross_vocab:  # a draft of another tokenizer drafts chains only
        c["cascade[k=4]"] = {"method": "cascade", "k": 4}
        if dec.draft.capabilities.trees:
            c["draft_model[static 2-1-1]"] = {"method": "draft_model", "tree": "static", "tree_branching": [2, 1, 1]}
    out = {}
    for n, d in c.items():
        if unavailable(method(d["method"]), dec.backend, dec.draft is not None) is None:
            out[n] = SpecConfig.from_dict(d)
    return out


def summarize(records: list[dict], base: dict) -> dict:
    """Totals of one configuration's runs -> the figures autotune ranks by (metrics defined once)."""
    from ..core.metrics import StepRecord, acceptance_rate, mean_accepted_tokens, speedup, tokens_per_second

    tokens = sum(len(r["token_ids"]) for r in records)
    wall = sum(r["wall_s"] for r in records)
    steps = [StepRecord(*s) for r in records for s in r["steps"]]
    n = max(len(steps), 1)
    return {
        "tokens": tokens,
        "wall_s": round(wall, 4),
        "tokens_per_s": tokens_per_second(tokens, wall),
        "speedup": speedup(tokens, wall, base["tokens"], base["wall_s"]) if base else 1.0,
        "mat": mean_accepted_tokens(steps),
        "acceptance": acceptance_rate(steps),
        "scored": sum(1 + s.drafted for s in steps) / n,
        "model_tokens": sum(r["model_tokens"] for r in records) / n,
    }


def main_autotune(opts: AutotuneOptions) -> int:
    from ..models.catalog import home
    from ..models.cost_curve import cpu_name
    from ..models.loading import set_threads

    opts = dataclasses.replace(opts, models=on_this_cpu(opts.models))
    threads = set_threads(opts.models.threads)
    rows = _prompts(opts.prompts, opts.n)
    sp = SamplingParams(
        temperature=opts.temperature, seed=0 if opts.temperature > 0 else None, max_new_tokens=opts.max_new_tokens
    ).validate()
    screened = None
    homefiles.check_writable(Path(opts.out).parent if opts.out else home() / "autotune", "the autotune file")
    if opts.paths:
        opts = screen_paths(opts, rows, sp, threads)
    if opts.drafts:
        dec, screened = screen_drafts(opts, rows, sp, threads)
        opts = dataclasses.replace(opts, models=dataclasses.replace(opts.models, draft=screened["chosen"]))
    else:  # (a path screened above is loaded again: one model in memory at a time)
        dec = opts.models.load(threads=threads, draft_layers=None)  # (autotune has always measured the whole draft)
    cands = candidates(dec)
    if opts.only:
        keep = [x.strip() for x in opts.only.split(",") if x.strip()]
        cands = {n: spec for n, spec in cands.items() if n == "plain" or n.split("[")[0] in keep or n in keep}
    ids = [dec.encode(r["prompt"], chat=True) for r in rows]
    tree = None
    if dec.draft is not None and dec.draft.capabilities.trees and not dec.cross_vocab and not opts.no_tree_search:
        tree = _tree_search(dec, ids, sp)
        cands["draft_model[searched tree]"] = SpecConfig.from_dict(tree["spec"])
    print(
        f"autotune: {len(cands)} configurations x {len(ids)} prompts x {sp.max_new_tokens} tokens on {cpu_name()}",
        file=sys.stderr,
    )
    runs = run_candidates(dec, cands, ids, sp)
    base = summarize(runs["plain"], {})
    tried = [{"name": n, "spec": compact(cands[n]), **summarize(runs[n], base)} for n in cands]
    tried.sort(key=lambda t: -(t["speedup"] or 0))
    doc = {
        "target": opts.models.target,
        "draft": opts.models.draft,
        "backend": dec.backend,
        "cpu": cpu_name(),
        "threads": threads,
        "sampling": sp.to_dict(),
        "prompts": [r["id"] for r in rows],
        "best": tried[0]["spec"],
        "arms": [
            {k: t[k] for k in ("name", "spec", "mat", "scored", "model_tokens", "speedup")}
            for t in tried
            if t["name"] != "plain" and (t["speedup"] or 0) > 0
        ][: opts.arms],
        "tried": tried,
        "tree": tree,
        "drafts": screened,
    }
    out = Path(opts.out) if opts.out else default_path(dec)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(table(tried))
    if screened:
        print(
            f"draft: {screened['chosen']} (the fastest of {len(screened['tried'])} screened; run with --draft "
            f"{screened['chosen']})"
        )
    print(
        f"best: {tried[0]['name']} ({tried[0]['speedup']:.2f}x plain); wrote {out}"
        + ("" if opts.out else " (method=auto on this target, draft, backend and CPU reads it by itself)")
    )
    return 0


def on_this_cpu(models: ModelSettings) -> ModelSettings:
    """The models on the CPU: its files are kept per CPU kind (their picks are what ``auto`` reads on this
    CPU), so --device auto means cpu here and another device is refused."""
    for flag, setting in (("--device", models.device), ("--draft-device", models.draft_device)):
        if setting not in (None, "auto", "cpu"):
            raise SpecDraftError(
                f"{flag} {setting}: autotune measures this CPU (its files are kept per CPU kind); "
                "leave the device out or pass cpu"
            )
    return dataclasses.replace(models, device="cpu", draft_device=None)


def screen_paths(opts: AutotuneOptions, rows: list[dict], sp: SamplingParams, threads: int) -> AutotuneOptions:
    """Each of ``opts.paths`` decodes the calibration prompts plainly and with ``auto`` (its default arms,
    nothing remembered); the path with the most tokens/s (the better of the two) is kept for --backend
    auto (paths.write) -> the options with that path's target and backend."""
    from ..models import paths

    model = opts.models.target
    tried = []
    candidates = [paths.ModelPath.parse(x) for x in opts.paths.split(",") if x.strip()]  # all checked before loading
    paths.check_writable(model)  # a bad paths file, an unwritable home: said now, not after measuring
    for p in candidates:
        text = str(p)
        models = _on_path(opts.models, p)
        try:
            dec = models.load(threads=threads)
        except SpecDraftError as e:
            print(f"autotune: path {text}: cannot run here: {e}", file=sys.stderr)
            continue
        ids = [dec.encode(r["prompt"], chat=True) for r in rows]
        runs = run_candidates(
            dec, {"plain": SpecConfig(method="plain"), "auto": SpecConfig(method="auto", autotune="off")}, ids, sp
        )
        plain, auto = summarize(runs["plain"], {}), summarize(runs["auto"], {})
        decode = max(decode_rate(runs["plain"]), decode_rate(runs["auto"]))
        prefill = prefill_ms_per_token(runs["plain"] + runs["auto"])
        tried.append(
            {
                "path": text,
                "plain_tokens_per_s": plain["tokens_per_s"],
                "auto_tokens_per_s": auto["tokens_per_s"],
                "auto_mat": auto["mat"],
                "tokens_per_s": max(plain["tokens_per_s"], auto["tokens_per_s"]),
                "decode_tokens_per_s": decode,
                "prefill_ms_per_token": prefill,
            }
        )
        print(
            f"autotune: path {text}: plain {plain['tokens_per_s']:.2f} tok/s, auto {auto['tokens_per_s']:.2f} "
            f"tok/s (MAT {auto['mat']:.2f}); decode phase {decode:.2f} tok/s, prefill {prefill:.2f} ms a prompt "
            "token",
            file=sys.stderr,
        )
        del dec
    if not tried:
        raise SpecDraftError(f"autotune --paths: none of {opts.paths} can run {model} here")
    best = max(tried, key=lambda t: t["tokens_per_s"])
    f = paths.write(
        model,
        pick={
            "path": best["path"],
            "tokens_per_s": best["tokens_per_s"],
            "tried": tried,
            "prompts": [r["id"] for r in rows],
            "sampling": sp.to_dict(),
        },
    )
    p = paths.ModelPath.parse(best["path"])
    print(f"autotune: path {p} is the fastest here; --backend auto takes it (wrote {f})", file=sys.stderr)
    return dataclasses.replace(opts, models=_on_path(opts.models, p))


def _on_path(models, p):
    """``models`` (its target a catalog name) on the path ``p``; --dtype goes to the paths that read dense weights."""
    from ..models.backends import BACKENDS

    return dataclasses.replace(
        models,
        target=p.target(models.target),
        backend=p.backend,
        dtype=models.dtype if BACKENDS[p.backend].uses_dtype else None,
    )


def decode_rate(records: list[dict]) -> float:
    """Tokens per second of the records' decode phases (the tokens after the first; metrics.decode_phase)."""
    parts = [decode_phase(len(r["token_ids"]), r["wall_s"], r["first_token_s"]) for r in records]
    return tokens_per_second(sum(n for n, _ in parts), sum(s for _, s in parts)) or 0.0


def prefill_ms_per_token(records: list[dict]) -> float:
    """Milliseconds of prefill per prompt token over the records (what --backend auto weighs a prompt by)."""
    return 1000 * sum(r["prefill_s"] for r in records) / max(1, sum(r["prompt_tokens"] for r in records))


def screen_drafts(opts: AutotuneOptions, rows: list[dict], sp: SamplingParams, threads: int):
    """Each of ``opts.drafts`` drafts the calibration prompts (draft_model, k = 4 and 6) beside plain decoding,
    over one loaded target -> (the decoder with the fastest draft, {"chosen", "tried": [...]})."""
    names = [d.strip() for d in opts.drafts.split(",") if d.strip()]
    base = opts.models.without_draft().load(threads=threads)
    ids = [base.encode(r["prompt"], chat=True) for r in rows]
    plain = summarize(run_candidates(base, {"plain": SpecConfig(method="plain")}, ids, sp)["plain"], {})
    tried, best = [], None
    for name in names:
        dec = base.with_draft(
            opts.models.target,
            name,
            opts.models.dtype,
            opts.models.draft_backend,
            opts.models.draft_device or opts.models.device,
        )
        cands = {f"draft_model[k={k}]": SpecConfig(method="draft_model", k=k) for k in (4, 6)}
        runs = run_candidates(dec, cands, ids, sp)
        top = max(
            ({"draft": name, "config": n, **summarize(r, plain)} for n, r in runs.items()),
            key=lambda t: t["speedup"] or 0,
        )
        tried.append(top)
        print(
            f"autotune: draft {name}: {top['speedup']:.2f}x plain ({top['config']}, acceptance "
            f"{top['acceptance'] or 0:.2f})",
            file=sys.stderr,
        )
        if best is None or (top["speedup"] or 0) > (best[1]["speedup"] or 0):
            best = (dec, top)
    return best[0], {"chosen": best[1]["draft"], "tried": tried}


def run_candidates(dec, cands: dict[str, SpecConfig], ids: list[list[int]], sp: SamplingParams) -> dict[str, list]:
    """Every configuration once on a short warm-up, then interleaved: every configuration on prompt i, then
    prompt i + 1. -> {name: one record per prompt}."""
    from tqdm import tqdm

    runs = {n: [] for n in cands}
    warm = SamplingParams(**{**sp.to_dict(), "max_new_tokens": 8})
    for spec in cands.values():
        dec.generate(ids[0], sampling=warm, spec=spec)
    for i in tqdm(range(len(ids)), desc="autotune", unit="prompt", file=sys.stderr, dynamic_ncols=True):
        for n, spec in cands.items():
            first = FirstToken()
            dec.forget_prefixes()  # every candidate prefills the prompt, as the first would
            out = dec.generate(ids[i], sampling=sp, spec=spec, on_emit=first.on_emit)
            runs[n].append(
                {
                    "token_ids": out.token_ids,
                    "wall_s": out.stats.wall_s,
                    "prompt_tokens": len(ids[i]),
                    "prefill_s": out.stats.prefill_s,
                    "first_token_s": first.seconds(out.stats.wall_s),
                    "steps": [[st.drafted, st.accepted, st.emitted] for st in out.stats.steps],
                    "model_tokens": sum(st.drafted for st in out.stats.steps) if uses_model(spec) else 0,
                }
            )
    return runs


def compact(spec: SpecConfig) -> dict:
    """The method and the keys that differ from their defaults (what the file needs to rebuild it)."""
    default = SpecConfig(method=spec.method).validate().to_dict()
    return {k: v for k, v in spec.to_dict().items() if k == "method" or k not in default or v != default[k]}


def table(tried: list[dict]) -> str:
    lines = [
        "| configuration | speedup | tokens/s | MAT | acceptance | target tokens / step |",
        "|---|---|---|---|---|---|",
    ]
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for t in tried:
        lines.append(
            f"| {t['name']} | {f(t['speedup'])}x | {f(t['tokens_per_s'], 1)} | {f(t['mat'])} | "
            f"{f(t['acceptance'])} | {f(t['scored'], 1)} |"
        )
    return "\n".join(lines)


def _prompts(path: str | None, n: int) -> list[dict]:
    if path:
        rows = prompts.load_prompts(path)[:n]
    else:  # Spec-Bench's last prompt of each task (core18 takes the first ones) and the last code edits:
        # a mix where different methods win
        by_task: dict = {}
        for r in prompts.load_prompts(None):
            by_task[r["task"]] = r
        edits = prompts.load_prompts(prompts.preset_dataset("code_edit"))
        rows = (list(by_task.values()) + edits[-max(2, n - len(by_task)) :])[:n]
    if not rows:
        raise SpecDraftError("no calibration prompts")
    return rows


def _tree_search(dec, ids: list[list[int]], sp: SamplingParams) -> dict:
    """The hardware-aware tree for the draft model on this machine (treeshape.py), from the draft's rank
    acceptance on the target's own greedy continuations of the calibration prompts."""
    from ..core.treeshape import best_tree, rank_stats

    outs = [
        dec.generate(
            i, sampling=SamplingParams(max_new_tokens=min(sp.max_new_tokens, 48)), spec=SpecConfig(method="plain")
        ).token_ids
        for i in ids[:4]
    ]
    p, p_next = rank_stats(dec.draft, ids[:4], outs)
    from ..drafters.auto import StepCosts

    costs = StepCosts(dec.cost_curve(32), dec.draft_cost_curve(16))
    choice = best_tree(p, costs.target, costs.draft, max_nodes=24, p_next=p_next)
    return {
        "rank_acceptance": [round(x, 4) for x in p],
        "rank_acceptance_after": [[round(x, 4) for x in r] for r in p_next],
        **choice,
        "spec": {"method": "draft_model", "tree": "static", "tree_choices": choice["choices"]},
    }
