#!/usr/bin/env bash
# Conversations resent whole each turn: specdraft with its prefix cache against llama-cpp-python keeping its
# cached prefix, both on the same Q4_0 file (8 two-turn MT-bench chats, 2 four-step agent edit traces).
set -euo pipefail
cd "$(dirname "$0")/../../.."
.venv/bin/python -m specdraft.cli bench --preset multiturn --target qwen2.5-coder-1.5b:Q4_0 --backend llama \
  --methods 'plain,plain[cold],auto,llama_cpp,llama_cpp[cold]' --n-per-task 1 --max-new-tokens 128 \
  --out docs/results/multiturn_epyc_zen4/results.json > docs/results/multiturn_epyc_zen4/summary.md
