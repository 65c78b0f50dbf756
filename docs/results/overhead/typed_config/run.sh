#!/bin/bash
# The engine's own time per step before (BEFORE: a worktree of 31ae776) and after the typed jobs, the method
# table in core/methods.py and the slimmer SpecConfig; plain, prompt_lookup and draft_model (k=4), 48 tokens,
# three runs each (docs/results/overhead/step_overhead.py), llama.cpp and transformers twice, OpenVINO once.
#   git worktree add /tmp/before 31ae776 --detach && BEFORE=/tmp/before docs/results/overhead/typed_config/run.sh
set -u
cd "$(dirname "$0")/../../../.."
export METHODS=plain,prompt_lookup,draft_model
measure() {  # backend, target[, draft]
  for tree in before after; do
    pp=$PWD; [ $tree = before ] && pp=$BEFORE
    echo "== $1 $tree"
    PYTHONPATH=$pp .venv/bin/python docs/results/overhead/step_overhead.py "$@" 2>&1 | grep -E "ms/step|Error"
  done
}
for round in 1 2; do
  measure llama qwen2.5-coder-1.5b:Q4_0
  measure hf qwen2.5-coder-1.5b
done
measure openvino qwen2.5-coder-1.5b qwen2.5-coder-0.5b:Q4_0
