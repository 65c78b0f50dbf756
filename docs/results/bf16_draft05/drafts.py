"""Which draft is cheapest per accepted token for the bf16 Qwen 1.5B target on this machine.
Usage (from the repository root): .venv/bin/python docs/results/bf16_draft05/drafts.py self:Q4_0 self:Q3_K_M
self:Q2_K qwen2.5-coder-0.5b:Q4_0 qwen2.5-coder-0.5b   (make the variants first: specdraft models quantize)
Per draft (llama.cpp): one-token ms, and acceptance / MAT of draft_model k=6 on 12 Spec-Bench prompts, 48 tokens."""

import json
import sys
from pathlib import Path

from specdraft.api import SpecDecoder
from specdraft.core.prompts import default_dataset
from specdraft.models.backends import load_model
from specdraft.models.cost_curve import measure_costs
from specdraft.models.loading import set_threads

set_threads(2)
target = load_model("qwen2.5-coder-1.5b", "bfloat16")
qs = [json.loads(line) for line in open(default_dataset())]
by_task = {}
for q in qs:
    by_task.setdefault(q["category"], []).append(q)
prompts = [by_task[t][i]["turns"][0] for t in sorted(by_task)[:6] for i in range(2)]
tc = measure_costs(target, [1, 7], repeats=3)
print("target bf16: 1 tok %.0f ms, 7 tok %.0f ms" % (tc[1], tc[7]), flush=True)
out = {"target": tc}
for name in sys.argv[1:]:
    d = load_model(name.replace("self", "qwen2.5-coder-1.5b"), "bfloat16", backend="llama")
    c = measure_costs(d, [1], repeats=5)[1]
    dec = SpecDecoder(target, d)
    acc = drafted = steps = toks = 0
    for p in prompts:
        r = dec.generate(p, sampling={"max_new_tokens": 48}, spec={"method": "draft_model", "k": 6}, chat=True)
        st = r.stats.steps
        acc += sum(s.accepted for s in st)
        drafted += sum(s.drafted for s in st)
        steps += len(st)
        toks += len(r.token_ids)
    a, mat = acc / drafted, toks / steps
    step = 6 * c + tc[7]
    print(
        f"{name}: one token {c:.1f} ms ({c / tc[1]:.2f} of a bf16 token), acceptance {a:.2f}, MAT {mat:.2f}, "
        f"k=6 step {step:.0f} ms -> {1000 * mat / step:.1f} tok/s predicted",
        flush=True,
    )
    out[name] = {"ms": c, "acceptance": a, "mat": mat}
    del dec, d
json.dump(out, open(Path(__file__).with_name("drafts.json"), "w"), indent=1)
