#!/usr/bin/env bash
# auto with and without its cost-curve correction (learn_costs), against llama.cpp's own plain decoding
# of the same Q4_K_M file, prompt lookup (cost-aware) and the engine's plain: one process, interleaved,
# greedy, core18 + code_edit (27 prompts), 64 new tokens, 2 threads. Run from the repo root after `make models`.
set -euo pipefail
.venv/bin/python -m specdraft.cli bench --backend llama --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --config docs/results/auto_learn/variants.json \
  --methods llama_cpp,plain,prompt_lookup_ca,auto_online,auto_startup_curve --reference llama_cpp \
  --preset core18+code_edit --max-new-tokens 64 --threads 2 --out docs/results/auto_learn/llama_greedy.json
