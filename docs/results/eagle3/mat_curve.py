"""Mean accepted tokens per step (MAT) of EAGLE-3 heads, greedy, on prompts the heads never saw.

    python docs/results/eagle3/mat_curve.py HEAD_DIR [HEAD_DIR ...] --data DATA_DIR --out mat_curve.json

Each HEAD_DIR is a head directory (``specdraft train eagle3``'s, or a copy of a checkpoint of it). Two
prompt sets: core18 (Spec-Bench, never in the training data; ``--tasks`` picks its tasks) and the
held-out split of the head's own kind of prompts (``DATA_DIR/synth.jsonl``'s kept prompts i with
i % ``--holdout`` == 0, which ``train eagle3 --holdout`` keeps out of training). Two drafts per set: a
chain of ``--k`` tokens and EAGLE-2's dynamic tree. The target runs on the backend the head serves on
(``--backend``, default llama.cpp on the Q4_0 file). MAT counts the target's own token too (1.0 = no draft
token accepted). Nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdraft.api import SpecDecoder
from specdraft.core.metrics import mean_accepted_tokens, per_position_acceptance
from specdraft.core.prompts import preset_rows

DRAFTS = {"chain": {"tree": "chain"}, "tree": {"tree": "dynamic", "tree_topk": 4, "tree_budget": 12}}


def prompt_sets(data_dir: Path, holdout: int, n_held: int, tasks: list[str] | None) -> dict[str, list[str]]:
    core = [r["prompt"] for r in preset_rows("core18", tasks=tasks)]
    rows = [json.loads(line) for line in (data_dir / "synth.jsonl").open()]
    kept = [r["text"] for r in rows if r.get("kept")]
    held = [p for i, p in enumerate(kept) if holdout and i % holdout == 0][:n_held]
    return {"core18": core, "held_out": held}


def mat_of(dec, head: str, prompts: list[str], draft: dict, k: int, new: int) -> dict:
    steps = []
    for p in prompts:
        out = dec.generate(
            p, sampling={"max_new_tokens": new}, spec={"method": "eagle3", "head": head, "k": k, **draft}, chat=True
        )
        steps += out.stats.steps
    return {
        "mat": round(mean_accepted_tokens(steps), 3),
        "steps": len(steps),
        "per_position": [round(a, 3) for a in per_position_acceptance(steps)][:k],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b:Q4_0")
    ap.add_argument("--backend", default="llama")
    ap.add_argument("--data", required=True, help="the heads' DIR/data (synth.jsonl)")
    ap.add_argument("--holdout", type=int, default=50)
    ap.add_argument("--held-prompts", type=int, default=12)
    ap.add_argument("--tasks", default=None, help="core18's tasks to decode (comma-separated; default all)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dec = SpecDecoder.load(a.target, backend=a.backend)
    sets = prompt_sets(Path(a.data), a.holdout, a.held_prompts, a.tasks.split(",") if a.tasks else None)
    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    for head in a.heads:
        cfg = json.loads((Path(head) / "config.json").read_text())["specdraft"]
        row = {
            "step": cfg["step"],
            "train_s": cfg.get("train_s"),
            "batch_size": cfg.get("batch_size"),
            "answer_tokens": cfg.get("data_meta", {}).get("answer_tokens"),
        }
        for name, prompts in sets.items():
            for draft, fields in DRAFTS.items():
                row[f"{name}/{draft}"] = mat_of(dec, head, prompts, fields, a.k, a.max_new_tokens)
                print(head, name, draft, row[f"{name}/{draft}"]["mat"], flush=True)
        out[str(head)] = row
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
