"""What the network costs remote_draft: the target in node A's namespace (1 thread), its draft (SmolLM2-135M's
first 26 layers, 1 thread) in an actor on node A or on node B of the two-namespace cluster
(scripts/two_nodes.sh), the same prompts interleaved. Run inside node A, with the cluster up:

    scripts/two_nodes.sh up
    scripts/two_nodes.sh run A .venv/bin/python docs/results/two_nodes/remote_draft_overhead.py [LABEL]
    scripts/two_nodes.sh delay 1ms; ...same, LABEL=lan-1ms...; scripts/two_nodes.sh down

Prints one JSON line: decode tokens/s per placement (the median over rounds) and the ratio B / A."""

import json
import statistics
import sys
import time

from specdraft.api import SpecDecoder
from specdraft.models.loading import set_threads

PROMPTS = ["def fibonacci(n):\n    ", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,", "The capital of France is"]
set_threads(1)
dec = SpecDecoder.load("smollm2-135m", draft="smollm2-135m", draft_layers=26, dtype="float32", backend="hf")
specs = {
    node: {"method": "remote_draft", "k": 3, "ray_address": "198.18.0.1:6379", "remote_node": node}
    for node in ("198.18.0.1", "198.18.0.2")
}
specs["plain"] = {"method": "plain"}
rates: dict[str, list[float]] = {name: [] for name in specs}
for rnd in range(4):  # the first round warms up
    for prompt in PROMPTS:
        for name, spec in specs.items():
            t0 = time.perf_counter()
            r = dec.generate(prompt, sampling={"max_new_tokens": 48, "ignore_eos": True}, spec=spec)
            decode_s = time.perf_counter() - t0 - r.stats.prefill_s
            if rnd:
                rates[name].append((r.stats.new_tokens - 1) / decode_s)
tok_s = {name: round(statistics.median(v), 2) for name, v in rates.items()}
label = sys.argv[1] if len(sys.argv) > 1 else "veth"
print(
    json.dumps({"link": label, "decode_tok_s": tok_s, "b_over_a": round(tok_s["198.18.0.2"] / tok_s["198.18.0.1"], 3)})
)
