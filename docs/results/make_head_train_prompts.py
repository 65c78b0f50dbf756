"""Write the head-training prompts: Spec-Bench questions minus the core18 bench prompts, every
9th of the rest (spread over all tasks). Usage: python docs/results/make_head_train_prompts.py OUT.jsonl"""

import json
import sys

from specdraft.core.prompts import default_dataset

BENCH_IDS = {81, 101, 121, 161, 162, 163, 241, 242, 243, 321, 322, 323, 401, 402, 403, 481, 482, 483}
src = default_dataset()
rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
keep = [r for r in rows if r["question_id"] not in BENCH_IDS][::9]
with open(sys.argv[1], "w") as f:
    for r in keep:
        f.write(json.dumps(r) + "\n")
print(
    f"{len(keep)} prompts (of {len(rows)}; "
    f"{len(rows) - len([r for r in rows if r['question_id'] not in BENCH_IDS])} bench prompts excluded) "
    f"-> {sys.argv[1]}"
)
