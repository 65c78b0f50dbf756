"""Mask time per step on this CPU: xgrammar vs llguidance, Qwen tokenizer, a JSON schema.

Needs xgrammar (not a dependency: pip install xgrammar==0.2.9, which pulls triton). Run from the repo
root: .venv/bin/python docs/results/structured/mask_time.py
"""

import json
import time

import llguidance
import llguidance.hf
import llguidance.torch as lt
import xgrammar as xgr
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained("/root/.cache/specdraft/dense/qwen2.5-coder-1.5b")
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
text = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines", "notes"]})
ids = tok.encode(text)
V = 151936

t0 = time.perf_counter()
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
comp = xgr.GrammarCompiler(info)
cg = comp.compile_json_schema(json.dumps(schema))
print("xgrammar compile s", time.perf_counter() - t0)
m = xgr.GrammarMatcher(cg)
bm = xgr.allocate_token_bitmask(1, V)
ts = []
for t in ids:
    a = time.perf_counter()
    m.fill_next_token_bitmask(bm)
    ts.append(time.perf_counter() - a)
    assert m.accept_token(t), t
print("xgrammar mask ms median", sorted(ts)[len(ts) // 2] * 1e3, "max", max(ts) * 1e3, "n", len(ts))
a = time.perf_counter()
m.rollback(5)
print("rollback ms", (time.perf_counter() - a) * 1e3)
t0 = time.perf_counter()
lt_tok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
lm = llguidance.LLMatcher(lt_tok, g)
print("llg compile s", time.perf_counter() - t0, lm.get_error())
bm2 = lt.allocate_token_bitmask(1, V)
ts = []
for t in ids:
    a = time.perf_counter()
    lt.fill_next_token_bitmask(lm, bm2, 0)
    ts.append(time.perf_counter() - a)
    assert lm.consume_token(t), t
print("llg mask ms median", sorted(ts)[len(ts) // 2] * 1e3, "max", max(ts) * 1e3)
a = time.perf_counter()
lm.rollback(5)
print("rollback ms", (time.perf_counter() - a) * 1e3)
