#!/bin/sh
# 2026-12-03, AMD EPYC (AVX-512, AVX512_BF16, AVX512_VNNI, no AMX), 2 threads: which path --backend auto takes for
# the Qwen 1.5B target, measured end to end (autotune's 8 calibration prompts: Spec-Bench's last per task + code edits).
set -e
D=docs/results/backend_auto_pick_epyc_avx512
specdraft autotune --target qwen2.5-coder-1.5b --paths llama,llama:Q4_0,openvino:Q4_0,hf:w8a8 --n 8 \
  --max-new-tokens 64 --threads 2 --only prompt_lookup,suffix --no-tree-search -o $D/tune.json
cp "$(python -c 'from specdraft import paths; print(paths.file_for("qwen2.5-coder-1.5b"))')" $D/paths.json
