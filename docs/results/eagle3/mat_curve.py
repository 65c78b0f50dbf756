"""Mean accepted tokens per step (MAT) of EAGLE-3 heads, greedy, on prompts the heads never saw.

    python docs/results/eagle3/mat_curve.py HEAD_DIR [HEAD_DIR ...] --out mat_curve.json

Each HEAD_DIR holds a head's config.json + head.safetensors (a checkpoint of ``specdraft train eagle3``).
Held out: core18's tasks with short prompts (mt_bench, translation, qa, math_reasoning: 12 prompts;
summarization and rag prefill 1,000+ tokens, most of this script's time, and change nothing about the
head). The target runs on transformers in float32 (``--dtype``; bf16 is emulated and slower on CPUs without
AVX512_BF16, and MAT barely depends on it); every head decodes the same prompts: the core18 preset
(Spec-Bench, held out from training; ``--tasks``) and, to show how far the head fits its own training set, the first
``--train-prompts`` prompts the head was trained on (``DATA_DIR/synth.jsonl``). MAT counts the target's
own token too (1.0 = no draft token accepted). Nothing here is timed: training may run beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdraft.api import SpecDecoder
from specdraft.core.metrics import mean_accepted_tokens, per_position_acceptance
from specdraft.core.prompts import preset_rows


SHORT_TASKS = "mt_bench,translation,qa,math_reasoning"


def prompt_sets(data_dir: Path, n_train: int, tasks: list[str]) -> dict[str, list[str]]:
    held_out = [r["prompt"] for r in preset_rows("core18", tasks=tasks)]
    rows = [json.loads(line) for line in (data_dir / "synth.jsonl").open()]
    seen = [r["text"] for r in rows if r.get("kept")][:n_train]
    return {"core18": held_out, "train": seen}


def mat_of(dec, head: str, prompts: list[str], k: int, new: int) -> dict:
    steps = []
    for i, p in enumerate(prompts):
        out = dec.generate(p, sampling={"max_new_tokens": new}, spec={"method": "eagle3", "head": head, "k": k},
                           chat=True)
        steps += out.stats.steps
        print(f"  {i + 1}/{len(prompts)}: MAT {out.stats.mat:.2f}", flush=True)
    return {"mat": round(mean_accepted_tokens(steps), 3), "steps": len(steps),
            "per_position": [round(a, 3) for a in per_position_acceptance(steps)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--data", default="results/eagle3/qwen2.5-coder-1.5b/data")
    ap.add_argument("--train-prompts", type=int, default=4)
    ap.add_argument("--tasks", default=SHORT_TASKS, help="core18's tasks to decode (comma-separated)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dec = SpecDecoder.load(a.target, backend="hf", dtype=a.dtype)
    sets = prompt_sets(Path(a.data), a.train_prompts, a.tasks.split(","))
    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    for head in a.heads:
        cfg = json.loads((Path(head) / "config.json").read_text())
        row = {"step": cfg["step"], "tokens_seen": cfg["step"] * cfg["batch_size"] * cfg["data_meta"]["n_tokens"]
               // cfg["data_meta"]["n_seqs"], "train_s": cfg.get("train_s")}
        for name, prompts in sets.items():
            row[name] = mat_of(dec, head, prompts, a.k, a.max_new_tokens)
        out[str(head)] = row
        print(head, json.dumps(row), flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
