"""What a seeded row's own lane costs the batch it leaves (docs/server.md, "Seeded requests in a batch").

SmolLM2-135M, prompt lookup, temperature 1, 48 new tokens a row, 2 threads; four layouts decoded by one
engine (generate_batch), interleaved, on transformers float32 and llama.cpp Q4_1: four unseeded rows, one
seeded beside three unseeded, the seeded row alone, four seeded rows. Per layout: wall seconds, steps, ms per
step, and every row's new tokens (each row advances every step: neither lane waits for the other).
With --load N, N other processes run torch matmuls on 2 threads each meanwhile (a busy machine);
--threads sets the engine's (default 2).

    python docs/results/seeded_lanes/lane_cost.py [--load 2] [--repeats 3] [--threads 1] [--backends hf]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

HOG = (
    "import torch, time\ntorch.set_num_threads(2)\na = torch.randn(256, 256)\nt0 = time.time()\n"
    "while time.time() - t0 < 3600:\n    a = torch.tanh(a @ a)\n"
)
PROMPTS = [
    "Write a short story about a robot.",
    "Explain photosynthesis briefly.",
    "List five fruits and their colors.",
    "Describe the water cycle.",
]
LAYOUTS = {"4 unseeded": [0, 0, 0, 0], "1 seeded + 3": [1, 0, 0, 0], "seeded alone": [1], "4 seeded": [1, 1, 1, 1]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="hf,llama")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from specdraft.core.config import SamplingParams, SpecConfig
    from specdraft.drafters.prompt_lookup import PromptLookupDrafter
    from specdraft.engine import Job, generate_batch
    from specdraft.models.backends import load_model
    from specdraft.models.cost_curve import cpu_name
    from specdraft.models.loading import set_threads

    set_threads(a.threads)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(a.load)]
    spec = SpecConfig(method="prompt_lookup", k=4).validate()
    out = {"cpu": cpu_name(), "load": a.load, "threads": a.threads, "date": time.strftime("%Y-%m-%d"), "rows": []}
    try:
        for backend in a.backends.split(","):
            m = load_model("smollm2-135m", "float32" if backend == "hf" else None, backend=backend)
            ids = [m.tokenizer(p)["input_ids"] for p in PROMPTS]
            times = {k: [] for k in LAYOUTS}
            for rep in range(a.repeats + 1):  # the first round warms up
                for name, seeded in LAYOUTS.items():
                    jobs = [
                        Job(
                            ids[i],
                            SamplingParams(
                                temperature=1.0, seed=(11 + i) if s else None, max_new_tokens=48, ignore_eos=True
                            ),
                            PromptLookupDrafter(spec),
                        )
                        for i, s in enumerate(seeded)
                    ]
                    t0 = time.perf_counter()
                    res = generate_batch(m, jobs, tokenizer=m.tokenizer)
                    dt = time.perf_counter() - t0
                    steps = max(len(r.stats.steps) for r in res)
                    if rep:
                        times[name].append((dt, steps, [r.stats.new_tokens for r in res]))
            for name, runs in times.items():
                wall = statistics.median(t for t, _, _ in runs)
                steps = statistics.median(s for _, s, _ in runs)
                row = {
                    "backend": backend,
                    "layout": name,
                    "wall_s": round(wall, 3),
                    "steps": steps,
                    "ms_per_step": round(1000 * wall / steps, 1),
                    "new_tokens": runs[0][2],
                }
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        for h in hogs:
            h.kill()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
