#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): costs, the engine's overhead, greedy token identity and exact sampling
# on a CUDA GPU, from the repository alone. At most 8 minutes on one GPU.
#
#   scripts/gpu_check.sh [--smoke] [gpu_check.py's options]
#
# Needs the repository and a Python with PyTorch (CUDA), transformers, safetensors, numpy and scipy; nothing
# is installed, downloaded or read from outside the repository (the models are built from the configs in
# data/model_configs/ with random weights). The report goes to $OUT (else ./gpu_check_out): gpu_check.json
# and gpu_check.md, with the GPU's name and the date. --smoke runs the same path on the CPU in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export OUT="${OUT:-./gpu_check_out}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('torch', 'transformers', 'safetensors', 'numpy', 'scipy') if u.find_spec(m) is None))")
if [ -n "$missing" ]; then
  echo "error: $PY lacks $missing (the GPU check installs nothing; use a Python that has them)" >&2; exit 2
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() or '--smoke' in sys.argv else 3)" "$@" || {
  echo "error: torch sees no CUDA GPU here (run with --smoke to check the script on the CPU)" >&2; exit 2; }
mkdir -p "$OUT"
exec timeout 480 "$PY" scripts/gpu_check.py --out "$OUT" "$@"
