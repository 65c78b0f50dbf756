#!/usr/bin/env bash
# Install the pinned llama-cpp-python into the venv given as $1 (default .venv).
# The wheel is built from source for THIS CPU's instruction set (GGML_NATIVE=ON: AVX2 or AVX-512,
# whichever it has) and cached under $SPECDRAFT_HOME/llama-wheels/<instruction-set key>/, so a machine
# with another CPU builds its own instead of taking one that would die on an illegal instruction.
set -euo pipefail
VENV=${1:-.venv}
PIN=$(grep -v '^#' "$(dirname "$0")/../requirements-llama.txt" | grep llama-cpp-python | tr -d ' ')
HOME_DIR=${SPECDRAFT_HOME:-$HOME/.cache/specdraft}
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|avx2|avx512[a-z_0-9]*|fma|f16c|amx[a-z_0-9]*)$' | sort | tr '\n' ' ')
KEY=$(printf '%s %s' "$PIN" "$FLAGS" | sha256sum | cut -c1-16)
DIR=$HOME_DIR/llama-wheels/$KEY
if "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama_cpp_python') != '${PIN#*==}')" 2>/dev/null; then
  exit 0
fi
if ! ls "$DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "[specdraft] building $PIN for this CPU ($FLAGS) -- about 3.5 minutes on 2 cores" >&2
  mkdir -p "$DIR"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$VENV/bin/pip" wheel -q --no-deps --no-cache-dir -w "$DIR" "$PIN"
fi
"$VENV/bin/pip" install -q "$DIR"/llama_cpp_python-*.whl
