#!/usr/bin/env bash
# 2026-12-03, AMD EPYC (AVX-512, AVX512_BF16, no AMX), 2 threads: the overlapped pair as a draft group
# (remote_draft), k = 2, the draft in a Ray actor (docs/scale.md). Run from the repo root after `make models setup-ray`.
set -euo pipefail
S=".venv/bin/python -m specdraft.cli"
$S bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 \
  --methods plain,pair_serial,pair_overlap --preset core18 --max-new-tokens 64 --k 2 --threads 2 \
  --out docs/results/scale/overlap_qwen_core18_k2_draft_group.json
$S overlap docs/results/scale/overlap_qwen_core18_k2_draft_group.json -o docs/results/scale/overlap_qwen_core18_k2_draft_group_model.json
