"""Is a T=1 sampler the target's distribution? For each generated token, d = log p(x) + H(p) has mean 0
under exact sampling; Z = sum d / sqrt(sum Var(log p)) ~ N(0, 1)."""

import copy
import json
import math
import sys
import time

import torch

from specdraft import SamplingParams, SpecConfig, SpecDecoder
from specdraft.core.prompts import default_dataset

dec = SpecDecoder.load("qwen2.5-coder-1.5b", draft="smollm2-135m", dtype="bfloat16", draft_backend="llama")
hfd = SpecDecoder.load("smollm2-135m", dtype="bfloat16").target
qs = {str(q["question_id"]): q for q in map(json.loads, open(default_dataset()))}
tgt, asst = dec.target.model, copy.deepcopy(hfd.model)
eos = sorted(dec.eos_ids)
ids = ["161", "241", "321", "401", "481", "81", "121", "101", "162"]
seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 2)


@torch.inference_mode()
def stats(x, out):
    seq = torch.tensor([x + out])
    lg = tgt(seq).logits[0, len(x) - 1 : len(x) - 1 + len(out)].float()
    lp = torch.log_softmax(lg, -1)
    p = lp.exp()
    H = -(p * lp).sum(-1)
    E2 = (p * lp * lp).sum(-1)
    lx = lp[torch.arange(len(out)), torch.tensor(out)]
    return float((lx + H).sum()), float((E2 - H * H).sum()), len(out)


def gen(mode, x, seed):
    if mode == "engine":
        sp = SamplingParams(max_new_tokens=48, temperature=1.0, seed=seed)
        return dec.generate(x, sampling=sp, spec=SpecConfig(method="draft_model", k=4)).token_ids
    xt = torch.tensor([x])
    kw = dict(
        max_new_tokens=48,
        attention_mask=torch.ones_like(xt),
        eos_token_id=eos,
        pad_token_id=eos[0],
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=1.0,
    )
    if mode == "uad":
        kw.update(assistant_model=asst, tokenizer=dec.tokenizer, assistant_tokenizer=hfd.tokenizer)
    torch.manual_seed(seed)
    out = tgt.generate(xt, **kw)[0, len(x) :].tolist()
    stop = next((j for j, t in enumerate(out) if t in dec.eos_ids), None)
    return out if stop is None else out[: stop + 1]


for mode in ["plain", "engine", "uad"]:
    S = V = N = 0
    t0 = time.time()
    for i in ids:
        x = dec.encode(qs[i]["turns"][0], chat=True)
        for seed in seeds:
            s, v, n = stats(x, gen(mode, x, seed))
            S += s
            V += v
            N += n
    print(
        f"{mode}: tokens {N}, mean(log p + H) {S / N:+.3f} nats/token, "
        f"Z = {S / math.sqrt(V):+.2f} ({time.time() - t0:.0f}s)",
        flush=True,
    )
