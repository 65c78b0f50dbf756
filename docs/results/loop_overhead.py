"""Engine overhead per step (wall time outside the models' forward calls), new loop vs the copy of the
old one in /tmp/before (see ab_loop.py for how to make it): Qwen pair, bf16, draft_model k=4, 48 tokens."""

import sys
import time

sys.path.insert(0, "/tmp/before")
# The imports below come after that line: specdraft_before is found through it.
import specdraft_before as ob  # noqa: E402
import specdraft_before.api as oa  # noqa: E402
import specdraft_before.models.adapter as od  # noqa: E402

import specdraft  # noqa: E402
from specdraft.models.backends import load_model  # noqa: E402
from specdraft.models.loading import set_threads  # noqa: E402

set_threads(2)
t, d = load_model("qwen2.5-coder-1.5b", "bfloat16"), load_model("qwen2.5-coder-0.5b", "bfloat16")
dec = specdraft.SpecDecoder(t, d)
ids = dec.encode("Write a Python function that merges two sorted lists and explain it.", chat=True)
sp = specdraft.SamplingParams(max_new_tokens=48, ignore_eos=True)
spec = specdraft.SpecConfig(method="draft_model", k=4)
dec.generate(ids[:20], sampling=sp, spec=spec)
# time inside the models' forward calls vs the whole generate
inside = [0.0]


def wrap(m):
    f = m.forward

    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        inside[0] += time.perf_counter() - t0
        return r

    m.forward = g


wrap(t.model)
wrap(d.model)
for _ in range(2):
    inside[0] = 0.0
    t0 = time.perf_counter()
    r = dec.generate(ids, sampling=sp, spec=spec)
    w = time.perf_counter() - t0
    print(
        f"new: wall {w:.3f}s, model forwards {inside[0]:.3f}s, outside {w - inside[0]:.3f}s over {len(r.stats.steps)} "
        f"steps = {1000 * (w - inside[0]) / len(r.stats.steps):.2f} ms/step"
    )
old = oa.SpecDecoder(od.HFModel(t.model, t.tokenizer), od.HFModel(d.model, d.tokenizer))
for _ in range(2):
    inside[0] = 0.0
    t0 = time.perf_counter()
    r = old.generate(
        ids,
        sampling=ob.SamplingParams(max_new_tokens=48, ignore_eos=True),
        spec=ob.SpecConfig(method="draft_model", k=4),
    )
    w = time.perf_counter() - t0
    print(
        f"old: wall {w:.3f}s, model forwards {inside[0]:.3f}s, outside {w - inside[0]:.3f}s over {len(r.stats.steps)} "
        f"steps = {1000 * (w - inside[0]) / len(r.stats.steps):.2f} ms/step"
    )
