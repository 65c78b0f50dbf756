import json
import sys
import time

from specdraft import SamplingParams, SpecConfig, SpecDecoder
from specdraft.core.prompts import default_dataset

dec = SpecDecoder.load("qwen2.5-coder-1.5b", draft="smollm2-135m", dtype="bfloat16", draft_backend="llama")
qs = {str(q["question_id"]): q for q in map(json.loads, open(default_dataset()))}
ids = ["81", "161", "241", "321", "401", "101"]
T = float(sys.argv[1])
sp = SamplingParams(max_new_tokens=48, temperature=T, seed=0 if T > 0 else None)
cfgs = [("plain", SpecConfig(method="plain"))] + [
    (c, SpecConfig(method="draft_model", **json.loads(c))) for c in sys.argv[2:]
]
dec.generate(qs["81"]["turns"][0], chat=True, sampling=sp, spec=cfgs[1][1])
for name, spec in cfgs:
    tot = dict(tok=0, wall=0, dr=0, acc=0, steps=0)
    for i in ids:
        t0 = time.perf_counter()
        out = dec.generate(qs[i]["turns"][0], chat=True, sampling=sp, spec=spec)
        w = time.perf_counter() - t0
        s = out.to_dict()["stats"]
        tot["tok"] += s["new_tokens"]
        tot["wall"] += w
        tot["dr"] += s["drafted"]
        tot["acc"] += s["accepted"]
        tot["steps"] += s["steps"]
    print(
        name,
        f"tok/s {tot['tok'] / tot['wall']:.2f} acc {tot['acc'] / max(1, tot['dr']):.2f} "
        f"mat {(tot['acc'] + tot['steps']) / tot['steps']:.2f}",
        flush=True,
    )
