"""The engine's own time per step: wall time of a generation minus the time inside the model rows'
forward / add_rows calls (the backends' work), per step. Run it with PYTHONPATH set to the checkout to
measure (this file imports nothing it defines), e.g. before and after a change:

    PYTHONPATH=/tmp/before .venv/bin/python docs/results/overhead/step_overhead.py hf
    .venv/bin/python docs/results/overhead/step_overhead.py llama

hf: the Qwen pair in bf16; llama: the Qwen pair's GGUF files; draft_model k=4 and prompt_lookup, 48 tokens
(METHODS=auto,prompt_lookup: other methods).
A third argument names another target (e.g. qwen2.5-coder-1.5b:Q4_0, the fastest file on an AMX CPU), a
fourth another draft (openvino reads the 0.5B's Q4_0 file, not its Q4_K_M: qwen2.5-coder-0.5b:Q4_0).
"""

import os
import sys
import time

import specdraft
from specdraft.models.backends import load_model
from specdraft.models.loading import set_threads

backend = sys.argv[1] if len(sys.argv) > 1 else "hf"
set_threads(2)
t = load_model(sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-coder-1.5b", "bfloat16", backend=backend)
d = load_model(sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-0.5b", "bfloat16", backend=backend)
rows_classes = {type(t.new_rows()), type(d.new_rows())}
inside, depth = [0.0], [0]  # depth: add_rows may call forward; count the outermost call only
for cls in rows_classes:
    for name in ("forward", "add_rows"):
        f = getattr(cls, name)

        def timed(*a, _f=f, **k):
            t0 = time.perf_counter()
            depth[0] += 1
            try:
                return _f(*a, **k)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    inside[0] += time.perf_counter() - t0

        setattr(cls, name, timed)
dec = specdraft.SpecDecoder(t, d)
ids = dec.encode("Write a Python function that merges two sorted lists and explain it.", chat=True)
sp = specdraft.SamplingParams(max_new_tokens=48, ignore_eos=True)
for method in os.environ.get("METHODS", "draft_model,prompt_lookup").split(","):
    spec = specdraft.SpecConfig(method=method, k=4)
    dec.generate(ids[:20], sampling=sp, spec=spec)  # warm-up
    for _ in range(3):
        inside[0] = 0.0
        t0 = time.perf_counter()
        r = dec.generate(ids, sampling=sp, spec=spec)
        wall = time.perf_counter() - t0
        n = len(r.stats.steps)
        out = wall - inside[0]
        print(
            f"{backend} {method}: {n} steps, {1000 * wall / n:.1f} ms/step, engine {1000 * out / n:.2f} ms/step "
            f"({100 * out / wall:.2f}%)",
            flush=True,
        )
