"""Engine plain on the stateful IR vs OpenVINO GenAI with its PA (paged attention, default) and SDPA
(stateful) backends: the same prompts interleaved, 64 new tokens, 2 threads, prefix caching off where it applies."""

import time

import numpy as np
import openvino as ov
import openvino_genai as g
import torch

from specdraft.api import SpecDecoder
from specdraft.core import prompts
from specdraft.models.backends import load_model

torch.set_num_threads(2)

m = load_model("qwen2.5-coder-1.5b:Q4_0", backend="openvino")
dec = SpecDecoder(m)
rows = [
    r
    for r in prompts.preset_rows("core18", None, None, None)
    if r["task"] in ("math_reasoning", "qa", "mt_bench", "translation")
]
ids = [dec.encode(r["prompt"], chat=True) for r in rows]


def pipe(backend):
    sc = g.SchedulerConfig()
    sc.enable_prefix_caching = False
    kw = {"INFERENCE_NUM_THREADS": 2, "ATTENTION_BACKEND": backend}
    if backend == "PA":
        kw["scheduler_config"] = sc
    return g.LLMPipeline(str(m.ir.parent), "CPU", **kw)


pipes = {"SDPA": pipe("SDPA")}


def run_genai(p, x):
    a = np.asarray([x], np.int64)
    c = g.GenerationConfig()
    c.max_new_tokens = 64
    c.ignore_eos = True
    t0 = time.perf_counter()
    out = p.generate(g.TokenizedInputs(ov.Tensor(a), ov.Tensor(np.ones_like(a))), c)
    return time.perf_counter() - t0, len(out.tokens[0])


def run_engine(x):
    t0 = time.perf_counter()
    o = dec.generate(x, sampling={"max_new_tokens": 64, "ignore_eos": True}, spec={"method": "plain"})
    return time.perf_counter() - t0, len(o.token_ids)


for f in (lambda x: run_engine(x), lambda x: run_genai(pipes["SDPA"], x)):
    f(ids[0][:20])
tot = {"engine": [0, 0], "engine torch1": [0, 0], "genai SDPA": [0, 0]}


def run_engine1(x):
    torch.set_num_threads(1)
    try:
        return run_engine(x)
    finally:
        torch.set_num_threads(2)


for _ in range(2):
    for x in ids:
        for name, f in (
            ("engine", run_engine),
            ("engine torch1", run_engine1),
            ("genai SDPA", lambda x: run_genai(pipes["SDPA"], x)),
        ):
            w, n = f(x)
            tot[name][0] += w
            tot[name][1] += n
    print({k: f"{v[1] / v[0]:.2f} tok/s" for k, v in tot.items()}, flush=True)
