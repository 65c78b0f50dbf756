"""The bf16 target (torch) and its self:Q4_0 draft (llama.cpp) take turns on the same 2 cores: does one's
thread pool, spinning after its work, slow the other? Times a draft_model k=6 decode per step, the draft's
and the target's side apart, against each side alone. Run under different OpenMP wait policies:
    .venv/bin/python docs/results/bf16_self_q4_0_epyc/spin.py            (defaults)
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/bf16_self_q4_0_epyc/spin.py
"""

import os
import statistics

from specdraft.api import SpecDecoder
from specdraft.core.config import SamplingParams, SpecConfig
from specdraft.models.cost_curve import measure_costs

dec = SpecDecoder.load("qwen2.5-coder-1.5b", draft="self:Q4_0", dtype="bfloat16", threads=2, draft_backend="llama")
alone_t = measure_costs(dec.target, [1, 7], repeats=5)
alone_d = measure_costs(dec.draft, [1], repeats=5)
prompt = dec.encode("Write a Python function that parses an ISO 8601 date and explain each step.", chat=True)
dec.generate(prompt, SamplingParams(max_new_tokens=16), {"method": "draft_model", "k": 6})  # warm-up
out = dec.generate(prompt, SamplingParams(max_new_tokens=96), SpecConfig(method="draft_model", k=6))
steps = out.stats.steps[1:]
per_draft = [s.draft_s / s.drafted * 1000 for s in steps if s.drafted]
per_verify = [s.verify_s * 1000 for s in steps if s.drafted == 6]
print(
    f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}: alone: target 1 tok {alone_t[1]:.0f} ms, "
    f"7 tok {alone_t[7]:.0f} ms, draft 1 tok {alone_d[1]:.0f} ms | in the decode: draft "
    f"{statistics.median(per_draft):.0f} ms per drafted token, "
    f"target forward of 7 {statistics.median(per_verify):.0f} ms "
    f"(median of {len(per_verify)} steps); {out.stats.new_tokens / out.stats.wall_s:.2f} tok/s"
)
