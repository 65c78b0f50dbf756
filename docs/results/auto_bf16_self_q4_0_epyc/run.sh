#!/bin/sh
# 2026-12-03, AMD EPYC (AVX-512, AVX512_BF16, no AMX): auto after its exploration counts lost time (commit
# after 51d7be4), on the bf16 target drafted by its own Q4_0 copy on llama.cpp (prompt cache adopted).
set -e
D=docs/results/auto_bf16_self_q4_0_epyc
specdraft bench --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft self:Q4_0 --draft-backend llama \
  --config $D/variants.json --methods plain,draft_model_k8,auto,auto_k8,llama_cpp \
  --preset core18+code_edit --max-new-tokens 64 --threads 2 --reference llama_cpp --out $D/bench.json
