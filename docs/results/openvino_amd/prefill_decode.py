"""Where the engine's plain decoding on OpenVINO loses to OpenVINO GenAI's: prefill and per-token decode,
measured apart on the same IR (2 threads)."""

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as g
import torch

from specdraft.core import prompts
from specdraft.models.backends import load_model

torch.set_num_threads(2)

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b:Q4_0"
m = load_model(name, backend="openvino")
tok = m.tokenizer
rows = prompts.preset_rows("core18", None, None, None)
texts = {r["id"]: r for r in rows}
long = max(rows, key=lambda r: len(json.dumps(r)))
ids_long = (
    tok.apply_chat_template([{"role": "user", "content": long["turns"][0]}], add_generation_prompt=True)
    if "turns" in long
    else None
)
if ids_long is None or not isinstance(ids_long[0], int):
    ids_long = tok(json.dumps(long))["input_ids"]
short = tok("def fibonacci(n):\n    ")["input_ids"]
pipe = g.LLMPipeline(str(m.ir.parent if m.ir.is_file() else m.ir), "CPU", INFERENCE_NUM_THREADS=2)


def engine(ids, n):
    r = m.new_rows()
    t0 = time.perf_counter()
    r.add_rows([ids[:-1]])
    t1 = time.perf_counter()
    x = [ids[-1]]
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        lg = r.forward([x])
        r.commit([1])
        x = [int(lg[0, -1].argmax())]
        ts.append(time.perf_counter() - a)
    return t1 - t0, ts


def genai(ids, n):
    x = np.asarray([ids], np.int64)
    inp = g.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x)))
    c = g.GenerationConfig()
    c.max_new_tokens = n
    t0 = time.perf_counter()
    out = pipe.generate(inp, c)
    w = time.perf_counter() - t0
    pm = out.perf_metrics
    return w, pm.get_ttft().mean, pm.get_tpot().mean


for label, ids0 in (("long", ids_long),):
    engine(short, 3)
    genai(short, 3)
    for rep in range(3):
        ids = [1000 + rep] + ids0  # a prompt GenAI has not seen: no prefix-cache hit
        pf, ts = engine(ids, 32)
        w, ttft, tpot = genai([2000 + rep] + ids0, 33)
        print(
            f"{label} ({len(ids)} tok): engine prefill {pf * 1000:.0f} ms + first {ts[0] * 1000:.0f}, "
            f"decode median {np.median(ts[1:]) * 1000:.1f} ms | "
            f"genai ttft {ttft:.0f} ms, tpot {tpot:.1f} ms, wall {w:.2f}s",
            flush=True,
        )
