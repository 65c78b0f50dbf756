#!/usr/bin/env bash
# The llama.cpp backend tables of docs/benchmark-log.md (Qwen2.5-Coder 1.5B, 128 new tokens, speedups over
# llama.cpp's own plain decoding of the same GGUF file). Run from the repo root after `make models` and
# `.venv/bin/specdraft models quantize qwen2.5-coder-1.5b --type Q4_0`. Each run resumes its --out.
set -euo pipefail
B=".venv/bin/python -m specdraft.cli bench --backend llama --draft qwen2.5-coder-0.5b --config docs/configs/llama_cpu.json \
  --max-new-tokens 128 --reference llama_cpp --llama-k 4,10 --llama-draft-k 4"
M="plain,llama_cpp,llama_cpp_lookup,llama_cpp_draft,prompt_lookup_k16,prompt_lookup_ca,suffix_ca"
mkdir -p results/llama
$B --target qwen2.5-coder-1.5b --preset core18 --methods $M,hf:plain --out results/llama/core18_q4km_greedy.json
$B --target qwen2.5-coder-1.5b:Q4_0 --preset code_edit --methods $M,hf:plain --out results/llama/code_edit_q40_greedy.json
$B --target qwen2.5-coder-1.5b:Q4_0 --preset code_edit --methods $M --temperature 1 --out results/llama/code_edit_q40_t1.json
$B --target qwen2.5-coder-1.5b --preset code_edit --methods $M --out results/llama/code_edit_q4km_greedy.json
$B --target qwen2.5-coder-1.5b:Q4_0 --preset core18 --methods $M --out results/llama/core18_q40_greedy.json
$B --target qwen2.5-coder-1.5b --preset core18 --methods $M --temperature 1 --out results/llama/core18_q4km_t1.json
