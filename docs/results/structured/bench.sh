#!/usr/bin/env bash
# The structured-output workload (docs/benchmark-log.md "Structured output"): Spec-Bench prompts wrapped in
# "describe this request as JSON", with and without the JSON schema, on both backends. About 45 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
S=specdraft/bench/structured_schema.json
O=docs/results/structured
B=".venv/bin/specdraft bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --preset structured --max-new-tokens 128 --no-plots"
# llama.cpp (Q4_K_M GGUF, the fastest backend here): 24 prompts
$B --backend llama --methods plain,prompt_lookup,suffix,draft_model,auto --json-schema $S --out $O/llama_schema.json
$B --backend llama --methods plain,prompt_lookup,suffix,draft_model,auto --out $O/llama_free.json
# transformers bf16: 6 short prompts (2 each of translation, qa, math_reasoning)
H="--backend hf --dtype bfloat16 --tasks translation,qa,math_reasoning --n-per-task 2 --methods plain,prompt_lookup,draft_model,hybrid"
$B $H --json-schema $S --out $O/hf_schema.json
$B $H --out $O/hf_free.json
