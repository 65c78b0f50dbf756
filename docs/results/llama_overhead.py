"""Per-step Python overhead of the llama backend: wall time of a 64-token greedy generation minus the
time inside llama_decode (Qwen 1.5B Q4_K_M, 2 threads), next to llama-cpp-python's own plain loop.
Run: .venv/bin/python docs/results/llama_overhead.py"""

import time

import torch
from llama_cpp import Llama

import specdraft.models.llama as L
from specdraft.api import SpecDecoder
from specdraft.core.config import SamplingParams, SpecConfig

torch.set_num_threads(2)

dec = SpecDecoder.load("qwen2.5-coder-1.5b", backend="llama", threads=2)
ids = dec.encode("Write a Python function that reverses a linked list, then explain it.", chat=True)
sp = SamplingParams(max_new_tokens=64, ignore_eos=True)
orig = L.LlamaRows._decode
acc = [0.0, 0]


def timed(self, b):
    t0 = time.perf_counter()
    orig(self, b)
    acc[0] += time.perf_counter() - t0
    acc[1] += 1


L.LlamaRows._decode = timed
for m in ["plain", "plain", "prompt_lookup"]:
    acc[:] = [0.0, 0]
    t0 = time.perf_counter()
    out = dec.generate(ids, sampling=sp, spec=SpecConfig(method=m))
    wall = time.perf_counter() - t0
    print(
        m,
        "wall %.3f decode %.3f (%d calls) overhead %.1f%% = %.2f ms/step"
        % (wall, acc[0], acc[1], 100 * (wall - acc[0]) / wall, 1000 * (wall - acc[0]) / len(out.stats.steps)),
    )
llm = Llama(model_path=str(dec.target.path), n_ctx=4096, n_threads=2, n_threads_batch=2, flash_attn=True, verbose=False)
for _ in range(2):
    t0 = time.perf_counter()
    n = 0
    llm.reset()
    for _ in llm.generate(ids, temp=0.0):
        n += 1
        if n >= 64:
            break
    print("llama_cpp wall %.3f" % (time.perf_counter() - t0))
