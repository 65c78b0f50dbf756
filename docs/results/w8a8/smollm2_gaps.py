"""Where speculative decoding on a w8a8 SmolLM2-135M (float32) departs from its own plain greedy
decoding, and the top-2 logit gap there (metrics.near_tie_bound's 1.0 for int8 activations comes from
these): `.venv/bin/python docs/results/w8a8/smollm2_gaps.py`"""

import copy

from specdraft.api import SpecDecoder
from specdraft.bench.harness import compare
from specdraft.models.backends import load_model
from specdraft.models.hf import HFModel
from specdraft.models.lowbit import quantize_linears

f = load_model("smollm2-135m", "float32")
m = copy.deepcopy(f.model)
quantize_linears(m, "w8a8")
t = HFModel(m, f.tokenizer, name="w8a8")
dec = SpecDecoder(t, f)
for text in ["def fibonacci(n):\n    ", "The capital of France is", "Write a short poem about the sea.\n"]:
    ids = f.tokenizer(text).input_ids
    sp = {"max_new_tokens": 48, "ignore_eos": True}
    plain = dec.generate(ids, sampling=sp, spec={"method": "plain"}).token_ids
    for spec in ({"method": "draft_model", "k": 5}, {"method": "prompt_lookup"}):
        got = dec.generate(ids, sampling=sp, spec=spec).token_ids
        print(text[:12], spec["method"], "same" if got == plain else compare(t, ids, plain, got))
