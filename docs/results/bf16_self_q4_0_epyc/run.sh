#!/bin/sh
# 2026-12-03, AMD EPYC with AVX-512 and AVX512_BF16 (no AMX), 2 threads: the bf16 target drafted by its own Q4_0
# copy on llama.cpp, against bf16 plain and llama.cpp's plain decoding of the Q4_K_M and Q4_0 files.
set -e
D=docs/results/bf16_self_q4_0_epyc
specdraft costs --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft self:Q4_0 --draft-backend llama \
  --tokens 1,2,4,8,12,16 --threads 2 --json $D/costs_selfq4_0.json
specdraft bench --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft self:Q4_0 --draft-backend llama \
  --config $D/variants.json \
  --methods plain,draft_model_k6,cascade_k10,auto,llama_cpp,llama_cpp@qwen2.5-coder-1.5b:Q4_0 \
  --preset core18+code_edit --max-new-tokens 64 --threads 2 --reference llama_cpp --out $D/bench.json
# after the draft adopts the target's prompt cache (commit 11d6a1b): the same, plus k = 8
specdraft bench --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft self:Q4_0 --draft-backend llama \
  --config $D/variants2.json \
  --methods plain,draft_model_k6,draft_model_k8,cascade_k10,auto,llama_cpp,llama_cpp@qwen2.5-coder-1.5b:Q4_0 \
  --preset core18+code_edit --max-new-tokens 64 --threads 2 --reference llama_cpp --out $D/bench_adopt.json
# T=1, core18
specdraft bench --backend hf --dtype bfloat16 --target qwen2.5-coder-1.5b --draft self:Q4_0 --draft-backend llama \
  --config $D/variants2.json --methods plain,draft_model_k8,llama_cpp \
  --preset core18 --max-new-tokens 64 --threads 2 --temperature 1.0 --seed 0 --reference llama_cpp --out $D/bench_t1.json
