#!/usr/bin/env bash
# Install the pinned llama-cpp-python into the venv given as $1 (default .venv): built from source
# for this CPU, cached per CPU and build variant, and installed only once a probe in a child process
# decoded multi-token batches with it here (specdraft/models/llama_setup.py says how).
set -euo pipefail
VENV=${1:-.venv}
cd "$(dirname "$0")/.."
exec "$VENV/bin/python" -m specdraft.models.llama_setup "$VENV"
