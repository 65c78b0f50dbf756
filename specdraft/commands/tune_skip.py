"""``specdraft tune-skip``: find which decoder layers the target can skip when drafting for itself.

SWIFT / Draft & Verify search the skipped set for the best speedup. Here each candidate set is
scored without generating: the target's own greedy continuations of a few tuning prompts are
computed once; a candidate's *agreement* alpha is the fraction of those positions where the
layer-skipped view's argmax (one teacher-forced forward) equals the target's token. With the
measured cost of a single-token forward c1 and of a (k+1)-token verification forward c(k+1), the
expected speedup of a k-token chain is

    MAT(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)
    speedup(alpha, k) = MAT * c1 / (k * c1 * kept/L + c(k+1))

(draft cost taken proportional to the layers kept, best k in 1..max_k). Search, in 2 (L - 2)
teacher-forced forwards: score each layer skipped alone, then skip the least important layers
first, one more at a time, and keep the set with the best estimate if it beats plain decoding
(a greedy search in the spirit of SWIFT's layer-set optimization). The chosen set is then
*measured*: plain vs layer_skip on the tuning prompts, interleaved, and both the estimate and the
measurement are saved with the set. The tuning prompts are taken
from the end of each Spec-Bench task, so they do not overlap the bench's first-n prompts.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import SpecDraftError


def expected_mat(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def estimate(alpha: float, frac: float, costs: dict[int, float], max_k: int) -> tuple[float, int]:
    """-> (best estimated speedup, its k)."""
    best = (0.0, 1)
    for k in range(1, max_k + 1):
        s = expected_mat(alpha, k) * costs[1] / (k * costs[1] * frac + costs[k + 1])
        best = max(best, (s, k))
    return best


def tuning_prompts(dec, n_per_task: int, dataset: str | None = None) -> list[tuple[str, list[int]]]:
    from ..core import prompts

    rows = prompts.load_prompts(dataset)
    by_task: dict[str, list[dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], []).append(r)
    out = []
    for task in sorted(by_task):
        for r in by_task[task][-n_per_task:]:
            ids = dec.encode(r["prompt"], chat=True)
            if len(ids) <= 200:  # short prompts: the search runs teacher-forced forwards over them
                out.append((r["id"], ids))
    return out


@torch.inference_mode()
def agreement(view, seqs: list[tuple[list[int], int]]) -> float:
    """Fraction of continuation positions where the view's argmax equals the target's token."""
    hit = tot = 0
    for ids, n_prompt in seqs:
        rows = view.new_rows()  # one teacher-forced forward of a fresh row
        rows.add_rows([[]])
        logits = rows.forward([ids[:-1]], keep=len(ids) - n_prompt)[0]
        pred = logits.argmax(-1)
        hit += int((pred == torch.tensor(ids[n_prompt:])).sum())
        tot += len(ids) - n_prompt
    return hit / tot


@dataclass(frozen=True)
class TuneSkipOptions:
    """``specdraft tune-skip``'s flags."""

    target: str = "smollm2-135m"
    dtype: str = "float32"
    threads: int | None = None
    dataset: str | None = None  # prompts jsonl (default: Spec-Bench)
    prompts_per_task: int = 2
    tokens: int = 48  # target greedy tokens per tuning prompt
    max_k: int = 6
    max_evals: int = 200  # candidate sets to score at most
    out: str = "skip.json"


def add_parser(sub):
    t = sub.add_parser("tune-skip", help="search the decoder layers to skip for layer_skip self-speculation")
    t.add_argument("--target", default="smollm2-135m")
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--dataset", default=None, help="prompts jsonl (default: Spec-Bench)")
    t.add_argument("--prompts-per-task", type=int, default=2, help="tuning prompts from the end of each task")
    t.add_argument("--tokens", type=int, default=48, help="target greedy tokens per tuning prompt")
    t.add_argument("--max-k", type=int, default=6)
    t.add_argument("--max-evals", type=int, default=200, help="candidate sets to score at most")
    t.add_argument("-o", "--out", default="skip.json")
    return t


def search(target, seqs, costs: dict[int, float], max_k: int, max_evals: int) -> tuple[tuple, list[dict]]:
    """-> ((estimate, k, agreement, skip set) of the best set, or (1.0, 0, None, []) when none beats plain
    decoding; the log of every set scored).

    Phase 1: how much each layer matters alone (agreement with that one layer skipped).
    Phase 2: skip the least important layers first, growing the set one layer at a time, and
    keep the set with the best estimated speedup. 2 (L - 2) teacher-forced forwards in all."""
    from tqdm import tqdm

    from ..models.views import layer_view

    L = target.num_layers
    candidates = list(range(1, L - 1))  # first and last layers are never skipped
    log = []

    def score(skip_set):
        view = layer_view(target, [j for j in range(L) if j not in skip_set])
        alpha = agreement(view, seqs)
        est, k = estimate(alpha, (L - len(skip_set)) / L, costs, max_k)
        log.append({"skip": sorted(skip_set), "agreement": alpha, "estimated_speedup": est, "k": k})
        return est, k, alpha

    bar = tqdm(total=min(max_evals, 2 * len(candidates)), desc="search", file=sys.stderr)
    single = {}
    for i in candidates:
        if len(log) >= max_evals:
            break
        single[i] = score([i])[2]
        bar.update(1)
    order = sorted(single, key=lambda i: -single[i])
    best = (1.0, 0, None, [])  # (estimate, k, agreement, skip set): must beat plain decoding
    for n in range(1, len(order) + 1):
        if len(log) >= max_evals:
            break
        s_set = sorted(order[:n])
        est, k, alpha = score(s_set)
        bar.update(1)
        if est > best[0]:
            best = (est, k, alpha, s_set)
        bar.set_postfix(skipped=n, est=f"{est:.2f}x")
    bar.close()
    return best, log


def measured_speedup(dec, prompts, sp, skip: list[int], k: int) -> float | None:
    """plain vs layer_skip with ``skip``, interleaved, on the tuning prompts."""
    from ..core.config import SpecConfig
    from ..core.metrics import speedup

    spec = SpecConfig(method="layer_skip", skip_layers=skip, k=k)
    tot = {"plain": [0, 0.0], "layer_skip": [0, 0.0]}
    for _, ids in prompts:
        for name, run_spec in (("plain", SpecConfig(method="plain")), ("layer_skip", spec)):
            dec.forget_prefixes()  # both prefill the prompt
            t0 = time.perf_counter()
            out = dec.generate(ids, sampling=sp, spec=run_spec)
            tot[name][0] += len(out.token_ids)
            tot[name][1] += time.perf_counter() - t0
    return speedup(*tot["layer_skip"], *tot["plain"])


def main_tune_skip(opts: TuneSkipOptions) -> int:
    from tqdm import tqdm

    from ..api import SpecDecoder
    from ..core.config import SamplingParams, SpecConfig
    from ..models.cost_curve import measure_costs

    # skips its layers, timed on this CPU
    dec = SpecDecoder.load(opts.target, None, opts.dtype, threads=opts.threads, backend="hf", device="cpu")
    target = dec.target
    L = target.num_layers
    prompts = tuning_prompts(dec, opts.prompts_per_task, opts.dataset)
    if not prompts:
        raise SpecDraftError("no tuning prompts found")
    sp = SamplingParams(max_new_tokens=opts.tokens, ignore_eos=True)
    seqs = []
    for _, ids in tqdm(prompts, desc="target continuations", file=sys.stderr):
        out = dec.generate(ids, sampling=sp, spec=SpecConfig(method="plain"))
        seqs.append((ids + out.token_ids, len(ids)))
    costs = measure_costs(target, list(range(1, opts.max_k + 2)), repeats=3)
    (best_est, best_k, best_alpha, skip), log = search(target, seqs, costs, opts.max_k, opts.max_evals)
    evals = len(log)
    result = {
        "target": opts.target,
        "num_layers": L,
        "dtype": opts.dtype,
        "skip_layers": skip,
        "k": max(best_k, 1),
        "agreement": best_alpha,
        "estimated_speedup": best_est,
        "costs_ms": costs,
        "tuning_prompts": [p for p, _ in prompts],
        "evaluations": evals,
        "search_log": log,
    }
    if skip:  # measure the chosen set: plain vs layer_skip, interleaved, on the tuning prompts
        result["measured_speedup"] = measured_speedup(dec, prompts, sp, skip, max(best_k, 1))
    Path(opts.out).write_text(json.dumps(result, indent=1))
    if not skip:
        print(f"no skipped layer set is estimated to beat plain decoding ({evals} sets scored) -> {opts.out}")
        return 0
    msg = (
        f"skip {len(skip)}/{L} layers {skip}: agreement {best_alpha:.2f}, k={max(best_k, 1)}, estimated {best_est:.2f}x"
    )
    if "measured_speedup" in result:
        msg += f", measured {result['measured_speedup']:.2f}x"
    print(msg + f" -> {opts.out}")
    return 0
