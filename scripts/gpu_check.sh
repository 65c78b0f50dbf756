#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): greedy token identity and exact sampling on a CUDA GPU, and a bench
# of plain decoding against speculation on the Qwen2.5-Coder pair. At most 8 minutes on one GPU.
#
#   scripts/gpu_check.sh [--smoke] [gpu_check.py's options]
#
# Needs PyTorch with CUDA, installed beforehand; the repository's other requirements it uses are installed
# from requirements.txt (pinned) when missing (torch is never reinstalled). The models come from
# SPECDRAFT_HOME (default ~/.cache/specdraft), as `make models` provisions them: dense/smollm2-135m,
# dense/qwen2.5-coder-1.5b and dense/qwen2.5-coder-0.5b (each with its specdraft.json; about 9.6 GB in
# float32), and optionally an EAGLE-3 head in eagle3/qwen2.5-coder-1.5b/head. On a machine without a
# network, carry that directory and point SPECDRAFT_HOME at it. The report goes to $OUT (else
# ./gpu_check_out): gpu_check.json and gpu_check.md, with the GPU's name and the date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-./gpu_check_out}"
NEEDS="transformers tokenizers accelerate safetensors numpy scipy tqdm gguf pyyaml sortedcontainers pytest"

if ! "$PY" -c "import transformers, safetensors, scipy, gguf, sortedcontainers, yaml, pytest" 2>/dev/null; then
  pins=$(mktemp)
  for n in $NEEDS; do grep -i "^$n==" requirements.txt >> "$pins" || true; done
  echo "gpu_check: installing $(tr '\n' ' ' < "$pins")" >&2
  "$PY" -m pip install -q -r "$pins" || { echo "error: could not install the requirements above (no network?)" >&2; exit 2; }
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or '--smoke' in sys.argv else 3)" "$@" || {
  echo "error: torch sees no CUDA GPU here (run with --smoke to check the script on the CPU)" >&2; exit 2; }
mkdir -p "$OUT"
exec timeout 480 "$PY" scripts/gpu_check.py --out "$OUT" "$@"
