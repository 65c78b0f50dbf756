"""Per-step cost of RequestProcessor on the Qwen vocabulary (docs/design.md): compile, mask, process, prune.
Run from the repo root: .venv/bin/python docs/results/structured/processing_time.py"""

import json
import time

import torch
from transformers import AutoTokenizer

from specdraft.core.config import SamplingParams
from specdraft.core.processors import RequestProcessor
from specdraft.core.tree import DraftTree

torch.set_num_threads(2)

tok = AutoTokenizer.from_pretrained("/root/.cache/specdraft/dense/qwen2.5-coder-1.5b")
V = 151936
schema = json.load(open("specdraft/bench/structured_schema.json"))
sp = SamplingParams(json_schema=schema)
prompt = [1, 2, 3]
t = time.perf_counter()
proc = RequestProcessor.for_request(sp, prompt, V, {151645, 151643}, tok)
print("compile+tokenizer s", time.perf_counter() - t)
t = time.perf_counter()
proc2 = RequestProcessor.for_request(sp, prompt, V, {151645, 151643}, tok)
print("compile (cached tokenizer) ms", (time.perf_counter() - t) * 1e3)
text = '{"task": "question", "language": "English", "summary": "The user asks'
ids = tok.encode(text)
proc.commit(ids[:5])
hist = prompt + ids[:5]
c = proc.constraint


def tm(f, n=50):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


print("allowed() ms", tm(lambda: c.allowed()))
lg1 = torch.randn(1, V)
lg9 = torch.randn(9, V)
chain = DraftTree.chain(ids[5:13])
print("process m=1 ms", tm(lambda: proc.process(lg1, hist)))
print("process m=9 chain ms", tm(lambda: proc.process(lg9, hist, chain)))
print("prune chain ms", tm(lambda: proc.prune(hist, chain)))
